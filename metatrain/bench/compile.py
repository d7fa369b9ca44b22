"""Compile a run's outer step ahead of time, here or for a TPU topology (libtpu, no TPU needed) or NVIDIA GPUs
(JAX's CUDA plugin, no GPU needed), and report its per-device memory and whether it fits.

The program is the Trainer's own (`step.meta_program` + `step.lower`) over the run's mesh: this
machine's devices, or the topology's chips with FSDP shardings. On a TPU, a program whose temporaries
pass the chip's HBM is refused with RESOURCE_EXHAUSTED and then compiled past the limit
(`aot.compile_exact`): every report is exact, `fits` is peak <= HBM, and a refused program's report also
keeps the refusal's figure (`refused_bytes`, an estimate, not a peak). On a GPU `fits` is peak <= the memory
JAX's allocator gives a process (`aot.topology_devices`). A CPU or GPU program's report also has its kernels'
census (`bench.census`: what they compute and move per call).
"""

from __future__ import annotations

import dataclasses
import time
from importlib import metadata

import jax

from metatrain import step as step_lib
from metatrain.aot import compile_exact, compiled_memory, topology_backend, topology_devices
from metatrain.config import Config
from metatrain.errors import ConfigError
from metatrain.models import dtype_settings, require_float64
from metatrain.sharding import make_mesh


def program_for(cfg: Config, topology: str | None = None) -> tuple[step_lib.Program, float | None]:
    """The run's meta-training program over this machine's devices or a topology's, and the memory per device."""
    require_float64(dtype_settings(cfg.model))
    devices, hbm = topology_devices(topology) if topology else (jax.devices(), None)
    mesh = make_mesh(cfg.mesh, devices, population=cfg.population.size if cfg.population.axis else 0)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.data.batch % shards:
        kind = "GPUs" if topology_backend(topology) == "gpu" else "chips"
        where = f"the {len(devices)} {kind} of {topology}" if topology else f"the {len(devices)} devices here"
        raise ConfigError(f"--batch {cfg.data.batch} does not split over {where} (batches are split over data x "
                          f"fsdp = {shards}); use a multiple of {shards}")
    return step_lib.meta_program(cfg, mesh), hbm


def where(devices=None) -> dict:
    """The device (`devices`, else this machine's) and the versions a row was measured or compiled with."""
    devices = devices if devices is not None else jax.devices()
    versions = {}
    for name in ("jax", "jaxlib", "flax", "metatrain"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"device": devices[0].device_kind, "devices": len(devices), "versions": versions}


def compile_report(cfg: Config, topology: str | None = None, built: tuple | None = None,
                   options: dict | None = None) -> dict:
    """Per-device memory of the run's outer step (and, on a TPU topology, whether it fits the chip's HBM; on a CPU or
    GPU, its kernels' `census`).
    `built`: `program_for(cfg, topology)` when the caller has it already; `options`: compile options (e.g. a dump)."""
    program, hbm = built or program_for(cfg, topology)
    d = cfg.data
    report = {"topology": topology, "backend": topology_backend(topology) or jax.default_backend(),
              "mesh": dict(program.mesh.shape), "hbm_bytes": hbm,
              "model": dataclasses.asdict(cfg.model), "task": cfg.task,
              "mode": cfg.metagrad.mode, "plan": program.plan.name,
              "save_inner_grads": cfg.metagrad.save_inner_grads, "kept_states": cfg.metagrad.kept_states,
              "state_dtype": cfg.metagrad.state_dtype, "offload_states": cfg.metagrad.offload_states,
              "offload_moments": cfg.meta_opt.offload_moments, "offload_params": cfg.meta_opt.offload_params,
              "batch": d.batch, "seq_len": d.seq_len, "inner_steps": d.inner_steps,
              **where(list(program.mesh.devices.flat))}
    start = time.perf_counter()
    compiled, refused, message = compile_exact(step_lib.lower(program), tpu=topology_backend(topology) == "tpu",
                                               options=options)
    if compiled is None:  # refused, and this generation's compiler cannot go past the limit: no exact figure
        return report | {"fits": False, "exact": False, "peak_bytes": None, "refused_bytes": refused,
                         "message": message, "compile_s": round(time.perf_counter() - start, 2)}
    m = compiled_memory(compiled)
    extra = {} if refused is None else {"refused_bytes": refused, "message": message}
    if report["backend"] in ("gpu", "cpu"):  # (a TPU program's products are convolutions the census does not read)
        from metatrain.bench import census

        extra["census"] = census.census(compiled.as_text())
    return report | m | extra | {"fits": None if hbm is None else m["peak_bytes"] <= hbm, "exact": True,
                                 "compile_s": round(time.perf_counter() - start, 2)}
