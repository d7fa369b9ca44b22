"""Step time of meta-gradient variants, side by side on whatever backend is present.

Every variant's outer step (the Trainer's: `metatrain.step`, meta-optimizer update included, on this
machine's devices) is compiled and warmed up first, on random batches. Then the
variants run interleaved, one call each per round (the order rotating from round to round), so
that slow drifts of the machine (other processes, frequency scaling) hit all of them alike. Each
round gives one ratio baseline ÷ variant per variant; we report the median of those ratios and
the median time. Only the timed call itself is measured (`block_until_ready`).

Each row also says where it ran (the device, jax/jaxlib/flax versions) and, where the device keeps memory
statistics (GPU, TPU), the process's measured peak (`process_peak_bytes`: the highest the device held since the
process started, over every variant run so far; with one variant per process it is that variant's, also given as
`measured_peak_bytes`, with `peak_before_steps_bytes`, the highest before its first step: initialising the state
and compiling, GPU autotuning included) beside the compiled program's (`peak_bytes`). With `profile_dir`, a few
more calls of each variant run under the JAX profiler and the row gets their top ops (`bench.profile`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import jax

from metatrain import aot
from metatrain import step as step_lib
from metatrain.aot import compiled_memory
from metatrain.bench.compile import program_for, where
from metatrain.bench.variants import Variant
from metatrain.config import Config
from metatrain.errors import ConfigError
from metatrain.step import random_batches

SMALLER = "use a smaller model (--model, --n-layers)"
FIX = (f"time fewer variants at once (--variants), or {SMALLER}, smaller batches (--batch) or shorter sequences "
       "(--seq-len)")


class _Runner:
    """One outer step per call, on the state the previous call left (the state is donated, as in training)."""

    def __init__(self, cfg: Config, variant: Variant, seed: int, first: bool = True):
        program, _ = program_for(variant.apply(cfg))
        self.name, devices = variant.name, program.mesh.devices.flat
        # the variants set up before this one keep their states: on CPU the memory here is what they leave
        aot.check_state_fits(program.state_shapes, program.state_shardings, devices, f"{variant.name}'s state",
                             SMALLER if first else f"time fewer variants at once (--variants), or {SMALLER}")
        self.compiled = aot.compile(step_lib.lower(program))
        aot.check_fits(compiled_memory(self.compiled), devices, f"{variant.name}'s outer step", FIX)
        k_state, k_data = jax.random.split(jax.random.key(seed))
        with self._out_of_memory():
            self.state = step_lib.init(program, k_state)
            specs = step_lib.batch_specs(program.data, program.mesh)
            self.batches = [jax.device_put(b, jax.tree.map(lambda s: s.sharding, spec))
                            for b, spec in zip(random_batches(program.data, cfg.model.vocab_size, k_data), specs)]

    def __call__(self) -> None:
        with self._out_of_memory():
            self.state, metrics = self.compiled(self.state, *self.batches)
            jax.block_until_ready(metrics)

    def _out_of_memory(self):
        """An allocation the device refuses (beside the other variants' states and buffers, or past what the checks
        before it could know): one TrainingError line naming the variant."""
        return aot.out_of_memory(self.name, FIX)


def device_peak_bytes() -> int | None:
    """The most memory device 0 has held since the process started (None where it keeps no statistics: CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def measure(cfg: Config, variant_list: list[Variant], baseline: str, rounds: int = 5, warmup: int = 1,
            seed: int = 0, progress: Callable = lambda it, **_: it, profile_dir: str | None = None,
            profile_steps: int = 3) -> list[dict]:
    """One row per variant: median seconds per outer step, and the median per-round ratio baseline ÷ variant (with
    `profile_dir`: also the top ops of `profile_steps` profiled calls, traced in `profile_dir/VARIANT`)."""
    names = [v.name for v in variant_list]
    if baseline not in names:
        raise ConfigError(f"--baseline {baseline} is not among the variants {names}")
    calls, compile_s, before_steps = {}, {}, {}
    for v in progress(variant_list, desc="compiling and warming up"):
        tic = time.perf_counter()
        calls[v.name] = _Runner(cfg, v, seed, first=not calls)
        before_steps[v.name] = device_peak_bytes()  # initialising the state and compiling, before any step
        for _ in range(warmup):
            calls[v.name]()
        compile_s[v.name] = time.perf_counter() - tic
    times = {n: [] for n in names}
    for r in progress(range(rounds), desc="timing rounds"):
        for n in names[r % len(names):] + names[:r % len(names)]:
            tic = time.perf_counter()
            calls[n]()
            times[n].append(time.perf_counter() - tic)
    peak = device_peak_bytes()  # before profiling, which keeps buffers of its own
    profiles = {}
    if profile_dir:
        from metatrain.bench import profile

        for n in progress(names, desc="profiling"):
            profiles[n] = profile.trace(calls[n], profile_steps, os.path.join(profile_dir, profile.file_name(n)),
                                        hlo_text=calls[n].compiled.as_text())
    rows, place = [], where()
    for n in names:
        ratios = [b / t for b, t in zip(times[baseline], times[n])]
        measured = {} if peak is None else {"process_peak_bytes": peak, **(
            {"measured_peak_bytes": peak, "peak_before_steps_bytes": before_steps[n]} if len(names) == 1 else {})}
        rows.append({"variant": n, "task": cfg.task, "backend": jax.default_backend(), **place,
                     "n_layers": cfg.model.n_layers,
                     "d_model": cfg.model.d_model, "seq_len": cfg.data.seq_len, "batch": cfg.data.batch,
                     "inner_steps": cfg.data.inner_steps, "rounds": rounds, "median_s": statistics.median(times[n]),
                     "min_s": min(times[n]), "times_s": times[n], "ratio": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios), "warmup_s": compile_s[n],
                     # what ran: the compiled program's peak, and the outer steps the state went through
                     "peak_bytes": compiled_memory(calls[n].compiled)["peak_bytes"], **measured,
                     "steps_run": int(calls[n].state["step"]),
                     **({"profile": {"steps": profile_steps, **profiles[n]}} if n in profiles else {})})
    return rows


