"""What the compiler's buffer assignment says is live: each place in memory once, over the schedule."""

import jax
import jax.numpy as jnp

from metatrain.bench import buffers

N = 1 << 20  # floats: 4 MiB per buffer


def _compile(f, *shapes, folder):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    with buffers.fresh_compiles():
        compiled = jax.jit(f).lower(*args).compile(compiler_options=buffers.dump_options(str(folder)))
    return compiled.memory_analysis()


def test_four_temporaries_live_at_once_are_the_peak(tmp_path):
    """x and four elementwise temporaries of its size, all needed by the last line: five 4 MiB buffers at the
    peak, four of them temporaries, and no more than the compiled program allocates."""

    def f(x):
        a = jnp.sin(x)
        b = jnp.cos(a) * x
        c = jnp.exp(b) + a
        d = jnp.tanh(c) * b
        return jnp.stack([jnp.sort(y)[7] for y in (a, b, c, d)])

    mem = _compile(f, (N,), folder=tmp_path)
    regions, n = buffers.read_dump(str(tmp_path))
    peak = buffers.peak_regions(regions, n)
    big = [r for r in peak if r["bytes"] >= 4 * N]
    assert sorted(r["kind"] for r in big).count("argument") == 1 and len(big) >= 5, big
    live = sum(r["bytes"] for r in peak)
    assert live == buffers.timeline(regions, n).max()
    assert live <= mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes


def test_a_scans_stacked_output_and_the_loop_carrying_it_are_one_buffer(tmp_path):
    """A scan writes T=8 rows of N floats into one stack, carried through the loop under other names (the
    while loop's tuple, the dynamic-update-slice): counted once, the peak has it once beside the arguments, and the
    stack is in the breakdown as a parameter-sized buffer (8 x a leaf of N elements)."""

    def f(x, w):  # [N], [8, N]
        def body(h, wi):
            h = jnp.tanh(h * wi)
            return h, h
        return jax.lax.scan(body, x, w)[1]

    mem = _compile(f, (N,), (8, N), folder=tmp_path)
    regions, n = buffers.read_dump(str(tmp_path))
    stack, args = 8 * N * 4, mem.argument_size_in_bytes  # the output stack; x and w (itself [8, N])
    live = buffers.timeline(regions, n).max()
    assert stack + args <= live < 2 * stack + args  # the stack's five names counted once
    assert live <= mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
    b = buffers.breakdown(buffers.peak_regions(regions, n), [(N,)], 4 * N)
    assert b["argument_bytes"] == stack + 4 * N and b["live_bytes"] == live
    # parameter-sized: the stack once, and the carried h, [N] like the leaf
    assert b["param_sized_bytes"] == stack + 4 * N and b["param_sized_shapes"] == {f"f32[8,{N}]": 1, f"f32[{N}]": 1}
    out = buffers.profile(str(tmp_path), [(N,)], 4 * N, points=50)
    t = out["timeline"]
    assert len(t["live_bytes"]) == min(50, t["positions"]) and max(t["live_bytes"]) == live
    assert all(a <= v for a, v in zip(t["argument_bytes"], t["live_bytes"]))
