"""Compiling for NVIDIA GPUs without one (JAX's CUDA plugin, the cuda extra): the topologies, the memory a process
gets, and what is said where the plugin is missing."""

import importlib.util

import pytest

from metatrain import aot, cli, models
from metatrain.bench.variants import run_config


def _cuda_plugin() -> bool:
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


@pytest.mark.parametrize("topology, says", [("h100:0", "NAME:COUNT"), ("h100:two", "NAME:COUNT"),
                                            ("h300", "or as h100 or h200 for GPUs")])
def test_a_bad_gpu_topology_is_a_one_line_error(capsys, topology, says):
    assert cli.main(["compile", "--topology", topology, "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("metatrain compile: error: --topology") and says in err and "\n" not in err


@pytest.mark.parametrize("fraction", ["1.5", "0", "most"])
def test_a_bad_memory_fraction_is_a_one_line_error(capsys, monkeypatch, fraction):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
    assert cli.main(["compile", "--topology", "h100", "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction!r}" in err and "\n" not in err


def test_without_the_cuda_plugin_the_cuda_extra_is_named(capsys, monkeypatch):
    from jax.experimental import topologies

    def missing(*args, **kwargs):  # what JAX raises where no CUDA plugin is installed
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", missing)
    assert cli.main(["compile", "--topology", "h200", "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'metatrain[cuda]'" in err and "\n" not in err


def test_bench_memory_backend_and_topology_agree(capsys):
    assert cli.main(["bench", "memory", "--topology", "h100", "--model", "tiny"]) == 2
    assert "--topology h100 is for --backend gpu" in capsys.readouterr().err
    assert cli.main(["bench", "memory", "--backend", "gpu", "--topology", "v5p:1x1x1", "--model", "tiny"]) == 2
    assert "--topology v5p:1x1x1 is for --backend tpu" in capsys.readouterr().err


@pytest.mark.skipif(not _cuda_plugin(), reason="needs JAX's CUDA plugin (no GPU): pip install -e '.[cuda]'")
def test_compile_for_two_gpus_without_one(monkeypatch):
    """FSDP over two H100s: each holds half the state; the peak is arguments + outputs - aliased + temp (on the
    H200 we measured, the compiled peak equalled the measured one to the byte), against the memory JAX's allocator
    gives a process."""
    from metatrain.bench.compile import compile_report

    cfg = run_config("maml", models.preset("tiny"), 16, 4, 2, ["mesh.fsdp=-1", "mesh.data=-1"])
    r = compile_report(cfg, "h100:2")
    assert r["backend"] == "gpu" and r["devices"] == 2 and r["mesh"] == {"data": 1, "fsdp": 2} and r["exact"]
    assert r["peak_bytes"] == r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"]
    assert r["hbm_bytes"] == 0.75 * aot.GPUS["h100"]["memory_bytes"] and r["fits"]
    state = 3 * 4 * models.param_count(models.preset("tiny"))  # η and Adam's two moments, float32
    assert 0.5 * state <= r["argument_bytes"] < 0.6 * state  # half of it, and the batches
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    _, memory = aot.topology_devices("h200")
    assert memory == 0.95 * aot.GPUS["h200"]["memory_bytes"]
