import os

import pytest

from metatrain import config as config_lib
from metatrain.config import MeshConfig
from metatrain.errors import ConfigError
from metatrain.sharding import cpu_device_count, split_cpu


@pytest.mark.parametrize("cores, batch, mesh, population_axis, want", [
    (2, 16, MeshConfig(cpu_devices=0), False, 2),  # the main job on 2 cores
    (3, 16, MeshConfig(cpu_devices=0), False, 2),  # the most cores that divide the batch
    (8, 12, MeshConfig(cpu_devices=0), False, 6),
    (1, 16, MeshConfig(cpu_devices=0), False, 1),
    (4, 16, MeshConfig(cpu_devices=0, fsdp=2), False, 1),  # a mesh the user set: left as it is
    (4, 16, MeshConfig(cpu_devices=0), True, 1),
    (2, 16, MeshConfig(cpu_devices=3), False, 3),  # a count given: the mesh check refuses what does not divide
    (8, 16, MeshConfig(), False, 1),  # the default: one device
])
def test_cpu_device_count(monkeypatch, cores, batch, mesh, population_axis, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(cores)), raising=False)
    assert cpu_device_count(mesh, batch, population_axis) == want


def test_split_cpu_leaves_a_started_backend_and_given_counts_alone(monkeypatch):
    import jax

    before = len(jax.devices())  # this process's backend has started
    assert not split_cpu(2)  # the suite's XLA_FLAGS gives a count
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert not split_cpu(2)  # no count given, but the backend has started: jax refuses, nothing changes
    assert len(jax.devices()) == before
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "4")
    assert not split_cpu(2)


def test_a_negative_cpu_device_count_is_refused():
    with pytest.raises(ConfigError, match="mesh.cpu_devices"):
        config_lib.load(None, ["mesh.cpu_devices=-1"])
