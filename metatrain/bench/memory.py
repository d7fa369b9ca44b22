"""Ahead-of-time memory of the Trainer's outer step, per variant, from the compiler's own buffer assignment.

Nothing is allocated: the run's outer step (`metatrain.step`: T inner steps, the outer loss, its
meta-gradient and the meta-optimizer update, state donated) is lowered with `jax.ShapeDtypeStruct`
inputs and compiled, for this machine's CPU, a TPU topology (libtpu, no TPU needed) or NVIDIA GPUs (JAX's CUDA
plugin, no GPU needed), and
`compiled.memory_analysis()` gives the sizes. We split the peak as the paper does (Sec. 4, A.3):

- peak     = everything live at the high-water mark: on TPU the compiler's own figure (`aot.compiled_memory`),
             on CPU and GPU arguments + outputs - aliased + temp
- static   = arguments + outputs - aliased + kept inner states + ∇η: the state (η, the meta-optimizer
             state, a carried inner state), the batches, (T - 1) x (θ, υ) (the first step's are the inputs) and
             with saved inner gradients T x ∇L, and the meta-gradient: allocated once, written once.
- dynamic  = peak - static: activations and partial derivatives that are reused from step to step.
             This is what mixed-mode differentiation reduces.
- Where no loop over inner steps is left (`+unroll`, or T=2: `unroll.straight_line`) the checkpoints are freed
  step by step and the compiler keeps only those it needs (at T=2 it recomputes the first step's Adam moments from
  the saved gradient): their bytes are then read from the buffer assignment (`buffers.kept_states_at_peak`: the
  parameter-sized buffers written in the forward pass and live at the peak), at most the count from shapes;
  `static_from` says which ("buffers" or "shapes"). A row without a backward pass found in the dump, or whose θ
  has no leaf of 64K elements (too small to tell from activations), is not split.

The checkpoint and ∇η bytes are counted from shapes (XLA keeps them inside `temp`). On a TPU topology
every figure is per chip (FSDP over all chips). A program over the chip's HBM, which the TPU compiler
refuses, is compiled past the limit (`aot.compile_exact`): its row is exact too, with `fits: false` and
the refusal's estimate kept as `refused_bytes`.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp

from metatrain.aot import topology_backend
from metatrain.bench import buffers
from metatrain.bench.compile import compile_report, program_for
from metatrain.bench.variants import Variant
from metatrain.config import Config
from metatrain.errors import ConfigError
from metatrain.models import param_count
from metatrain.sharding import abstract, device_bytes, tree_shardings
from metatrain.unroll import kept_states, offloadable, segments, straight_line


def _on_device(tree, mesh, select=lambda x: True) -> int:
    """Bytes one device holds of `tree` sharded as the state is, over the leaves `select` picks."""
    if tree is None:
        return 0
    return device_bytes([x for x in jax.tree.leaves(abstract(tree, tree_shardings(tree, mesh))) if select(x)])


def profile(cfg: Config, variant: Variant, topology: str | None = None, with_breakdown: bool = False) -> dict:
    """One row: memory and FLOPs of the run's outer step computed as `variant` does (per chip on a TPU);
    `with_breakdown`: also what is live at the peak and over the schedule (`bench.buffers`), under "breakdown" and
    "timeline"."""
    cfg = variant.apply(cfg)
    built = program_for(cfg, topology)
    program, d = built[0], cfg.data
    state, mesh = program.state_shapes, program.mesh
    theta, opt_state = jax.eval_shape(program.task.inner_start, state["meta"], state["inner"])
    stored = lambda tree: tree if not variant.state_dtype else jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, variant.state_dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else x, tree)  # the kept inner states' dtype (+bf16_state)
    kept = segments(d.inner_steps, variant.kept_states)
    peel = variant.method.peel  # the first step's (θ, υ) are the outer step's inputs (`unroll.peeled`)

    def kept_bytes(select=lambda x: True):
        """kept states: (T - 1) x (θ, υ) (T x with +offload_states: not peeled) [+ T x ∇L]; with a
        schedule the (θ, υ) at each segment start (re-run parts are dynamic memory); of the leaves `select` picks"""
        params = _on_device(stored(theta), mesh, select)
        per_step = params + _on_device(stored(opt_state), mesh, select)
        grads = d.inner_steps * params if variant.save and len(kept) == d.inner_steps else 0
        return kept_states(d.inner_steps, variant.kept_states, peel) * per_step + grads

    checkpoints = kept_bytes()
    # +offload_states: on a TPU the kept states' matrices are in host memory (memory_analysis' host temp), not in the
    # device's peak (`unroll.stored_step`); on CPU host memory is the same memory
    offloaded = kept_bytes(offloadable) if variant.offload_states and topology else 0
    # +offload_moments: the meta-optimizer's matrices are host-memory arguments there (the same rule)
    opt_offloaded = _on_device(state["meta_opt"], mesh, offloadable) if variant.offload_moments and topology else 0
    # +offload_params: η's matrices too
    params_offloaded = _on_device(state["meta"], mesh, offloadable) if variant.offload_params and topology else 0
    row = identity(cfg, variant, topology) | {
        "kept_states": variant.kept_states, "inner_peeled": peel,
        "param_bytes": _on_device(state["meta"], mesh) - params_offloaded, "offloaded_param_bytes": params_offloaded,
        "meta_opt_bytes": _on_device(state["meta_opt"], mesh) - opt_offloaded,
        "offloaded_opt_bytes": opt_offloaded,
        # the carried inner state (θ, υ) and, with baseline=uniform, the baseline's (η frozen, θ, υ)
        "inner_bytes": _on_device(state["inner"], mesh) + _on_device(state.get("base"), mesh),
        "adam_bytes": _on_device(opt_state, mesh), "kept_bytes": checkpoints - offloaded,
        "offloaded_bytes": offloaded,
        # LoRA: θ is the adapters; the frozen base weights are an argument of the step
        "frozen_bytes": _on_device(state.get("frozen"), mesh),
        "meta_model_params": param_count(program.task.meta_model)}
    row["grad_bytes"] = row["param_bytes"] + params_offloaded  # ∇η is on the device
    # no loop left (+unroll, or T=2): each step's checkpoint is freed once its backward pass has used it, and the
    # compiler need not keep all of them; what it keeps is read from its buffer assignment
    straight = straight_line(d.inner_steps, variant.unroll, peel)
    leaves = jax.tree.leaves(abstract(theta, tree_shardings(theta, mesh)))
    shapes = [x.sharding.shard_shape(x.shape) for x in leaves]  # per device
    split = straight and buffers.tells_apart(shapes)  # else (a toy model) no split: not worth a dump
    dumping = with_breakdown or split
    with tempfile.TemporaryDirectory() as dump:
        with buffers.fresh_compiles() if dumping else contextlib.nullcontext():
            report = compile_report(cfg, topology, built, buffers.dump_options(dump) if dumping else None)
        if dumping and report["exact"]:
            if with_breakdown:
                row |= buffers.profile(dump, shapes, _on_device(theta, mesh))
            if split:
                row |= buffers.kept_states_at_peak(*buffers.read_dump(dump), shapes)
    row |= {k: report.get(k) for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "temp_sum_bytes",
                                       "host_temp_bytes", "host_io_bytes", "flops", "fits", "exact", "hbm_bytes",
                                       "refused_bytes", "compile_s", "plan", "device", "versions")}
    if "census" in report:  # a CPU or GPU program's kernels
        row["census"] = report["census"]
    if not report["exact"]:
        raise ConfigError(f"{variant.name} on {topology}: the TPU compiler refused it ({report['message']}) and "
                          f"compiling it past the HBM limit failed too, so there is no exact figure; compare on a "
                          f"v5p topology (v5e cannot compile past the limit) with shapes nearer its HBM")
    peak = report["peak_bytes"]
    entry = report["argument_bytes"] + report["output_bytes"] - report["alias_bytes"]
    if not straight:
        static = entry + row["kept_bytes"] + row["grad_bytes"]
    elif row.get("backward_start") is None:  # no backward pass found in the dump: no split
        static = None
    else:  # never more than the shapes count
        static = entry + min(row["kept_live_bytes"], row["kept_bytes"]) + row["grad_bytes"]
    return row | {"peak_bytes": peak, "static_bytes": static, "static_from": "buffers" if straight else "shapes",
                  "dynamic_bytes": None if static is None else peak - static}


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


KEY_FIELDS = ("task", "backend", "topology", "params", "n_layers", "d_model", "n_heads", "d_ff", "vocab", "attention",
              "compute_dtype", "seq_len", "batch", "inner_steps", "lora_rank", "variant")


def identity(cfg: Config, variant: Variant, topology: str | None) -> dict:
    """What a row is measured at (KEY_FIELDS): task, backend, model, shapes and variant; known before compiling."""
    model, d = variant.model(cfg.model), cfg.data
    return {"variant": variant.name, "task": cfg.task, "backend": topology_backend(topology) or jax.default_backend(),
            "topology": topology, "n_layers": model.n_layers, "d_model": model.d_model, "n_heads": model.n_heads,
            "d_ff": model.d_ff, "vocab": model.vocab_size, "params": param_count(model), "attention": model.attention,
            "compute_dtype": str(model.activation_dtype), "seq_len": d.seq_len, "batch": d.batch,
            "inner_steps": d.inner_steps, "lora_rank": cfg.inner.lora.rank}


def row_key(row: dict) -> tuple:
    """A row's identity for `run(done=...)`."""
    return tuple(row.get(k) for k in KEY_FIELDS)


