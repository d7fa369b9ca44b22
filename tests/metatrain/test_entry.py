import os
import subprocess
import sys

import pytest
from helpers import cuda_plugin_path

from metatrain import entry
from metatrain.entry import hugepage_env


@pytest.mark.parametrize("glibc,thp,before,after", [
    ((2, 36), "madvise", None, "glibc.malloc.hugetlb=1"),
    ((2, 35), "madvise", "glibc.malloc.tcache_count=8", "glibc.malloc.tcache_count=8:glibc.malloc.hugetlb=1"),
    ((2, 36), "always", None, None),  # the kernel backs large blocks with huge pages already
    ((2, 36), "never", None, None),
    ((2, 36), None, None, None),  # no transparent huge pages at all
    ((2, 34), "madvise", None, None),  # no such tunable yet
    ((2, 36), "madvise", "glibc.malloc.hugetlb=0", None),  # the user's own choice stays
])
def test_hugepage_env_adds_the_tunable_only_where_it_helps(glibc, thp, before, after):
    environ = {"PATH": "/bin"} | ({"GLIBC_TUNABLES": before} if before else {})
    got = hugepage_env(environ, glibc=glibc, thp=thp)
    assert (got if got is None else got["GLIBC_TUNABLES"]) == after
    if got is not None:
        assert got["PATH"] == "/bin"


def test_not_glibc_is_left_alone(monkeypatch):
    monkeypatch.setattr(entry, "_glibc_version", lambda: None)
    assert hugepage_env({}, thp="madvise") is None


