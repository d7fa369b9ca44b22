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
    # every live buffer by shape: the stack (once) beside the argument w of its shape; all of the peak
    by_shape = {shape: (count, n) for shape, count, n in b["by_shape"]}
    assert by_shape[f"f32[8,{N}]"] == (2, 2 * stack) and sum(n for _, n in by_shape.values()) == live
    out = buffers.profile(str(tmp_path), [(N,)], 4 * N, points=50)
    t = out["timeline"]
    assert len(t["live_bytes"]) == min(50, t["positions"]) and max(t["live_bytes"]) == live
    assert all(a <= v for a, v in zip(t["argument_bytes"], t["live_bytes"]))


def _region(name, shape, start, end, op, values=None, value_ops=None):
    values = values or [name]
    return {"name": name, "bytes": 4 * N, "shape": shape, "kind": "temp", "op": op, "start": start, "end": end,
            "values": values, "value_ops": value_ops or [op] * len(values)}


def test_kept_states_at_peak_are_parameter_sized_buffers_written_before_the_backward_pass():
    """A schedule of 10 positions, θ one leaf of N floats: the outer backward pass starts at 5 (the first
    parameter-sized buffer an outer `transpose(...)` made; a zeros splat XLA shared between the passes, named for
    the backward one, and a copy of it do not count); the peak at 7. A checkpoint is parameter-sized, made before
    5 and live at 7: the saved gradient is; the activation (not θ's shape), the gradient freed at 4, the splat
    never written in the forward pass and the backward pass's own buffers are not."""
    leaf = f"f32[{N}]{{0}}"
    regions = [
        _region("saved_grad", leaf, 1, 9, "jit(f)/jvp(transpose(jvp()))/dot_general", ["saved_grad", "while.3{1}"]),
        _region("freed_grad", leaf, 1, 4, "jit(f)/jvp(transpose(jvp()))/dot_general"),
        _region("activation", f"f32[{N // 2},2]{{1,0}}", 2, 8, "jit(f)/jvp()/tanh"),
        _region("broadcast.1", leaf, 0, 8, "jit(f)/transpose(jvp())/while"),  # zeros kept for the backward pass
        _region("copy.2", leaf, 3, 8, "jit(f)/transpose(jvp())/while"),
        _region("fusion.5", leaf, 5, 9, "jit(f)/transpose(jvp())/dot_general"),  # the outer loss's gradient
        _region("fusion.6", leaf, 7, 7, "jit(f)/transpose(jvp())/while/body/add"),
    ]
    got = buffers.kept_states_at_peak(regions, 10, [(N,)])
    assert buffers.timeline(regions, 10).argmax() == 7
    assert got == {"peak_position": 7, "backward_start": 5, "kept_live_bytes": 4 * N + 4 * N}, got
    # "copy.2" is made before the backward pass and written: counted beside the saved gradient. Without a backward
    # pass there is nothing to split
    assert buffers.kept_states_at_peak(regions[:3], 10, [(N,)])["backward_start"] is None


def test_a_buffer_only_the_backward_pass_wrote_is_not_a_checkpoint():
    """A zeros splat made at 2, then carried into a loop (no name) and accumulated into by the backward pass: the
    outer loss's gradient, not a checkpoint, though it starts before the backward pass's first own buffer (5). A
    splat XLA shared between the passes, named for the backward one, then written by the forward pass, is one."""
    leaf, back = f"f32[{N}]{{0}}", "jit(f)/transpose(jvp())/while"
    accumulator = _region("broadcast.7", leaf, 2, 9, back, ["broadcast.7", "arg_tuple.1{2}", "fusion.9", "while.4{2}"],
                          [back, "", back + "/body/dot_general", back])
    shared = _region("broadcast.8", leaf, 1, 9, back, ["broadcast.8", "fusion.10"], [back, "jit(f)/jvp()/dot_general"])
    regions = [accumulator, shared, _region("fusion.5", leaf, 5, 9, "jit(f)/transpose(jvp())/dot_general")]
    got = buffers.kept_states_at_peak(regions, 10, [(N,)])
    assert got["backward_start"] == 5 and got["kept_live_bytes"] == 4 * N, got
    assert not buffers.written_forward(accumulator) and buffers.written_forward(shared)
