"""Compiling for NVIDIA GPUs without one (JAX's CUDA plugin, the cuda extra): the topologies, the memory a process
gets, and what is said where the plugin is missing."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import cuda_plugin_path, env

from metatrain import aot, cli, hostmem, models
from metatrain.errors import ConfigError, TrainingError


@pytest.mark.parametrize("topology, says", [("h100:0", "NAME:COUNT"), ("h100:two", "NAME:COUNT"),
                                            ("h300", "or as h100 or h200 for GPUs")])
def test_a_bad_gpu_topology_is_a_one_line_error(capsys, topology, says):
    """Before the command's first line (nothing is compiled, nothing described)."""
    for argv in (["compile", "--model", "tiny"], ["bench", "memory", "--backend", "gpu"], ["bench", "fit"]):
        assert cli.main([*argv, "--topology", topology]) == 2
        out, err = capsys.readouterr()
        name = " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
        assert not out and err.startswith(f"metatrain {name}: error: --topology") and says in err, (out, err)
        assert "\n" not in err.strip()


@pytest.mark.parametrize("topology, says", [pytest.param(*case, id=case[0]) for case in [
    ("v5p-16", "accelerator type (16 TensorCores, 8 chips); --topology takes the slice's chips as GENERATION:AxB[xC], "
               "e.g. v5p:2x2x2, its default shape"),
    ("v4-32", "(32 TensorCores, 16 chips); --topology takes the slice's chips as GENERATION:AxB[xC], e.g. v4:2x2x4,"),
    ("v5litepod-8", "accelerator type (8 chips); --topology takes the slice's chips as GENERATION:AxB[xC], e.g. "
                    "v5e:2x4,"),
    ("v6e-6", "looks like an accelerator type; --topology takes the slice's chips as GENERATION:AxB[xC], e.g. v6e:2x4"),
    ("v5litepod:2x2", "write the generation as v5e, e.g. v5e:2x2")]])
def test_an_accelerator_type_as_topology_names_the_slice_shape(capsys, topology, says):
    """gcloud's --accelerator-type (v5p-16: TensorCores; v5litepod-8: chips) where --topology wants the chip grid;
    libtpu knows v5e, not v5litepod ("Invalid TPU external name")."""
    assert cli.main(["compile", "--model", "tiny", "--topology", topology]) == 2
    out, err = capsys.readouterr()
    assert not out and err.startswith(f"metatrain compile: error: --topology {topology!r}: ") and says in err, err
    assert "\n" not in err.strip()


def test_the_default_shapes_of_accelerator_types_are_slices_of_that_many_chips():
    """The shapes the hint above names, described by libtpu: one device per chip, as JAX has them on a TPU VM (v4
    too, whose two TensorCores are one device: 4 on a v4-8)."""
    pytest.importorskip("libtpu", reason="needs the tpu extra (CI installs it): pip install -e '.[tpu]'")
    for generation, shapes in (("v4", aot._CUBE_SHAPES), ("v5p", aot._CUBE_SHAPES), ("v5e", aot._GRID_SHAPES),
                               ("v6e", aot._GRID_SHAPES)):
        for chips, shape in shapes.items():
            devices, _ = aot.topology_devices(f"{generation}:{shape}")
            assert len(devices) == chips, (generation, shape, len(devices))
            assert len({tuple(d.coords) for d in devices}) == chips, (generation, shape)


