"""The `metatrain` program: relaunched once so that glibc backs its large allocations with transparent huge pages,
kept to the CPU where libtpu (JAX's CUDA plugin) is installed but there is no TPU (GPU), then the command line.

XLA:CPU allocates the temporaries of each run of a compiled program anew, as one block (about 170 MB per device for
the main job's outer step), and frees it after the run. glibc serves a block that large with fresh pages from the
kernel, so every step faults its whole working set in, 4 KiB at a time: about a sixth of the main job's step on
two cores. glibc's `glibc.malloc.hugetlb=1` tunable makes it ask for transparent huge pages for such blocks (512
times fewer faults). Tunables are read only when a process starts, hence the relaunch: the same process (`exec`),
arguments and environment plus the tunable, before anything heavy is imported. It is skipped where it cannot help:
not glibc 2.35 or later, transparent huge pages `always` (the kernel does it already) or `never`, or
GLIBC_TUNABLES already naming `glibc.malloc.hugetlb` (`GLIBC_TUNABLES=glibc.malloc.hugetlb=0` turns it off).

libtpu (the `tpu` extra) and JAX's CUDA plugin (the `cuda` extra) let a CPU machine compile TPU and GPU programs
ahead of time. Where one is installed, JAX also tries to start it as a backend on every command: on a machine without
TPU chips libtpu prints errors about finding no TPU (accelerator type, worker hostnames), and on one without an NVIDIA
GPU the CUDA plugin logs a traceback (`cuInit` failed), before JAX falls back to the CPU. There, with no other JAX
plugin and JAX_PLATFORMS unset, the program sets JAX_PLATFORMS=cpu: the same run, without the errors; TPU and GPU
programs still compile ahead of time.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import pkgutil
import sys

from metatrain.platforms import use_cpu

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
SYSTEM = "system"  # hugepage_env's and cpu_env's default: this machine's
GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips on the PCI bus (what JAX's own TPU check reads)


def _glibc_version() -> tuple[int, ...] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        return tuple(int(x) for x in version.split(".")[:2]) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):  # not glibc, or no confstr
        return None


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`), or None without one."""
    try:
        with open(THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def hugepage_env(environ, glibc=SYSTEM, thp=SYSTEM) -> dict | None:
    """The environment to start a process with so that glibc asks for huge pages for its large blocks, or None
    where that would not help (see the module's docstring).

    Args:
      environ: the current environment.
      glibc: glibc's (major, minor) version, None for another C library; by default this process's.
      thp: the kernel's transparent huge page mode, None without one; by default this machine's.

    Returns:
      `environ` with `glibc.malloc.hugetlb=1` added to GLIBC_TUNABLES, or None.
    """
    glibc = _glibc_version() if glibc == SYSTEM else glibc
    thp = _thp_mode() if thp == SYSTEM else thp
    tunables = environ.get("GLIBC_TUNABLES", "")
    if not glibc or glibc < (2, 35) or thp != "madvise" or TUNABLE + "=" in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, TUNABLE + "=1"]))}


def relaunch() -> None:
    """Start this program again in this process with `hugepage_env`, where that applies; otherwise return."""
    env = hugepage_env(os.environ)
    if env is None or not sys.orig_argv:
        return
    sys.stdout.flush(), sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:  # the run goes on without huge pages
        pass


def _tpu_chips() -> bool:
    """Google's devices on the PCI bus, or TPU device files (a container may hide the bus but pass the chips)."""
    if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(path) as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def _nvidia_gpus() -> bool:
    """NVIDIA GPUs' device files (a container's too), the driver's list of them, or WSL's GPU device."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/proc/driver/nvidia/gpus/*") or
                os.path.exists("/dev/dxg"))


def _plugins() -> set[str] | None:
    """The names of the JAX plugins installed besides libtpu (e.g. `xla_cuda12`), by entry point or `jax_plugins`
    module; None where the packages' metadata cannot be read."""
    try:
        names = {e.name for e in importlib.metadata.entry_points(group="jax_plugins")}
        spec = importlib.util.find_spec("jax_plugins")
    except Exception:  # noqa: BLE001 — broken metadata
        return None
    if spec is not None and spec.submodule_search_locations:
        names |= {m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)}
    return names


def _is_cuda(name: str) -> bool:
    return name.startswith("xla_cuda")  # xla_cuda12, xla_cuda13


def cpu_env(environ, libtpu=SYSTEM, tpu_chips=SYSTEM, other_plugins=SYSTEM, cuda=SYSTEM,
            nvidia_gpus=SYSTEM) -> dict | None:
    """The environment that keeps JAX to the CPU where libtpu is installed on a machine without TPU chips, or JAX's
    CUDA plugin on one without an NVIDIA GPU, and nothing else would start; None where it does not apply (see the
    module's docstring).

    Args:
      environ: the current environment.
      libtpu: whether libtpu is installed; by default whether this Python finds it.
      tpu_chips: whether the machine has TPU chips; by default whether its PCI bus shows Google's devices or
        it has TPU device files.
      other_plugins: whether a JAX plugin besides libtpu and CUDA's is installed (e.g. ROCm's); by default this
        Python's (True where its packages' metadata cannot be read: then nothing is changed).
      cuda: whether JAX's CUDA plugin is installed; by default this Python's.
      nvidia_gpus: whether the machine has NVIDIA GPUs; by default whether it has their device files.

    Returns:
      `environ` with JAX_PLATFORMS=cpu, or None.
    """
    if "JAX_PLATFORMS" in environ:
        return None
    names = _plugins() if SYSTEM in (other_plugins, cuda) else set()
    if other_plugins == SYSTEM:
        other_plugins = names is None or any(not _is_cuda(n) for n in names)
    if cuda == SYSTEM:
        cuda = bool(names) and any(_is_cuda(n) for n in names)
    libtpu = importlib.util.find_spec("libtpu") is not None if libtpu == SYSTEM else libtpu
    if not (libtpu or cuda) or other_plugins:
        return None
    if libtpu and (_tpu_chips() if tpu_chips == SYSTEM else tpu_chips):
        return None
    if cuda and (_nvidia_gpus() if nvidia_gpus == SYSTEM else nvidia_gpus):
        return None
    return {**environ, "JAX_PLATFORMS": "cpu"}


def keep_to_cpu() -> None:
    """`use_cpu` where `cpu_env` says so."""
    if cpu_env(os.environ) is not None:
        use_cpu()


def main() -> int:
    relaunch()
    keep_to_cpu()
    try:
        from metatrain.cli import freeze_imported
        from metatrain.cli import main as cli_main
    except KeyboardInterrupt:  # Ctrl-C while the program starts
        print("metatrain: stopped by SIGINT", file=sys.stderr)
        return 130
    freeze_imported()
    return cli_main()
