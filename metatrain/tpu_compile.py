"""Compile the real outer step for a TPU topology on a machine without a TPU (libtpu ahead of time).

The run's Trainer program (task, mode, meta-optimizer, baseline) is lowered with `ShapeDtypeStruct`
inputs carrying the run's mesh and FSDP shardings over the topology's devices, compiled by the TPU
compiler, and its per-device memory is compared with the chip's HBM. A program over HBM fails to
compile with RESOURCE_EXHAUSTED; the bytes it needed are read from the message.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax

from metatrain.config import Config
from metatrain.memory import compiled_memory
from metatrain.sharding import abstract, device_bytes, make_mesh, tree_shardings
from metatrain.trainer import Trainer, meta_optimizer
from metatrain.unroll import Unroll
from models import ModelConfig

GiB = 2**30
HBM_GIB = {"v4": 32.0, "v5e": 16.0, "v5litepod": 16.0, "v5p": 95.74, "v6e": 32.0}  # per chip


def topology_devices(topology: str):
    """TPU devices of e.g. "v5p:2x2x1" for ahead-of-time compilation (needs the `tpu` extra: libtpu)."""
    from jax.experimental import topologies

    # AOT compiles touch no chip: let them run beside another JAX process that holds libtpu's lock file
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    m = re.fullmatch(r"(v\d+[a-z]*):(\d+)x(\d+)(?:x(\d+))?", topology)
    if not m:
        raise ValueError(f"--topology {topology!r}: write it as GENERATION:AxBxC, e.g. v5p:2x2x1")
    chip, dims = m.group(1), tuple(int(d) for d in m.groups()[1:] if d is not None)
    if chip not in HBM_GIB:
        raise ValueError(f"--topology {topology!r}: unknown TPU generation {chip!r}; one of {sorted(HBM_GIB)}")
    per_host = tuple(min(d, b) for d, b in zip(dims, (2, 2, 1)))
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topology, chip_config_name="default",
                                            chips_per_host_bounds=per_host, num_slices=1)
    except Exception as e:  # no libtpu, or a shape the compiler does not know
        raise ValueError(f"cannot describe TPU topology {topology!r} ({str(e).splitlines()[0][:200]}); "
                         f"install the tpu extra: pip install -e '.[tpu]'") from None
    return topo.devices, HBM_GIB[chip] * GiB


def required_bytes(error: Exception) -> float | None:
    """The bytes an over-HBM program needed, from the TPU compiler's RESOURCE_EXHAUSTED message (else None)."""
    m = re.search(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT])\) exceeds", str(error), re.S)
    return None if m is None else float(m.group(1)) * 1024 ** ("KMGT".index(m.group(2)) + 1)


class _Program(Trainer):
    """The Trainer's state and outer step without data, files or allocated arrays."""

    def __init__(self, cfg: Config, model: ModelConfig, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.task = self._make_task(model)
        self.unroll = Unroll(cfg.mode, cfg.save_inner_grads, cfg.inner_checkpoint)
        self.meta_opt = meta_optimizer(cfg)


def compile_outer_step(cfg: Config, model: ModelConfig, topology: str) -> dict:
    """Per-device memory of the run's outer step on `topology`, and whether it fits the chip's HBM."""
    devices, hbm = topology_devices(topology)
    mesh = make_mesh(cfg.mesh, devices)
    if cfg.data.batch % len(devices):
        raise ValueError(f"--batch {cfg.data.batch} does not split over the {len(devices)} chips of {topology} "
                         f"(batches are split over data x fsdp); use a multiple of {len(devices)}")
    prog = _Program(cfg, model, mesh)
    shapes = jax.eval_shape(prog._init_state, jax.random.key(0))
    shardings = tree_shardings(shapes, mesh)
    state = abstract(shapes, shardings)
    d = cfg.data
    inner, outer = prog.abstract_batches()
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    report = {"topology": topology, "devices": len(devices), "mesh": dict(mesh.shape), "hbm_bytes": hbm,
              "model": dataclasses.asdict(model), "task": cfg.task, "mode": cfg.mode,
              "batch": d.batch, "seq_len": d.seq_len, "inner_steps": d.inner_steps}
    step = jax.jit(prog._outer_step, donate_argnums=0, out_shardings=(shardings, replicated))
    try:
        compiled = step.lower(state, inner, outer).compile()
    except Exception as e:
        need = required_bytes(e)
        if need is None:
            raise
        return report | {"fits": False, "required_bytes": need, "message": str(e).splitlines()[0][:300]}
    m = compiled_memory(compiled)
    # the compiler refuses a program whose temporaries pass the HBM; with its arguments it can still be over
    return report | {"fits": m["peak_bytes"] <= hbm, "argument_bytes": m["argument_bytes"],
                     "output_bytes": m["output_bytes"], "alias_bytes": m["alias_bytes"],
                     "temp_bytes": m["temp_bytes"], "total_bytes": m["peak_bytes"],
                     "state_bytes_per_device": device_bytes(state)}