def table(rows: list[dict], baseline: str) -> str:
    lines = ["| variant | median s | min s | ratio (median) | ratio range |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['ratio']:.3f}x | "
                     f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f} |")
    return "\n".join(lines) + (f"\n(ratio: {baseline} time ÷ variant time, per round, median of {rows[0]['rounds']}; "
                               "higher means faster than the baseline)")


def profile_table(rows: list[dict], n: int = 8) -> str:
    """Each profiled variant's top `n` ops (ms per step and share of all ops' time), then every op's time by class,
    the variants side by side."""
    lines = ["| variant | op | kind | ms per step | share |", "|---|---|---|---|---|"]
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            lines += [f"| {r['variant']} | {o['op']} | {o['kind']} | {o['ms_per_step']:.3f} | {o['share']:.1%} |"
                      for o in p["top_ops"][:n]]
            lines.append(f"| {r['variant']} | all ops | | {p['op_ms_per_step']:.3f} | 100% |")
    profiled = [r for r in rows if "profile" in r]
    if profiled:  # every op's time by class, the variants side by side
        names = list(dict.fromkeys(c["class"] for r in profiled for c in r["profile"]["by_class"]))
        lines += ["", "| class | " + " | ".join(f"{r['variant']}: ms per step (share)" for r in profiled) + " |",
                  "|---|" + "---|" * len(profiled)]
        by_class = [{c["class"]: c for c in r["profile"]["by_class"]} for r in profiled]
        for name in names:
            cells = [f"{c[name]['ms_per_step']:.3f} ({c[name]['share']:.1%})" if name in c else "-" for c in by_class]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
