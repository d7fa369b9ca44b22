"""`metagrad.mode=auto` and `metagrad.kept_states=auto`: compile every candidate outer step, keep the lowest peak.

The candidates are the run's own program (`step.meta_program`) in each meta-gradient mode and/or with
each kept-states schedule (every_step, sqrt). All of them compute the same meta-gradient
(`metatrain check-grads` shows it), so the choice changes memory and time only: the lowest peak memory
wins, and among candidates within 1% of it, the fewest FLOPs. The winner's compiled program is the one
the Trainer runs (no second compile).

A resumed single-process run takes the choice of its first start (`mode_auto.json` in its work dir) where it runs
on the same devices, mesh and JAX with the same memory settings: one compile instead of one per candidate.
Anywhere else it chooses again (the checkpoint's layout is the same for every candidate).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os

import jax

from metatrain import aot
from metatrain import step as step_lib
from metatrain.aot import compiled_memory
from metatrain.config import AUTO, Config
from metatrain.mixflow import MODES

SCHEDULES = ("every_step", "sqrt")


def _candidates(cfg: Config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The modes and the kept-states schedules the run's `auto` settings leave to choose from."""
    g = cfg.metagrad
    return (MODES if g.mode == AUTO else (g.mode,)), (SCHEDULES if g.kept_states == AUTO else (g.kept_states,))


def choose(cfg: Config, mesh: jax.sharding.Mesh) -> tuple[dict, step_lib.Program, jax.stages.Compiled]:
    """(the choice with every candidate's figures, the chosen program, its compiled outer step)."""
    modes, schedules = _candidates(cfg)
    figures, built = {}, {}
    for mode, schedule in itertools.product(modes, schedules):
        program = step_lib.meta_program(cfg, mesh, mode, schedule)
        compiled = aot.compile(step_lib.lower(program))
        m = compiled_memory(compiled)
        name = mode if len(schedules) == 1 else f"{mode}+{schedule}"
        figures[name] = {"mode": mode, "kept_states": schedule, "peak_bytes": m["peak_bytes"], "flops": m["flops"]}
        built[name] = (program, compiled)
    lowest = min(f["peak_bytes"] for f in figures.values())
    tied = [name for name, f in figures.items() if f["peak_bytes"] <= 1.01 * lowest]
    best = min(tied, key=lambda name: math.inf if figures[name]["flops"] is None else figures[name]["flops"])
    choice = {"mode": figures[best]["mode"], "kept_states": figures[best]["kept_states"],
              "candidates": figures}
    return choice, *built[best]


def where(cfg: Config, mesh: jax.sharding.Mesh) -> dict:
    """What a choice holds for: the devices, the mesh, the processes and the JAX that compiled the candidates, and
    the memory settings a resumed run may change (`metagrad.*`, the meta-optimizer's offloading)."""
    return {"device_kind": mesh.devices.flat[0].device_kind, "platform": mesh.devices.flat[0].platform,
            "mesh": {name: int(size) for name, size in mesh.shape.items()}, "processes": jax.process_count(),
            "jax": jax.__version__, "metagrad": dataclasses.asdict(cfg.metagrad),
            "offload_moments": cfg.meta_opt.offload_moments, "offload_params": cfg.meta_opt.offload_params}


def earlier(path: str, cfg: Config, mesh: jax.sharding.Mesh) -> dict | None:
    """The choice saved at `path` by an earlier start of this run, where it holds here (one process, the same
    `where`, a candidate of this version's modes and schedules); else None."""
    if jax.process_count() > 1 or not os.path.isfile(path):
        return None  # (several processes: each would have to find the same file)
    try:
        with open(path, encoding="utf-8") as f:
            choice = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(choice, dict) or choice.get("where") != where(cfg, mesh):
        return None
    modes, schedules = _candidates(cfg)
    return choice if choice.get("mode") in modes and choice.get("kept_states") in schedules else None


def describe(choice: dict) -> str:
    """One line: every candidate's peak and FLOPs, and the choice."""
    gflops = lambda f: "FLOPs not counted" if f["flops"] is None else f"{f['flops'] / 1e9:,.2f} GFLOPs"
    return "auto: " + "; ".join(f"{n} peak {f['peak_bytes'] / 2**20:,.1f} MiB, {gflops(f)}"
                                for n, f in choice["candidates"].items()) + (
        f" -> metagrad.mode={choice['mode']} metagrad.kept_states={choice['kept_states']}")