def job_key(cfg: Config, variant: Variant, topology: str | None) -> tuple:
    """`row_key` of the row `profile(cfg, variant, topology)` would give, without compiling."""
    return row_key(identity(cfg, variant, topology))


def run(configs: list[Config], variant_list: list[Variant], baseline: str = "autodiff+remat",
        topology: str | None = None, progress: Callable = lambda it, **_: it,
        with_breakdown: bool = False, done: list[dict] = (), save: Callable[[list[dict]], None] | None = None
        ) -> list[dict]:
    """A row per config and variant (configs carry task, model and shapes), with ratios against `baseline`.

    Resumable: a row of `done` measured at the same task, model, shapes and variant (with a breakdown when one is
    asked for) is kept instead of compiling again; `save(rows)` is called after every row with this run's rows so
    far and the rows of `done` it does not measure, so an interrupted run loses at most the compile in progress and
    a run over fewer variants loses no row. Returns this run's rows."""
    kept = {row_key(r): r for r in done if r.get("breakdown") or not with_breakdown}
    jobs = [(c, v) for c in configs for v in variant_list]
    keys = [job_key(c, v, topology) for c, v in jobs]
    others = [r for r in done if row_key(r) not in keys]
    todo = [(c, v, k) for (c, v), k in zip(jobs, keys) if k not in kept]
    if len(todo) < len(jobs):
        print(f"resuming: {len(jobs) - len(todo)} of {len(jobs)} rows already measured, {len(todo)} to compile",
              flush=True)
    measured = {}
    rows = lambda: add_ratios([kept.get(k) or measured[k] for k in keys if k in kept or k in measured], baseline)
    for c, v, k in progress(todo, desc="compiling"):
        measured[k] = profile(c, v, topology, with_breakdown)
        if save:
            save(others + rows())
    if save and not todo:
        save(others + rows())
    return rows()


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
            f"kept states {unit}", f"temp {unit}", "GFLOPs", "peak ratio", "dynamic ratio"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        peak = size(r["peak_bytes"]) + ("" if r.get("exact", True) else " (refused: compiler's figure)")
        peak += " (over HBM)" if r.get("fits") is False and r.get("exact", True) else ""  # older rows: refusals
        flops = "-" if r["flops"] is None else f"{r['flops'] / 1e9:,.1f}"
        lines.append(f"| {r['task']} | {count(r['params'])} | {r['n_layers']} | {r['variant']} | {peak} | "
                     f"{size(r['static_bytes'])} | {size(r['dynamic_bytes'])} | {size(r['kept_bytes'])} | "
                     f"{size(r['temp_bytes'])} | {flops} | {ratio(r['peak_ratio'])} | {ratio(r['dynamic_ratio'])} |")
    unit = "GPU" if rows[0]["backend"] == "gpu" else "chip"
    where = f"per {unit}, {rows[0]['topology']}" if rows[0]["topology"] else rows[0]["backend"]
    return "\n".join(lines) + (f"\n({where}; the Trainer's outer step; ratios: {baseline} ÷ variant, higher means "
                               f"less memory than {baseline}; static = inputs + outputs + kept inner states + ∇η, "
                               f"dynamic = the rest; where no loop over inner steps is left (T <= 2 or +unroll) the "
                               f"kept states are those live at the peak in the compiled program)")