def test_relaunch_execs_the_same_command_with_the_tunable(monkeypatch):
    calls = []
    monkeypatch.setattr(entry, "hugepage_env", lambda environ: {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    monkeypatch.setattr(sys, "orig_argv", ["python3", "/venv/bin/metatrain", "train", "steps=3"])
    monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
    entry.relaunch()
    assert calls == [(sys.executable, [sys.executable, "/venv/bin/metatrain", "train", "steps=3"],
                      {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})]


def test_relaunch_in_a_real_process_runs_once_with_what_hugepage_env_says(tmp_path):
    """The program's process restarts itself at most once; it ends with the tunables `hugepage_env` gives for this
    machine (unchanged where huge pages do not help here)."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    script = tmp_path / "prog.py"
    script.write_text("import os, sys\nfrom metatrain import entry\n"
                      "print('start', flush=True)\nentry.relaunch()\n"
                      "print('tunables', os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])\n")
    out = subprocess.run([sys.executable, str(script), "a", "b c"], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    expected = (hugepage_env(env) or env).get("GLIBC_TUNABLES")
    assert out == ["start"] * (1 + (expected is not None)) + [f"tunables {expected} ['a', 'b c']"]


@pytest.mark.parametrize("environ,libtpu,chips,cuda,gpus,plugins,after", [
    ({}, True, False, False, False, False, "cpu"),  # the tpu extra on a CPU machine
    ({}, True, True, False, False, False, None),  # a TPU VM
    ({}, False, False, False, False, False, None),  # neither: nothing to keep out
    ({}, True, False, False, False, True, None),  # another plugin (e.g. ROCm's) beside libtpu: JAX picks
    ({}, False, False, True, False, False, "cpu"),  # the cuda extra on a machine without a GPU
    ({}, False, False, True, True, False, None),  # a GPU machine
    ({}, True, False, True, False, False, "cpu"),  # both extras, neither device
    ({}, True, False, True, True, False, None),  # both extras on a GPU machine
    ({}, False, False, True, False, True, None),  # another plugin beside CUDA's: JAX picks
    ({"JAX_PLATFORMS": ""}, True, False, True, False, False, None),  # the user's own choice stays
    ({"JAX_PLATFORMS": "tpu"}, True, False, False, False, False, None),
    ({"JAX_PLATFORMS": "cuda"}, False, False, True, False, False, None),
])
def test_cpu_env_keeps_an_accelerator_plugin_out_only_on_a_machine_without_its_device(environ, libtpu, chips, cuda,
                                                                                        gpus, plugins, after):
    got = entry.cpu_env({"PATH": "/bin", **environ}, libtpu=libtpu, tpu_chips=chips, other_plugins=plugins, cuda=cuda,
                        nvidia_gpus=gpus)
    assert (got if got is None else got["JAX_PLATFORMS"]) == after
    if got is not None:
        assert got["PATH"] == "/bin"


def test_plugins_are_found_by_their_jax_plugins_module(tmp_path, monkeypatch):
    """How JAX finds a plugin without an entry point: a module in the `jax_plugins` namespace package."""
    for name in ("xla_cuda13", "xla_rocm"):
        (tmp_path / "jax_plugins" / name).mkdir(parents=True)
        (tmp_path / "jax_plugins" / name / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert {"xla_cuda13", "xla_rocm"} <= entry._plugins()


def _program_start(environ, cwd) -> subprocess.CompletedProcess:
    """The `metatrain` program's start in a process of its own, in the console script's order (metatrain.entry,
    then in its main the command line), with a command line that prints JAX_PLATFORMS and starts JAX."""
    code = ("import os, sys, types; cli = sys.modules['metatrain.cli'] = types.ModuleType('metatrain.cli'); "
            "cli.main = lambda: print(os.environ['JAX_PLATFORMS'], __import__('jax').devices()); "
            "cli.freeze_imported = lambda: None; "
            "from metatrain import entry; entry.main()")
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, cwd=cwd,
                          timeout=120)


@pytest.mark.skipif(cuda_plugin_path() is None,
                    reason="needs JAX's CUDA plugin (no GPU): pip install -e '.[cuda]', or .ci/run's .cuda_plugin "
                           "at this jaxlib's version")
def test_a_machine_without_a_gpu_runs_the_cuda_extra_on_the_cpu_without_a_traceback(tmp_path):
    """As a user with the cuda extra on a CPU machine (a laptop, a login node) runs it, JAX_PLATFORMS unset: the CUDA
    plugin's start logged a traceback ("cuInit(0) failed") on every command before JAX fell back to the CPU."""
    if entry._nvidia_gpus():
        pytest.skip("this machine has an NVIDIA GPU")
    environ = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (cuda_plugin_path(), environ.get("PYTHONPATH")) if p)
    res = _program_start(environ, tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("cpu [CpuDevice"), res.stdout + res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "cuInit" not in res.stderr, res.stderr[-2000:]


def test_main_sets_jax_platforms_before_the_command_line_imports_jax(monkeypatch):
    import metatrain.cli

    monkeypatch.setenv("JAX_PLATFORMS", "unset below; restored after the test")
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(entry, "relaunch", lambda: None)
    monkeypatch.setattr(entry, "cpu_env", lambda environ: {**environ, "JAX_PLATFORMS": "cpu"})
    monkeypatch.setattr(metatrain.cli, "main", lambda: os.environ.get("JAX_PLATFORMS"))
    monkeypatch.setattr(metatrain.cli, "freeze_imported", lambda: None)
    assert entry.main() == "cpu"


def test_a_cpu_machine_with_libtpu_runs_on_the_cpu_without_tpu_errors(tmp_path):
    """As a user runs it: the `metatrain` program, JAX_PLATFORMS unset, on this machine (CI installs libtpu). Whether
    libtpu prints its errors may depend on what else holds it (its lock file), so the platform the program set is
    checked too."""
    pytest.importorskip("libtpu", reason="needs the tpu extra (CI installs it): pip install -e '.[tpu]'")
    if entry._tpu_chips():
        pytest.skip("this machine has TPU chips")
    environ = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    res = _program_start(environ, tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("cpu [CpuDevice"), res.stdout + res.stderr[-2000:]
    assert "TPU" not in res.stderr, res.stderr[-2000:]
    # `python -m metatrain.cli`'s order: the package (JAX with it) imported first, then the CPU kept
    code = ("import os, jax; from metatrain.entry import keep_to_cpu; keep_to_cpu(); "
            "print(os.environ['JAX_PLATFORMS'], jax.devices())")
    res = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("cpu [CpuDevice"), res.stdout + res.stderr[-2000:]
    assert "TPU" not in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("files,vendor,chips", [
    ({}, "0x1022", False),  # an AMD host bridge: a CPU machine
    ({}, "0x1ae0", True),  # Google's PCI device
    ({"/dev/accel[0-9]*": ["/dev/accel0"]}, "0x1022", True),  # TPU v4 and older: the bus hidden, the chip passed
    ({"/dev/vfio/[0-9]*": ["/dev/vfio/0"]}, "0x1022", True),  # v5 and newer
])
def test_tpu_chips_are_seen_on_the_pci_bus_or_as_device_files(tmp_path, monkeypatch, files, vendor, chips):
    (tmp_path / "vendor").write_text(vendor + "\n")
    bus = {"/sys/bus/pci/devices/*/vendor": [str(tmp_path / "vendor")]}
    monkeypatch.setattr(entry.glob, "glob", lambda pattern: {**bus, **files}.get(pattern, []))
    assert entry._tpu_chips() == chips
