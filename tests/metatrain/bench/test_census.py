"""The census of a compiled program's kernels: FLOPs of its matrix products, bytes, calls per loop trip."""

import jax
import jax.numpy as jnp

from metatrain.bench import census

# a loop of 3 trips whose body runs a matrix product fused with its operands' slices ([4,8] x [8,16]) and an
# elementwise kernel; a dynamic slice and an in-place dynamic update outside it, the update again as an asynchronous
# pair (its start the kernel); a cuBLAS product ([32,64] x [64,8])
HLO = """HloModule m, entry_computation_layout={(f32[4,8]{1,0}, f32[8,16]{1,0})->f32[4,16]{1,0}}

%gemm_fusion_dot.1_computation (parameter_0: f32[4,8], parameter_1: f32[8,16]) -> f32[4,16] {
  %parameter_0 = f32[4,8]{1,0} parameter(0)
  %parameter_1 = f32[8,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,16]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_tanh (param_0: f32[4,16]) -> f32[4,16] {
  %param_0 = f32[4,16]{1,0} parameter(0)
  ROOT %tanh.1 = f32[4,16]{1,0} tanh(%param_0)
}

%fused_slice (param_0.1: f32[10,4,16], param_1.1: s32[]) -> f32[1,4,16] {
  %param_0.1 = f32[10,4,16]{2,1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %constant.1 = s32[] constant(0)
  ROOT %dynamic-slice.1 = f32[1,4,16]{2,1,0} dynamic-slice(%param_0.1, %param_1.1, %constant.1, %constant.1), dynamic_slice_sizes={1,4,16}
}

%fused_update (param_0.2: f32[10,4,16], param_1.2: f32[1,4,16], param_2.2: s32[]) -> f32[10,4,16] {
  %param_0.2 = f32[10,4,16]{2,1,0} parameter(0)
  %param_1.2 = f32[1,4,16]{2,1,0} parameter(1)
  %param_2.2 = s32[] parameter(2)
  %constant.2 = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[10,4,16]{2,1,0} dynamic-update-slice(%param_0.2, %param_1.2, %param_2.2, %constant.2, %constant.2)
}

%body (p: (s32[], f32[4,8], f32[8,16], f32[4,16])) -> (s32[], f32[4,8], f32[8,16], f32[4,16]) {
  %p = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[4,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %a = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %b = f32[8,16]{1,0} get-tuple-element(%p), index=2
  %gemm_fusion_dot.1 = f32[4,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.1_computation, metadata={op_name="jit(f)/dot_general"}
  %loop_tanh_fusion = f32[4,16]{1,0} fusion(%gemm_fusion_dot.1), kind=kLoop, calls=%fused_tanh, metadata={op_name="jit(f)/tanh"}
  ROOT %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[4,16]{1,0}) tuple(%i, %a, %b, %loop_tanh_fusion)
}

%cond (q: (s32[], f32[4,8], f32[8,16], f32[4,16])) -> pred[] {
  %q = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[4,16]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %three), direction=LT
}

ENTRY %main (x: f32[4,8], y: f32[8,16]) -> f32[4,16] {
  %x = f32[4,8]{1,0} parameter(0)
  %y = f32[8,16]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = f32[4,16]{1,0} constant({...})
  %stack = f32[10,4,16]{2,1,0} constant({...})
  %tuple.1 = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[4,16]{1,0}) tuple(%zero, %x, %y, %init)
  %while.1 = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[4,16]{1,0}) while(%tuple.1), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[4,16]{1,0} get-tuple-element(%while.1), index=3
  %slice_fusion = f32[1,4,16]{2,1,0} fusion(%stack, %zero), kind=kLoop, calls=%fused_slice
  %update_fusion = f32[10,4,16]{2,1,0} fusion(%stack, %slice_fusion, %zero), kind=kLoop, calls=%fused_update
  %fusion-start.1 = ((f32[10,4,16]{2,1,0}, f32[1,4,16]{2,1,0}, s32[]), f32[10,4,16]{2,1,0}, u32[]) fusion-start(%stack, %slice_fusion, %zero), kind=kLoop, calls=%fused_update
  %fusion-done.1 = f32[10,4,16]{2,1,0} fusion-done(%fusion-start.1)
  %w = f32[32,64]{1,0} constant({...})
  %v = f32[64,8]{1,0} constant({...})
  %cublas-gemm.1 = (f32[32,8]{1,0}, s8[1024]{0}) custom-call(%w, %v), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %r = f32[4,16]{1,0} copy(%out)
}
"""  # noqa: E501 (HLO as XLA prints it)


def test_kernels_counted_by_hand():
    found, known = census.kernels(HLO)
    assert known and set(found) == {"gemm_fusion_dot.1", "loop_tanh_fusion", "lt", "slice_fusion", "update_fusion",
                                    "fusion-start.1", "cublas-gemm.1", "r"}
    gemm, tanh, compare = found["gemm_fusion_dot.1"], found["loop_tanh_fusion"], found["lt"]
    assert (gemm["calls"], tanh["calls"], compare["calls"]) == (3, 3, 4)  # a condition runs once more than the body
    assert gemm["flops"] == 3 * 2 * 4 * 16 * 8  # 2·M·N·K per trip
    assert gemm["bytes"] == 3 * 4 * (4 * 8 + 8 * 16 + 4 * 16)  # both operands and the output, per trip
    assert tanh["flops"] == 0 and tanh["bytes"] == 3 * 4 * 2 * 4 * 16
    assert found["slice_fusion"]["bytes"] == 2 * 4 * 64  # reads and writes its slice, not the stack
    assert found["update_fusion"]["bytes"] == 2 * (4 * 64 + 4)  # writes its update in place (and reads an index)
    assert found["fusion-start.1"] == {**found["update_fusion"], "opcode": "fusion-start"}
    assert found["cublas-gemm.1"]["flops"] == 2 * 32 * 8 * 64 and found["cublas-gemm.1"]["calls"] == 1
    summary = census.census(HLO)
    assert summary["flops"] == 3 * 1024 + 2 * 32 * 8 * 64 and summary["kernels"] == 3 + 3 + 4 + 1 + 1 + 1 + 1 + 1
    assert [p["op"] for p in summary["products"]] == ["cublas-gemm.1", "gemm_fusion_dot.1"]
    assert sum(c["bytes"] for c in summary["by_class"]) == summary["bytes"]


def test_a_compiled_scan_and_its_gradient_by_hand():
    """A scan of 5 steps of tanh(c·w), c [8, 64], w [64, 64], and its gradient: per step one product forward and two
    backward (c's cotangent and w's), each 2·8·64·64 FLOPs, whatever XLA fuses them with."""

    def f(w, x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)[0].sum()

    compiled = jax.jit(jax.grad(f)).lower(jnp.ones((64, 64)), jnp.ones((8, 64))).compile()
    summary = census.census(compiled.as_text())
    assert summary["trip_counts_known"] and summary["flops"] == 5 * 3 * 2 * 8 * 64 * 64