def breakdown_table(rows: list[dict]) -> str:
    """What is live at each row's peak: arguments, parameter-sized temporaries (count of θ-sized buffers) and the
    rest, then the parameter-sized buffers by shape."""
    lines = ["| params | variant | compiled peak GiB | live at peak | arguments | parameter-sized (x θ) | other | "
             "parameter-sized buffers by shape |", "|" + "---|" * 8]
    g = lambda b: f"{b / 2**30:,.2f}"
    for r in rows:
        b = r.get("breakdown")
        if b is None:
            continue
        shapes = ", ".join(f"{n}x {s}" for s, n in b["param_sized_shapes"].items())
        lines.append(f"| {count(r['params'])} | {r['variant']} | {g(r['peak_bytes'])} | {g(b['live_bytes'])} | "
                     f"{g(b['argument_bytes'])} | "
                     f"{g(b['param_sized_bytes'])} ({b['param_units']:.1f}) | {g(b['other_bytes'])} | {shapes} |")
    return "\n".join(lines) + ("\n(GiB; compiled peak: the rows' peak; live at peak: the buffers live where the "
                               "sum over the compiler's buffer assignment peaks, each place in memory once (on TPU "
                               "the same figure; on CPU and GPU the compiled peak also counts the allocator's gaps); "
                               "parameter-sized: a leaf of θ's shape, or a stack of per-step copies; x θ: their "
                               "bytes over θ's)")
