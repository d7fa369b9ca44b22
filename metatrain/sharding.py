"""Device mesh and FSDP shardings from the models' logical axis names."""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from metatrain.config import MeshConfig
from metatrain.errors import ConfigError
from metatrain.models.transformer import BATCH_AXES

# Logical axis → mesh axis. FSDP shards every parameter (and its optimizer state) along `embed`,
# which every weight matrix has; the rest is replicated. Batches, and the activations in the model
# (`models.transformer.batch_sharded`), are split over both mesh axes (BATCH_AXES).
RULES = {"embed": "fsdp"}


def cpu_device_count(mesh: MeshConfig, batch: int, population_axis: bool = False) -> int:
    """The JAX devices `mesh.cpu_devices` asks a CPU host for (0: one per usable core, as many as divide `batch`,
    where the other mesh keys are at their defaults and there is no population axis; else 1)."""
    if mesh.cpu_devices:
        return mesh.cpu_devices
    if population_axis or dataclasses.replace(mesh, cpu_devices=MeshConfig.cpu_devices) != MeshConfig():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(n for n in range(1, cores + 1) if batch % n == 0)


THREADS_PER_DEVICE = 4
XLA_THREADS = "PJRT_NPROC"  # read by XLA:CPU when its client starts: the size of its two thread pools


def cpu_threads(count: int) -> None:
    """Give XLA:CPU's thread pools room for `count` devices in this process (unless PJRT_NPROC sizes them already).

    XLA:CPU runs all devices of a process on two shared pools of max(cores, devices) threads: exactly one per device
    on a machine with fewer cores than devices. A device's part of a program holds a thread until it ends, and a
    collective blocks the thread that reaches it until every device has reached it; a device whose next piece of
    work (a step offloaded to the pool, a loop body) then finds no free thread never gets there, and XLA stops the
    process: "Expected 8 threads to join the rendezvous, but only 6 of them arrived on time". With
    `THREADS_PER_DEVICE` threads per device the pools cannot run dry; threads that wait cost no CPU."""
    if count > 1 and XLA_THREADS not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ[XLA_THREADS] = str(max(cores, THREADS_PER_DEVICE * count))


def split_cpu(count: int) -> bool:
    """Make the CPU backend `count` devices (with `cpu_threads`). Call before any JAX operation; returns False (and
    changes nothing) where XLA_FLAGS or JAX_NUM_CPU_DEVICES already sets a count or the backends have started."""
    given = re.search(r"xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if given or os.environ.get("JAX_NUM_CPU_DEVICES"):
        cpu_threads(int(given.group(1)) if given else int(os.environ["JAX_NUM_CPU_DEVICES"]))
        return False
    if count == 1:
        return False
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # a JAX operation ran already (e.g. in a notebook or a test's process)
        return False
    cpu_threads(count)
    return True


def make_mesh(cfg: MeshConfig, devices=None, population: int = 0) -> jax.sharding.Mesh:
    """The device mesh: `data` x `fsdp`, with `population` > 0 a leading `population` axis of that many devices
    (`population.axis=true`: the members side by side)."""
    devices = list(devices if devices is not None else jax.devices())
    data, fsdp = mesh_shape(cfg, len(devices), population)
    if population:
        return jax.sharding.Mesh(np.asarray(devices).reshape(population, data, fsdp), ("population", "data", "fsdp"),
                                 axis_types=(jax.sharding.AxisType.Auto,) * 3)
    return jax.sharding.Mesh(np.asarray(devices).reshape(data, fsdp), ("data", "fsdp"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)


def mesh_shape(cfg: MeshConfig, n: int, population: int = 0) -> tuple[int, int]:
    """The (data, fsdp) sizes of the mesh over `n` devices (of each of `population` members, where > 0); a
    ConfigError where they cannot split them."""
    if population:
        if n % population:
            raise ConfigError(f"population.axis: the {n} devices do not split into {population} members; use a "
                              f"population.size that divides {n}, or population.axis=false")
        n //= population
    fsdp = n if cfg.fsdp == -1 else cfg.fsdp
    data = n // fsdp if cfg.data == -1 else cfg.data
    if cfg.fsdp == -1 and cfg.data != -1:
        fsdp = n // data
    if data * fsdp != n or data < 1 or fsdp < 1:
        each = f" of each of the {population} members" if population else ""
        error = ConfigError(f"mesh: data={cfg.data} x fsdp={cfg.fsdp} does not divide the {n} devices{each}; "
                            f"set mesh.data=-1 or sizes whose product is {n}")
        error.devices = n  # for a command whose flag set the sizes, to say it in its own terms
        raise error
    return data, fsdp


def check_batch(batch: int, shards: int) -> None:
    """A ConfigError where `data.batch` does not split over the `shards` data x fsdp devices."""
    if batch % shards:
        raise ConfigError(f"data.batch: {batch} does not divide over the {shards} data x fsdp devices; use a multiple "
                          f"of {shards}")


def _mesh_spec(logical: P, shape, mesh) -> P:
    axes = []
    for name, size in zip(tuple(logical) + (None,) * (len(shape) - len(logical)), shape):
        axis = RULES.get(name)
        axes.append(axis if axis and size % mesh.shape[axis] == 0 else None)  # replicate what does not divide
    return P(*axes)


def tree_shardings(tree, mesh):
    """NamedShardings for a pytree of nnx States / optax states / arrays (abstract or not)."""
    specs = nnx.get_partition_spec(tree)
    is_spec = lambda x: isinstance(x, P) or x is None
    spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    leaves, treedef = jax.tree.flatten(tree)
    out = [NamedSharding(mesh, _mesh_spec(s or P(), np.shape(x), mesh)) for s, x in zip(spec_leaves, leaves)]
    return jax.tree.unflatten(treedef, out)


def abstract(tree, shardings):
    """ShapeDtypeStructs of `tree` carrying `shardings`: targets for Orbax restores and AOT lowering."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of arrays or ShapeDtypeStructs (whole leaves where unsharded)."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
    return total


def batch_sharding(mesh, leading: int = 0, members: bool = False) -> NamedSharding:
    """Split the batch axis (after `leading` unsplit axes, e.g. T) over data x fsdp; `members`: the first leading
    axis (a population's members) over the mesh's `population` axis."""
    lead = [None] * leading
    if members and "population" in mesh.axis_names:
        lead[0] = "population"
    return NamedSharding(mesh, P(*lead, BATCH_AXES))


def replicated(mesh) -> NamedSharding:
    """Whole arrays on every device (readable on every host): metrics, evaluation outputs."""
    return NamedSharding(mesh, P())