@pytest.mark.parametrize("fraction", ["1.5", "0", "most"])
def test_a_bad_memory_fraction_is_a_one_line_error(capsys, monkeypatch, fraction):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
    monkeypatch.setattr(aot, "cuda_plugin_installed", lambda: True)  # the fraction is read before the plugin starts
    assert cli.main(["compile", "--topology", "h100", "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction!r}" in err and "\n" not in err


@pytest.mark.parametrize("argv, backend, extra", [
    (["compile", "--topology", "h200"], "gpu", "cuda"),
    (["bench", "fit", "--topology", "h100"], "gpu", "cuda"),
    (["bench", "memory", "--backend", "gpu"], "gpu", "cuda"),
    (["compile", "--topology", "v5p:1x1x1"], "tpu", "tpu"),
    (["bench", "memory", "--backend", "tpu", "--topology", "v5p:2x2x1"], "tpu", "tpu"),
])
def test_without_the_compiler_its_extra_is_named_before_the_first_line(capsys, monkeypatch, argv, backend, extra):
    """No CUDA plugin (libtpu) where a GPU (TPU) is compiled for: the extra to install, before the command's header
    and before anything is compiled (bench fit compiled a first preset, then stopped)."""
    monkeypatch.setattr(aot, "cuda_plugin_installed", lambda: False)
    monkeypatch.setattr(aot, "libtpu_installed", lambda: False)
    assert cli.main([*argv, "--model", "tiny"]) == 2
    out, err = capsys.readouterr()
    assert not out, out
    err = err.strip()
    name = " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
    assert err.startswith(f"metatrain {name}: error: ") and f"compiling for a {backend.upper()} needs" in err
    assert f"pip install 'metatrain[{extra}]'" in err and "\n" not in err


def test_without_the_cuda_plugin_the_cuda_extra_is_named(monkeypatch):
    """From the Python API too (`aot.topology_devices`), where no command checked first."""
    from jax.experimental import topologies

    def missing(*args, **kwargs):  # what JAX raises where no CUDA plugin is installed
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", missing)
    monkeypatch.setattr(aot, "cuda_plugin_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"pip install 'metatrain\[cuda\]'"):
        aot.topology_devices("h200")


def test_a_cuda_plugin_that_did_not_start_is_named(capsys, monkeypatch):
    """Installed, but stopped at its CUDA checks (JAX_PLATFORMS naming cuda on a machine without a GPU): not "install
    the cuda extra"."""
    from jax.experimental import topologies

    def missing(*args, **kwargs):  # what JAX raises where the plugin did not register itself
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", missing)
    monkeypatch.setattr(aot, "cuda_plugin_installed", lambda: True)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert cli.main(["compile", "--topology", "h200", "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is installed but did not start (JAX_PLATFORMS='cuda,cpu'); set JAX_PLATFORMS=cpu" in err, err
    assert "pip install" not in err and "\n" not in err


def test_bench_memory_backend_and_topology_agree(capsys):
    assert cli.main(["bench", "memory", "--topology", "h100", "--model", "tiny"]) == 2
    assert "--topology h100 is for --backend gpu" in capsys.readouterr().err
    assert cli.main(["bench", "memory", "--backend", "gpu", "--topology", "v5p:1x1x1", "--model", "tiny"]) == 2
    assert "--topology v5p:1x1x1 is for --backend tpu" in capsys.readouterr().err


@pytest.mark.slow  # XLA's GPU compiler: about 12 CPU s for the tiny outer step at T=1 (19 s at T=2)
@pytest.mark.skipif(cuda_plugin_path() is None,
                    reason="needs JAX's CUDA plugin (no GPU): pip install -e '.[cuda]', or .ci/run's .cuda_plugin "
                           "at this jaxlib's version")
def test_compile_for_two_gpus_without_one(tmp_path):
    """FSDP over two H100s, compiled in a process of its own with the plugin, JAX_PLATFORMS unset as a user runs it
    (the plugin stops at its CUDA checks on a machine without a GPU unless the command keeps JAX to the CPU): each
    holds half the state; the peak is arguments + outputs - aliased + temp, against the memory JAX's allocator gives
    a process (here 0.95 of it)."""
    out = tmp_path / "compile.json"
    e = env(XLA_PYTHON_CLIENT_MEM_FRACTION="0.95")
    e["PYTHONPATH"] = os.pathsep.join(p for p in (cuda_plugin_path(), e["PYTHONPATH"]) if p)
    del e["JAX_PLATFORMS"]
    res = subprocess.run([sys.executable, "-m", "metatrain.cli", "compile", "--topology", "h100:2", "--model", "tiny",
                          "--seq-len", "16", "--batch", "4", "--inner-steps", "1", "--json", str(out)],
                         capture_output=True, text=True, env=e)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "plugin configuration error" not in res.stderr, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["backend"] == "gpu" and r["devices"] == 2 and r["mesh"] == {"data": 1, "fsdp": 2} and r["exact"]
    assert r["device"] == aot.GPUS["h100"]["name"]
    assert r["peak_bytes"] == r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"]
    assert r["flops"] is None or r["flops"] > 0  # a count, or none (not 0.0) where the compiler reports no cost
    assert r["hbm_bytes"] == 0.95 * aot.GPUS["h100"]["memory_bytes"] and r["fits"]
    state = 3 * 4 * models.param_count(models.preset("tiny"))  # η and Adam's two moments, float32
    assert 0.5 * state <= r["argument_bytes"] < 0.6 * state  # half of it, and the batches


def test_memory_here_and_the_fit_check_on_cpu_devices(monkeypatch):
    """On CPU the devices of one process share the host's available memory, which their arguments (the state) have
    taken already: what each peak holds beyond them adds up against it."""
    import types

    cpu = jax.devices("cpu")[0]
    have = aot.memory_here(cpu)
    assert have is not None and 0 < have <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    devices = [types.SimpleNamespace(platform="cpu", process_index=jax.process_index(), device_kind="cpu")] * 4
    monkeypatch.setattr(aot, "memory_here", lambda device: 4 * 2**30)
    aot.check_fits({"peak_bytes": 3 * 2**30, "argument_bytes": 2 * 2**30}, devices)  # 4 x 1 GiB: what is here
    with pytest.raises(TrainingError, match=r"needs 4\.0 GiB beyond its arguments \(in memory already\) at "
                                            r"its peak \(3\.0 GiB per device x 4 CPU devices\), more than the 4\.0 GiB "
                                            r"available on this machine; use smaller batches"):
        aot.check_fits({"peak_bytes": 3 * 2**30 + 1, "argument_bytes": 2 * 2**30}, devices)
    gpu = [types.SimpleNamespace(platform="gpu", process_index=jax.process_index(), device_kind="NVIDIA H200")] * 2
    aot.check_fits({"peak_bytes": 4 * 2**30, "argument_bytes": 2**30}, gpu)  # each GPU its own limit
    with pytest.raises(TrainingError, match=r"needs 4\.0 GiB at its peak, more than the 4\.0 GiB of the NVIDIA H200"):
        aot.check_fits({"peak_bytes": 4 * 2**30 + 1, "argument_bytes": 2**30}, gpu)
    monkeypatch.setattr(aot, "memory_here", lambda device: None)  # unknown: passes
    aot.check_fits({"peak_bytes": 2**60, "argument_bytes": 0}, devices)


def test_a_state_is_held_against_the_memory_here_before_it_is_allocated(monkeypatch):
    """What one device holds of each leaf (its shard, or a copy where replicated; host-placed leaves apart), counted
    by hand: on CPU all of a process's devices against the host's memory; on a GPU one device's share against its
    limit, and the host-placed leaves of all of them against the host's."""
    import types

    def sharding(split: int, kind: str = "device"):  # the leading axis over `split` devices
        return types.SimpleNamespace(shard_shape=lambda shape: (shape[0] // split, *shape[1:]), memory_kind=kind)

    M, MiB = 2**20, 2**20
    shapes = {"w": jax.ShapeDtypeStruct((8 * M, 4), jnp.float32), "b": jax.ShapeDtypeStruct((6 * M,), jnp.bfloat16),
              "m": jax.ShapeDtypeStruct((4 * M, 4), jnp.float32)}
    shardings = {"w": sharding(2), "b": sharding(1), "m": sharding(4, "pinned_host")}
    assert aot.state_bytes(shapes, shardings) == (64 * MiB + 12 * MiB, 16 * MiB)  # half of w, all of b; a 4th of m

    def check(devices):
        aot.check_state_fits(shapes, shardings, devices, "the state", "shrink it")

    cpu = [types.SimpleNamespace(platform="cpu", process_index=jax.process_index(), device_kind="cpu")] * 4
    monkeypatch.setattr(hostmem, "available", lambda: 4 * 92 * MiB)
    check(cpu)  # 4 x (76 + 16) MiB: what is here
    monkeypatch.setattr(hostmem, "available", lambda: 4 * 92 * MiB - 1)
    with pytest.raises(ConfigError, match=r"^the state takes 368\.0 MiB \(92\.0 MiB per device x 4 CPU devices\), "
                                          r"more than the 368\.0 MiB available on this machine; shrink it$"):
        check(cpu)
    gpu = [types.SimpleNamespace(platform="gpu", process_index=jax.process_index(), device_kind="NVIDIA H200")] * 4
    monkeypatch.setattr(aot, "memory_here", lambda device: 76 * MiB)
    monkeypatch.setattr(hostmem, "available", lambda: 64 * MiB)
    check(gpu)  # each GPU holds 76 MiB; the host the four host-placed shards
    monkeypatch.setattr(aot, "memory_here", lambda device: 76 * MiB - 1)
    with pytest.raises(ConfigError, match=r"^the state takes 76\.0 MiB per device, more than the 76\.0 MiB of the "
                                          r"NVIDIA H200 JAX may use; shrink it$"):
        check(gpu)
    monkeypatch.setattr(aot, "memory_here", lambda device: None)  # unknown: passes
    monkeypatch.setattr(hostmem, "available", lambda: 64 * MiB - 1)
    with pytest.raises(ConfigError, match=r"^the state takes 64\.0 MiB in host memory, more than the 64\.0 MiB "
                                          r"available on this machine; shrink it$"):
        check(gpu)
    monkeypatch.setattr(hostmem, "available", lambda: None)
    check(gpu)


def test_an_allocation_the_device_refuses_is_one_line():
    """XLA:CPU's form (check-grads at a batch of 10^6 rows: "INTERNAL: Error dispatching computation: ... Out of
    memory allocating N bytes.", then a traceback) and a GPU's (RESOURCE_EXHAUSTED) are said in one line; other
    runtime errors pass as they are."""
    cpu = "INTERNAL: Error dispatching computation: Error dispatching computation: Out of memory allocating 155 bytes."
    with pytest.raises(TrainingError, match=r"^the problem ran out of memory \(Out of memory allocating 155 bytes\); "
                                            r"use less$"), aot.out_of_memory("the problem", "use less"):
        raise jax.errors.JaxRuntimeError(cpu)
    with pytest.raises(TrainingError, match=r"^x ran out of memory \(RESOURCE_EXHAUSTED: Out of memory while trying "
                                            r"to allocate 130\.22GiB\); y$"), aot.out_of_memory("x", "y"):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 130.22GiB.\nmore")
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: other"), aot.out_of_memory("x", "y"):
        raise jax.errors.JaxRuntimeError("INTERNAL: other")


def test_memory_here_on_cpu_is_what_the_host_and_its_container_leave(tmp_path, monkeypatch):
    """MemAvailable, within a cgroup v2 limit less what the cgroup uses beyond the page cache it could drop."""
    GiB = 2**30
    (tmp_path / "meminfo").write_text(f"MemTotal: {32 * GiB // 1024} kB\nMemAvailable: {10 * GiB // 1024} kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    monkeypatch.setattr(hostmem, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(hostmem, "CGROUP", str(cgroup))
    cpu = jax.devices("cpu")[0]
    assert aot.memory_here(cpu) == 10 * GiB
    (cgroup / "memory.max").write_text(f"{8 * GiB}\n")
    (cgroup / "memory.current").write_text(f"{7 * GiB}\n")
    (cgroup / "memory.stat").write_text(f"anon {4 * GiB}\nfile {3 * GiB}\ninactive_file {3 * GiB}\n")
    assert aot.memory_here(cpu) == 4 * GiB  # 8 - (7 - 3)
    (cgroup / "memory.max").write_text(f"{20 * GiB}\n")
    assert aot.memory_here(cpu) == 10 * GiB  # the host has less


def test_a_program_without_a_cost_analysis_has_no_flops():
    """XLA's GPU compiler, for a GPU described without one, reports no cost analysis: its rows said 0.0 GFLOPs.
    They say none (`-` in bench memory's table), and `metagrad.mode=auto` ranks such candidates by peak alone."""
    from metatrain import auto

    class Compiled:  # what memory_analysis / cost_analysis give for such a program
        def memory_analysis(self):
            sizes = dict(argument_size_in_bytes=100, output_size_in_bytes=40, alias_size_in_bytes=40,
                         temp_size_in_bytes=60, host_temp_size_in_bytes=0, host_argument_size_in_bytes=0,
                         host_output_size_in_bytes=0, host_alias_size_in_bytes=0, peak_memory_in_bytes=0)
            return type("Memory", (), sizes)()

        def cost_analysis(self):
            return None

        input_shardings = ()  # no device to tell the platform: this machine's (the peak is the sum)

    m = aot.compiled_memory(Compiled())
    assert m["flops"] is None and m["peak_bytes"] == 160
    line = auto.describe({"mode": "mixflow", "kept_states": "every_step",
                          "candidates": {"mixflow": {"peak_bytes": 2**20, "flops": None},
                                         "autodiff": {"peak_bytes": 2**21, "flops": 3e9}}})
    assert line == ("auto: mixflow peak 1.0 MiB, FLOPs not counted; autodiff peak 2.0 MiB, 3.00 GFLOPs -> "
                    "metagrad.mode=mixflow metagrad.kept_states=every_step")
