"""The `metatrain` program: relaunched once so that glibc backs its large allocations with transparent huge pages,
then the command line.

XLA:CPU allocates the temporaries of each run of a compiled program anew, as one block (about 170 MB per device for
the main job's outer step), and frees it after the run. glibc serves a block that large with fresh pages from the
kernel, so every step faults its whole working set in, 4 KiB at a time: about a sixth of the main job's step on
two cores. glibc's `glibc.malloc.hugetlb=1` tunable makes it ask for transparent huge pages for such blocks (512
times fewer faults). Tunables are read only when a process starts, hence the relaunch: the same process (`exec`),
arguments and environment plus the tunable, before anything heavy is imported. It is skipped where it cannot help:
not glibc 2.35 or later, transparent huge pages `always` (the kernel does it already) or `never`, or
GLIBC_TUNABLES already naming `glibc.malloc.hugetlb` (`GLIBC_TUNABLES=glibc.malloc.hugetlb=0` turns it off).
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
SYSTEM = "system"  # hugepage_env's default: this machine's


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


def main() -> int:
    relaunch()
    from metatrain.cli import main as cli_main

    return cli_main()
