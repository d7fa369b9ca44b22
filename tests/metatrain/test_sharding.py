import os
import subprocess
import sys

import pytest

from metatrain import config as config_lib
from metatrain.config import MeshConfig
from metatrain.errors import ConfigError
from metatrain.sharding import XLA_THREADS, cpu_device_count, cpu_threads, split_cpu


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

    monkeypatch.setenv(XLA_THREADS, "")  # restored at the end: split_cpu may size the pools for a given count
    monkeypatch.delenv(XLA_THREADS)

    before = len(jax.devices())  # this process's backend has started
    assert not split_cpu(2)  # the suite's XLA_FLAGS gives a count
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert not split_cpu(2)  # no count given, but the backend has started: jax refuses, nothing changes
    assert len(jax.devices()) == before
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "4")
    assert not split_cpu(2)


def test_xla_gets_four_threads_per_device_unless_told(monkeypatch):
    """The pools' size is the process's to choose once: set before the backend starts, kept when the user set it."""
    monkeypatch.setenv(XLA_THREADS, "")
    monkeypatch.delenv(XLA_THREADS)
    cpu_threads(1)
    assert XLA_THREADS not in os.environ  # one device: XLA's own sizes
    cpu_threads(8)
    assert int(os.environ[XLA_THREADS]) == max(32, len(os.sched_getaffinity(0)))
    monkeypatch.setenv(XLA_THREADS, "5")
    cpu_threads(8)
    assert os.environ[XLA_THREADS] == "5"


@pytest.mark.slow
def test_xla_cpu_sizes_its_thread_pool_from_the_split():
    """XLA:CPU really reads the size: a process split into 8 devices runs its programs on 32 intra-op threads, not
    on max(cores, 8)."""
    code = ("import os; from metatrain.sharding import split_cpu; assert split_cpu(8); import jax; "
            "jax.jit(lambda x: x + 1)(1.0).block_until_ready(); "
            "print(sum('XLAEigen' in open(f'/proc/self/task/{t}/comm').read() for t in os.listdir('/proc/self/task')))")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", XLA_THREADS, "JAX_NUM_CPU_DEVICES")}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == max(32, len(os.sched_getaffinity(0)))


def test_a_negative_cpu_device_count_is_refused():
    with pytest.raises(ConfigError, match="mesh.cpu_devices"):
        config_lib.load(None, ["mesh.cpu_devices=-1"])


@pytest.mark.slow
@pytest.mark.tpu_backend
@pytest.mark.parametrize("population", [0, 2])
def test_fsdp_splits_the_activations_batch_over_the_devices(population):
    """Compiled for 4 TPU chips (FSDP, or 2 members side by side over FSDP pairs), every [batch, seq, d_ff] MLP
    activation a chip holds has its share of the batch: 8 sequences over 4 chips, or a member's 8 over 2."""
    pytest.importorskip("libtpu", reason="needs the tpu extra (CI installs it): pip install -e '.[tpu]'")
    import re

    from metatrain import step
    from metatrain.bench.compile import program_for

    pop = [f"population.size={population}", "population.axis=true"] if population else []
    # no uniform baseline and one inner step: more inner work adds compile time (libtpu: 35 -> 12 s for both cases)
    # and nothing to check
    cfg = config_lib.load("default", ["model.d_ff=384", "model.scan_layers=true", "data.batch=8", "data.seq_len=24",
                                      "baseline=none", "data.inner_steps=1", "mesh.fsdp=-1", "mesh.cpu_devices=1",
                                      *pop])
    program, _ = program_for(cfg, "v5p:2x2x1")
    text = step.lower(program).compile().as_text()
    batches = {int(b) for b in re.findall(r"(\d+),24,384\]", text)}  # the dim before [seq, d_ff]
    assert batches == {8 // (2 if population else 4)}, batches
