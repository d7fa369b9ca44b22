"""The memory this machine has available to this process: the host's `MemAvailable`, within its cgroup's limit.

Standard library only: the data pipeline checks its buffers against it without importing JAX."""

from __future__ import annotations

import os

MEMINFO, CGROUP = "/proc/meminfo", "/sys/fs/cgroup"  # the host's memory; this process's cgroup (v2)


def available() -> int | None:
    """Bytes this process may still allocate: the host's available memory (`MemAvailable`), within this process's
    cgroup limit where one is set (what is left of it, the page cache it could drop counted as free); None where
    neither is known."""
    have = None
    try:
        with open(MEMINFO) as f:
            have = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            have = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    try:  # a container's limit (cgroup v2): what is left of it, the page cache it could drop counted as free
        with open(os.path.join(CGROUP, "memory.max")) as f:
            limit = f.read().strip()
        if limit != "max":
            with open(os.path.join(CGROUP, "memory.current")) as f:
                used = int(f.read().strip())
            with open(os.path.join(CGROUP, "memory.stat")) as f:
                used -= next((int(line.split()[1]) for line in f if line.startswith("inactive_file ")), 0)
            left = max(int(limit) - used, 0)
            have = left if have is None else min(have, left)
    except (OSError, ValueError, IndexError):
        pass
    return have


def size(n: float) -> str:
    """A byte count for a message: in GiB, MiB below 1 GiB, KiB below 1 MiB, bytes below 1 KiB (never "0.0 MiB")."""
    for unit, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= unit:
            return f"{n / unit:,.1f} {name}"
    return f"{int(n):,} bytes"
