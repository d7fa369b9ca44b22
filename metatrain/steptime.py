"""Step time of meta-gradient variants, side by side on whatever backend is present.

Every variant's `value_and_grad` of the outer loss is compiled and warmed up first. Then the
variants run interleaved, one call each per round (the order rotating from round to round), so
that slow drifts of the machine (other processes, frequency scaling) hit all of them alike. Each
round gives one ratio baseline ÷ variant per variant; we report the median of those ratios and
the median time. Only the timed call itself is measured (`block_until_ready`).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax

from metatrain.problem import Shapes, Variant, build_task
from metatrain.unroll import meta_value_and_grad
from models import ModelConfig


def _program(task_name: str, model: ModelConfig, shapes: Shapes, variant: Variant, seed: int):
    model = variant.model(model)
    task = build_task(task_name, model, remat=variant.remat)
    k_meta, k_inner, k_data = jax.random.split(jax.random.key(seed), 3)
    meta = task.init_meta(k_meta)
    inner = None if task.resets_inner else task.init_inner(k_inner, meta)
    batches, outer_batch = shapes.batches(model.vocab_size, k_data)
    fn = jax.jit(meta_value_and_grad(task, variant.unroll))
    return lambda: jax.block_until_ready(fn(meta, inner, batches, outer_batch))


def measure(task_name: str, model: ModelConfig, shapes: Shapes, variant_list: list[Variant], baseline: str,
            rounds: int = 5, warmup: int = 1, seed: int = 0, progress: Callable = lambda it, **_: it) -> list[dict]:
    """One row per variant: median seconds per meta-gradient, and the median per-round ratio baseline ÷ variant."""
    names = [v.name for v in variant_list]
    if baseline not in names:
        raise ValueError(f"--baseline {baseline} is not among the variants {names}")
    calls, compile_s = {}, {}
    for v in progress(variant_list, desc="compiling and warming up"):
        tic = time.perf_counter()
        calls[v.name] = _program(task_name, model, shapes, v, seed)
        for _ in range(warmup + 1):  # the first call compiles
            calls[v.name]()
        compile_s[v.name] = time.perf_counter() - tic
    times = {n: [] for n in names}
    for r in progress(range(rounds), desc="timing rounds"):
        for n in names[r % len(names):] + names[:r % len(names)]:
            tic = time.perf_counter()
            calls[n]()
            times[n].append(time.perf_counter() - tic)
    rows = []
    for n in names:
        ratios = [b / t for b, t in zip(times[baseline], times[n])]
        rows.append({"variant": n, "task": task_name, "backend": jax.default_backend(), "n_layers": model.n_layers,
                     "d_model": model.d_model, "seq_len": shapes.seq_len, "batch": shapes.batch,
                     "inner_steps": shapes.inner_steps, "rounds": rounds, "median_s": statistics.median(times[n]),
                     "min_s": min(times[n]), "times_s": times[n], "ratio": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios), "warmup_s": compile_s[n]})
    return rows


def table(rows: list[dict], baseline: str) -> str:
    lines = ["| variant | median s | min s | ratio (median) | ratio range |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['ratio']:.3f}x | "
                     f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f} |")
    return "\n".join(lines) + (f"\n(ratio: {baseline} time ÷ variant time, per round, median of {rows[0]['rounds']}; "
                               "higher means faster than the baseline)")
