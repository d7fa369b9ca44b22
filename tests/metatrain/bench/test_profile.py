"""The profile summary on a hand-made trace: device planes first, the `XLA Ops` line, self times of nested ops."""

import jax
import pytest

from metatrain.bench import profile

EVENT = ('events {{ metadata_id: 1 offset_ps: {start} duration_ps: {duration} '
         'stats {{ metadata_id: 1 str_value: "{op}" }} stats {{ metadata_id: 2 str_value: "jit_step" }} }}')
META = ('event_metadata { key: 1 value { id: 1 name: "op" } } stat_metadata { key: 1 value { id: 1 name: "hlo_op" } } '
        'stat_metadata { key: 2 value { id: 2 name: "hlo_module" } }')


def _plane(name, lines):
    body = " ".join(f'lines {{ id: {i} name: "{line}" timestamp_ns: 0 {" ".join(EVENT.format(**e) for e in events)} }}'
                    for i, (line, events) in enumerate(lines.items(), 1))
    return f'planes {{ name: "{name}" {body} {META} }}'


def _data(*planes):
    return jax.profiler.ProfileData.from_text_proto("\n".join(planes))


US = 1_000_000  # picoseconds in a microsecond


def test_device_ops_line_with_nested_self_times():
    """A while loop of 10 µs holding a 3 µs and a 2 µs fusion (one nested again: 1 µs inside the 3), then a 4 µs
    gemm; over 2 steps. The stream line repeats the kernels and the host plane has ops of its own: neither counts."""
    ops = [dict(start=0, duration=10 * US, op="while.1"), dict(start=1 * US, duration=3 * US, op="fusion.2"),
           dict(start=2 * US, duration=1 * US, op="fusion.9"), dict(start=5 * US, duration=2 * US, op="fusion.2"),
           dict(start=20 * US, duration=4 * US, op="cublas-gemm.3")]
    data = _data(_plane("/host:CPU", {"tf_XLA": [dict(start=0, duration=50 * US, op="fusion.2")]}),
                 _plane("/device:GPU:0", {"XLA Ops": ops, "Stream #13(compute)": ops}))
    times = profile.op_times(data)
    assert times == {("jit_step", "while.1"): [5000.0, 1], ("jit_step", "fusion.2"): [4000.0, 2],
                     ("jit_step", "fusion.9"): [1000.0, 1], ("jit_step", "cublas-gemm.3"): [4000.0, 1]}
    summary = profile.top_ops(data, steps=2, n=2)
    assert summary["op_ms_per_step"] == pytest.approx(14e-3 / 2)
    assert [(o["op"], o["kind"]) for o in summary["top_ops"]] == [("while.1", "while"), ("fusion.2", "fusion")]
    assert summary["top_ops"][0]["ms_per_step"] == pytest.approx(2.5e-3) and summary["top_ops"][0]["share"] == (
        pytest.approx(5 / 14))
    assert summary["top_ops"][1]["events_per_step"] == 1
    # every op by class (not only the top n): the loop's self time, the two fusions, the gemm
    assert [(c["class"], c["ops"]) for c in summary["by_class"]] == [("loop or control", 1), ("other fusion", 2),
                                                                     ("matmul", 1)]
    assert [c["ms_per_step"] for c in summary["by_class"]] == pytest.approx([2.5e-3, 2.5e-3, 2e-3])
    assert sum(c["share"] for c in summary["by_class"]) == pytest.approx(1)


@pytest.mark.parametrize("op, cls", [
    ("gemm_fusion_dot.416", "matmul"), ("cublas-gemm.3", "matmul"), ("dot.4", "matmul"), ("ynn_fusion.3", "matmul"),
    ("convolution.2", "matmul"), ("input_reduce_fusion.27", "reduction"), ("reduce-window.1", "reduction"),
    ("loop_transpose_fusion.3", "transpose or copy"), ("copy.4", "transpose or copy"),
    ("all-reduce.1", "collective"), ("reduce-scatter.2", "collective"), ("input_scatter_fusion.5", "scatter or gather"),
    ("loop_dynamic_update_slice_fusion.2", "dynamic slice or update"), ("while.508", "loop or control"),
    ("loop_add_fusion.45", "other fusion"), ("custom-call.2", "other"),
])
def test_op_classes_from_xla_names(op, cls):
    """XLA's op names on GPU (`gemm_fusion_dot`, `input_reduce_fusion`), TPU and CPU (`ynn_fusion`: a dot)."""
    assert profile.op_class(op) == cls


def test_host_threads_without_device_ops():
    data = _data(_plane("/host:CPU", {"tf_XLAEigen": [dict(start=0, duration=2 * US, op="dot.4")],
                                      "python": []}))
    assert profile.op_times(data) == {("jit_step", "dot.4"): [2000.0, 1]}


def test_file_names_keep_letters_digits_dot_underscore_dash():
    assert profile.file_name("mixflow+remat+save") == "mixflow_remat_save"
    assert profile.file_name("a-b_c.d/e f") == "a-b_c.d_e_f"


def test_ops_of_a_compiled_programs_text():
    """Every computation's instructions, with the JAX operation each came from; a loop's tuple shape cut."""
    x = jax.ShapeDtypeStruct((8, 8), jax.numpy.float32)

    def f(a):
        return jax.lax.fori_loop(0, 3, lambda i, c: jax.numpy.sin(c) @ c, a).sum()

    text = jax.jit(f).lower(x).compile().as_text()
    ops = profile.hlo_ops(text)
    whiles = [o for o in ops.values() if o["opcode"] == "while"]
    assert len(whiles) == 1 and whiles[0]["shape"].startswith("(s32[], f32[8,8]") and len(whiles[0]["shape"]) <= 300
    dots = [o for o in ops.values() if o["opcode"] == "dot"]  # inside the loop's body
    assert dots and all(o["shape"].startswith("f32[8,8]") and o["source"].endswith("dot_general") for o in dots)
