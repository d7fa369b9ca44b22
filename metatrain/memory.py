"""Ahead-of-time memory profile of the meta-gradient, per variant, from the compiler's own buffer assignment.

Nothing is allocated: `value_and_grad` of the outer loss is lowered with `jax.ShapeDtypeStruct` inputs
and compiled, for this machine's CPU or for a TPU topology (libtpu, no TPU needed), and
`compiled.memory_analysis()` gives the sizes. We split the peak as the paper does (Sec. 4, A.3):

- peak     = arguments + outputs - aliased + temp   (everything live at the high-water mark)
- static   = arguments + outputs - aliased + per-step checkpoints, where the checkpoints are
             T x (θ, υ) and, with saved inner gradients, T x ∇L: allocated once, written once.
- dynamic  = peak - static = temp - checkpoints: activations and partial derivatives that are
             reused from step to step. This is what mixed-mode differentiation reduces.

The checkpoint bytes are counted from the inner state's shapes (XLA keeps them inside `temp`). On a
TPU topology every figure is per chip (FSDP over all chips). A program over the chip's HBM does not
compile there; its row carries the bytes the compiler asked for as the peak (`fits: false`), with static
bytes counted from shapes and temp unknown. The compiler refuses a program when its temporaries pass the
HBM: one that compiles can still be over HBM with its arguments, so `fits` is always peak <= HBM.
"""

from __future__ import annotations

import time
from typing import Callable

import jax

from metatrain.config import MeshConfig
from metatrain.problem import Shapes, Variant, abstract_state, build_task
from metatrain.sharding import abstract, batch_sharding, device_bytes, make_mesh, tree_shardings
from metatrain.unroll import meta_value_and_grad, segments
from models import ModelConfig, param_count


