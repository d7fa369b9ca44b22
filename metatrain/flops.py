"""FLOPs of a program, counted from its jaxpr with every loop's trip count.

XLA's `cost_analysis()` counts a loop's body once, whatever its trip count (a `lax.scan` of length 1, 2 or 8
reports the same FLOPs), and everything here loops: the layer stack, the inner steps, a population's members.
`count` walks the jaxpr instead: a matrix product `dot_general` counts 2·(output size)·(contracted size), every
other primitive one FLOP per output element (XLA's convention for elementwise work), a `scan` its body times its
length, a `cond` its costliest branch; calls, `jit`s, remat and custom derivatives are entered. On a program
without loops the count is XLA's figure up to how each counts elementwise work (`tests/metatrain/test_flops.py`).
"""

from __future__ import annotations

import math

import jax

# primitives that move or reinterpret data and compute nothing
FREE = {"reshape", "broadcast_in_dim", "convert_element_type", "squeeze", "expand_dims", "transpose", "slice",
        "dynamic_slice", "dynamic_update_slice", "concatenate", "gather", "scatter", "pad", "copy", "copy_p",
        "iota", "select_n", "rev", "device_put", "stop_gradient", "sharding_constraint", "bitcast_convert_type",
        "random_bits", "random_seed", "random_wrap", "random_unwrap", "threefry2x32", "name",
        "optimization_barrier", "split"}


def _size(aval) -> int:
    return math.prod(getattr(aval, "shape", ()))


def _sub_jaxprs(eqn):
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(name)
        if sub is not None:
            yield getattr(sub, "jaxpr", sub)


def jaxpr_flops(jaxpr) -> float:
    """FLOPs of one evaluation of `jaxpr` (a `Jaxpr` or `ClosedJaxpr`)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * _size(eqn.outvars[0].aval) * math.prod(lhs[d] for d in contract)
        elif name == "scan":
            total += eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"])
        elif name == "cond":
            total += max(jaxpr_flops(b) for b in eqn.params["branches"])
        elif name == "while":
            raise ValueError("a while loop has no static trip count: FLOPs cannot be counted")
        elif any(True for _ in _sub_jaxprs(eqn)):
            total += sum(jaxpr_flops(sub) for sub in _sub_jaxprs(eqn))
        elif name not in FREE:
            total += sum(_size(v.aval) for v in eqn.outvars)
    return total


def count(fn, *args) -> float:
    """FLOPs of `fn(*args)` (arrays or `jax.ShapeDtypeStruct`s), every loop counted with its trip count."""
    return jaxpr_flops(jax.make_jaxpr(fn)(*args))


def program_flops(program) -> float:
    """FLOPs of one outer step of a `step.Program` (meta-training or pretraining), at its batch shapes."""
    from metatrain import step as step_lib

    return count(program.step, program.state_shapes, *step_lib.batch_specs(program.data, None, program.members))
