"""The largest model on the size ladder whose outer step fits a TPU topology or GPUs, per variant (`bench fit`).

Each candidate is the Trainer's real outer step (task, meta-optimizer, FSDP over the topology's
chips or GPUs) compiled ahead of time by libtpu or JAX's CUDA plugin (`bench.compile.compile_report`). Peak
memory grows with the ladder, so a binary search over it needs about log2(len(ladder)) compiles per variant; every
compile tried is reported with its exact peak (a program over HBM is compiled past the limit). A preset
fits when its peak is at most FIT_MARGIN of the chip's HBM (a GPU's: the memory JAX gives a process): the runtime
needs some room of its own, and a program at 99.9% of HBM is not one a user can run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from metatrain.bench import compile as compile_lib
from metatrain.bench.variants import Variant
from metatrain.config import Config
from metatrain.models import LADDER, param_count, preset

FIT_MARGIN = 0.98  # a preset fits when its peak <= 98% of the chip's HBM


def largest_fitting(cfg: Config, variant: Variant, topology: str, ladder: list[str] | None = None,
                    log: Callable[[str], None] = print, **model_options) -> dict:
    """{"variant", "largest" (name or None), "params", "tried": [compile reports]}. Every preset gets
    `model_options` (e.g. attention="blockwise"), then the variant's own (+blockwise, +bf16) over them."""
    ladder = ladder or list(LADDER)
    tried = []

    def fits(name: str) -> bool:
        run = variant.apply(dataclasses.replace(cfg, model=preset(name, **model_options)))
        log(f"  {variant.name}: compiling {name} ({param_count(run.model) / 1e6:,.0f}M parameters) ...")
        report = compile_lib.compile_report(run, topology)
        if not report["exact"]:  # refused, and compiling past the limit failed too: no exact figure
            log(f"  {variant.name}: {name} does NOT fit: refused ({report['message']})")
            tried.append(report | {"name": name, "params": param_count(run.model), "fits_margin": False})
            return False
        ok = report["peak_bytes"] <= FIT_MARGIN * report["hbm_bytes"]
        edge = " (refused at first; compiled past the limit for this figure)" if "refused_bytes" in report else ""
        log(f"  {variant.name}: {name} {'fits' if ok else 'does NOT fit'}: peak {report['peak_bytes'] / 2**30:.2f} GiB "
            f"of {report['hbm_bytes'] / 2**30:.2f} ({100 * report['peak_bytes'] / report['hbm_bytes']:.1f}%){edge}")
        tried.append(report | {"name": name, "params": param_count(run.model), "fits_margin": ok})
        return ok

    lo, hi = -1, len(ladder)  # ladder[lo] fits (or lo = -1), ladder[hi] does not (or hi = len)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(ladder[mid]):
            lo = mid
        else:
            hi = mid
    largest = ladder[lo] if lo >= 0 else None
    return {"variant": variant.name, "largest": largest,
            "params": param_count(preset(largest)) if largest else 0, "tried": tried}