def compiled_memory(compiled) -> dict:
    """A compiled program's buffer sizes, its peak (arguments + outputs - aliased + temp) and XLA's FLOPs."""
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    sizes = {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
             "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes}
    peak = sizes["argument_bytes"] + sizes["output_bytes"] - sizes["alias_bytes"] + sizes["temp_bytes"]
    return sizes | {"peak_bytes": peak, "flops": float((cost or {}).get("flops", 0.0))}


def _on_mesh(tree, mesh):
    return None if tree is None else abstract(tree, tree_shardings(tree, mesh))


def profile(task_name: str, model: ModelConfig, shapes: Shapes, variant: Variant, topology: str | None = None
            ) -> dict:
    """One row: memory and FLOPs of `value_and_grad` of the outer loss for this variant (per chip on a TPU)."""
    model = variant.model(model)
    task = build_task(task_name, model, remat=variant.remat)
    meta, inner = abstract_state(task)
    batches, outer_batch = shapes.batches(model.vocab_size)
    theta, opt_state = jax.eval_shape(task.inner_start, meta, inner)
    row = {"variant": variant.name, "task": task_name, "backend": "tpu" if topology else jax.default_backend(),
           "topology": topology, "n_layers": model.n_layers, "d_model": model.d_model, "n_heads": model.n_heads,
           "d_ff": model.d_ff, "vocab": model.vocab_size, "params": param_count(model), "attention": model.attention,
           "compute_dtype": str(model.activation_dtype), "seq_len": shapes.seq_len,
           "batch": shapes.batch, "inner_steps": shapes.inner_steps}
    value_and_grad = meta_value_and_grad(task, variant.unroll)

    def fn(meta, inner, batches, outer_batch):  # what the Trainer keeps: no final inner state for MAML-like tasks
        (value, aux), grads = value_and_grad(meta, inner, batches, outer_batch)
        return value, aux.inner_losses, grads, None if task.resets_inner else aux.inner
    hbm = None
    if topology:
        from metatrain.tpu_compile import topology_devices

        devices, hbm = topology_devices(topology)
        mesh = make_mesh(MeshConfig(data=1, fsdp=-1), devices)
        if shapes.batch % len(devices):
            raise ValueError(f"--batch {shapes.batch} does not split over the {len(devices)} chips of {topology}")
        meta, inner, theta, opt_state = (_on_mesh(t, mesh) for t in (meta, inner, theta, opt_state))
        batches = abstract(batches, jax.tree.map(lambda _: batch_sharding(mesh, leading=1), batches))
        outer_batch = abstract(outer_batch, jax.tree.map(lambda _: batch_sharding(mesh), outer_batch))
    # static parts, named: η, the inner Adam state υ, and the per-step checkpoints: T x (θ, υ[, ∇L]), or with
    # an inner-checkpoint schedule the (θ, υ) at the start of each segment (re-run parts are dynamic memory)
    state = device_bytes(theta) + device_bytes(opt_state)
    kept = segments(shapes.inner_steps, variant.inner_checkpoint)
    checkpoints = (shapes.inner_steps * (state + (device_bytes(theta) if variant.save else 0))
                   if len(kept) == shapes.inner_steps else len(kept) * state)
    row.update(inner_checkpoint=variant.inner_checkpoint, param_bytes=device_bytes(meta),
               adam_bytes=device_bytes(opt_state), checkpoint_bytes=checkpoints, hbm_bytes=hbm)

    start = time.perf_counter()
    try:
        compiled = jax.jit(fn).lower(meta, inner, batches, outer_batch).compile()
    except Exception as e:
        from metatrain.tpu_compile import required_bytes

        need = required_bytes(e) if topology else None
        if need is None:
            raise
        io = device_bytes((meta, inner, batches, outer_batch)) + _output_bytes(fn, meta, inner, batches, outer_batch)
        static = io + row["checkpoint_bytes"]
        return row | {"fits": False, "peak_bytes": need, "static_bytes": static, "dynamic_bytes": need - static,
                      "temp_bytes": None, "argument_bytes": None, "output_bytes": None, "alias_bytes": None,
                      "flops": None, "compile_s": round(time.perf_counter() - start, 2)}
    seconds = time.perf_counter() - start
    m = compiled_memory(compiled)
    static = m["peak_bytes"] - m["temp_bytes"] + row["checkpoint_bytes"]
    return row | m | {
        "fits": None if hbm is None else m["peak_bytes"] <= hbm,  # the compiler refuses only over-HBM *temporaries*
        "static_bytes": static, "dynamic_bytes": m["peak_bytes"] - static, "compile_s": round(seconds, 2),
    }


def _output_bytes(fn, meta, inner, batches, outer_batch) -> int:
    """Per-chip bytes of the outputs (V, losses, dV/dη, final inner state), sharded like the inputs they mirror."""
    value, losses, _, final = jax.eval_shape(fn, meta, inner, batches, outer_batch)
    return device_bytes(meta) + (device_bytes(inner) if final is not None else 0) + device_bytes((value, losses))


def add_ratios(rows: list[dict], baseline: str) -> list[dict]:
    """Adds baseline ÷ row ratios for temp, peak and dynamic bytes, within each config group."""
    key = lambda r: (r["task"], r["params"], r["n_layers"], r["d_model"], r["seq_len"], r["batch"], r["inner_steps"])
    base = {key(r): r for r in rows if r["variant"] == baseline}
    for r in rows:
        b = base.get(key(r))
        for what in ("temp", "peak", "dynamic"):
            ok = b and b[f"{what}_bytes"] is not None and (r[f"{what}_bytes"] or 0) > 0
            r[f"{what}_ratio"] = b[f"{what}_bytes"] / r[f"{what}_bytes"] if ok else None
    return rows


def run(task_names: list[str], configs: list[tuple[ModelConfig, Shapes]], variant_list: list[Variant],
        baseline: str = "default+remat", topology: str | None = None,
        progress: Callable = lambda it, **_: it) -> list[dict]:
    jobs = [(t, m, s, v) for t in task_names for m, s in configs for v in variant_list]
    rows = []
    for t, m, s, v in progress(jobs, desc="compiling"):
        rows.append(profile(t, m, s, v, topology))
    return add_ratios(rows, baseline)


def count(n: int) -> str:
    """A parameter count for people: 41.6M, 1.02B, 12.3K."""
    return next(f"{n / s:,.{d}f}{u}" for s, u, d in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1), (1, "", 0))
                if n >= s or s == 1)


def table(rows: list[dict], baseline: str) -> str:
    """Markdown table (GiB when the largest peak passes 4 GiB, else MiB), with ratios against the baseline."""
    unit, scale = ("GiB", 2**30) if max(r["peak_bytes"] for r in rows) > 4 * 2**30 else ("MiB", 2**20)
    size = lambda b: "-" if b is None else f"{b / scale:,.{2 if unit == 'GiB' else 1}f}"
    ratio = lambda x: "-" if x is None else f"{x:.2f}x"
    cols = ["task", "params", "L", "variant", f"peak {unit}", f"static {unit}", f"dynamic {unit}",
            f"checkpoints {unit}", f"temp {unit}", "GFLOPs", "peak ratio", "dynamic ratio"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        peak = size(r["peak_bytes"]) + ("" if r.get("fits") is not False else " (over HBM)")
        flops = "-" if r["flops"] is None else f"{r['flops'] / 1e9:,.1f}"
        lines.append(f"| {r['task']} | {count(r['params'])} | {r['n_layers']} | {r['variant']} | {peak} | "
                     f"{size(r['static_bytes'])} | {size(r['dynamic_bytes'])} | {size(r['checkpoint_bytes'])} | "
                     f"{size(r['temp_bytes'])} | {flops} | {ratio(r['peak_ratio'])} | {ratio(r['dynamic_ratio'])} |")
    where = f"per chip, {rows[0]['topology']}" if rows[0]["topology"] else rows[0]["backend"]
    return "\n".join(lines) + (f"\n({where}; ratios: {baseline} ÷ variant, higher means less memory than "
                               f"{baseline}; static = inputs + outputs + per-step checkpoints, dynamic = the rest)")
