"""The largest model on the size ladder whose outer step fits a TPU topology, per variant (`bench fit`).

Each candidate is the Trainer's real outer step (task, meta-optimizer, FSDP over the topology's
chips) compiled ahead of time by libtpu (`bench.compile.compile_report`). Peak memory grows with
the ladder, so a binary search over it needs about log2(len(ladder)) compiles per variant; every
compile tried is reported, with the bytes the compiler asked for when it refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from metatrain.bench import compile as compile_lib
from metatrain.bench.variants import Variant
from metatrain.config import Config
from metatrain.models import LADDER, param_count, preset


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
        need = report["peak_bytes"] if report["exact"] else report["required_bytes"]
        edge = " (compiles, but arguments + temporaries pass the HBM)" if report["exact"] and not report["fits"] else ""
        log(f"  {variant.name}: {name} {'fits' if report['fits'] else 'does NOT fit'}: {need / 2**30:.2f} of "
            f"{report['hbm_bytes'] / 2**30:.2f} GiB{edge}")
        tried.append(report | {"name": name, "params": param_count(run.model)})
        return report["fits"]

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
