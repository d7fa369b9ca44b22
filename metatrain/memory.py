"""Ahead-of-time memory profile of the meta-gradient, per variant, from XLA's own buffer assignment.

Nothing is allocated: the outer step is lowered with `jax.ShapeDtypeStruct` inputs and compiled, and
`compiled.memory_analysis()` gives the sizes. We split the peak as the paper does (Sec. 4, A.3):

- peak     = arguments + outputs - aliased + temp   (everything live at the high-water mark)
- static   = arguments + outputs - aliased + per-step checkpoints, where the checkpoints are
             T x (θ, υ) and, with saved inner gradients, T x ∇L: allocated once, written once.
- dynamic  = peak - static = temp - checkpoints: activations and partial derivatives that are
             reused from step to step. This is what mixed-mode differentiation reduces.

The checkpoint bytes are counted from the inner state's shapes (XLA keeps them inside `temp`).
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp

from metatrain.problem import Shapes, Variant, abstract_state, build_task
from metatrain.unroll import meta_value_and_grad
from models import ModelConfig


def state_bytes(tree) -> int:
    """Bytes of a pytree of arrays or ShapeDtypeStructs."""
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def profile(task_name: str, model: ModelConfig, shapes: Shapes, variant: Variant) -> dict:
    """One row: memory and FLOPs of `value_and_grad` of the outer loss for this variant."""
    task = build_task(task_name, model, remat=variant.remat)
    meta, inner = abstract_state(task)
    batches, outer_batch = shapes.batches(model.vocab_size)
    start = time.perf_counter()
    compiled = jax.jit(meta_value_and_grad(task, variant.unroll)).lower(meta, inner, batches, outer_batch).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost

    theta, opt_state = jax.eval_shape(task.inner_start, meta, inner)
    per_step = state_bytes(theta) + state_bytes(opt_state) + (state_bytes(theta) if variant.save else 0)
    checkpoints = shapes.inner_steps * per_step
    io = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    peak = io + mem.temp_size_in_bytes
    return {
        "variant": variant.name, "task": task_name, "backend": jax.default_backend(),
        "n_layers": model.n_layers, "d_model": model.d_model, "n_heads": model.n_heads, "d_ff": model.d_ff,
        "vocab": model.vocab_size, "seq_len": shapes.seq_len, "batch": shapes.batch,
        "inner_steps": shapes.inner_steps,
        "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
        "peak_bytes": peak, "checkpoint_bytes": checkpoints, "static_bytes": io + checkpoints,
        "dynamic_bytes": peak - io - checkpoints, "flops": float((cost or {}).get("flops", 0.0)),
        "compile_s": round(seconds, 2),
    }


def add_ratios(rows: list[dict], baseline: str) -> list[dict]:
    """Adds baseline ÷ row ratios for temp, peak and dynamic bytes, within each config group."""
    key = lambda r: (r["task"], r["n_layers"], r["d_model"], r["seq_len"], r["batch"], r["inner_steps"])
    base = {key(r): r for r in rows if r["variant"] == baseline}
    for r in rows:
        b = base.get(key(r))
        for what in ("temp", "peak", "dynamic"):
            r[f"{what}_ratio"] = (b[f"{what}_bytes"] / r[f"{what}_bytes"]) if b and r[f"{what}_bytes"] > 0 else None
    return rows


def run(task_name: str, configs: list[tuple[ModelConfig, Shapes]], variant_list: list[Variant],
        baseline: str = "default+remat", progress: Callable = lambda it, **_: it) -> list[dict]:
    jobs = [(m, s, v) for m, s in configs for v in variant_list]
    return add_ratios([profile(task_name, m, s, v) for m, s, v in progress(jobs, desc="compiling")], baseline)


def table(rows: list[dict], baseline: str) -> str:
    """Markdown table, MiB, with ratios against the baseline variant."""
    mib = lambda b: f"{b / 2**20:,.1f}"
    ratio = lambda x: "-" if x is None else f"{x:.2f}x"
    head = ("| task | L | variant | temp MiB | static MiB | dynamic MiB | peak MiB | GFLOPs "
            f"| temp ratio | dynamic ratio |\n|{'---|' * 10}")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['task']} | {r['n_layers']} | {r['variant']} | {mib(r['temp_bytes'])} | "
                     f"{mib(r['static_bytes'])} | {mib(r['dynamic_bytes'])} | {mib(r['peak_bytes'])} | "
                     f"{r['flops'] / 1e9:,.1f} | {ratio(r['temp_ratio'])} | {ratio(r['dynamic_ratio'])} |")
    return "\n".join(lines) + f"\n(ratios: {baseline} ÷ variant; higher means less memory than {baseline})"
