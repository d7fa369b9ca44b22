"""Ahead-of-time helpers: a compiled program's memory, and TPU devices to compile for without a TPU.

Depends on JAX alone, so the Trainer (mode=auto), `metatrain compile` and the benchmarks can all use
it. A TPU topology comes from libtpu (the `tpu` extra); its compiler refuses a program whose
temporaries pass the chip's HBM with RESOURCE_EXHAUSTED, and `required_bytes` reads what it asked for.
"""

from __future__ import annotations

import os
import re

from metatrain.errors import ConfigError

GiB = 2**30
HBM_GIB = {"v4": 32.0, "v5e": 16.0, "v5litepod": 16.0, "v5p": 95.74, "v6e": 32.0}  # per chip


def compiled_memory(compiled) -> dict:
    """A compiled program's buffer sizes, its peak (arguments + outputs - aliased + temp) and XLA's FLOPs."""
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    sizes = {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
             "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes}
    peak = sizes["argument_bytes"] + sizes["output_bytes"] - sizes["alias_bytes"] + sizes["temp_bytes"]
    return sizes | {"peak_bytes": peak, "flops": float((cost or {}).get("flops", 0.0))}


def topology_devices(topology: str):
    """(TPU devices of e.g. "v5p:2x2x1" for ahead-of-time compilation, HBM bytes per chip). Needs libtpu."""
    from jax.experimental import topologies

    # AOT compiles touch no chip: let them run beside another JAX process that holds libtpu's lock file
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    m = re.fullmatch(r"(v\d+[a-z]*):(\d+)x(\d+)(?:x(\d+))?", topology)
    if not m:
        raise ConfigError(f"--topology {topology!r}: write it as GENERATION:AxBxC, e.g. v5p:2x2x1")
    chip, dims = m.group(1), tuple(int(d) for d in m.groups()[1:] if d is not None)
    if chip not in HBM_GIB:
        raise ConfigError(f"--topology {topology!r}: unknown TPU generation {chip!r}; one of {sorted(HBM_GIB)}")
    per_host = tuple(min(d, b) for d, b in zip(dims, (2, 2, 1)))
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topology, chip_config_name="default",
                                            chips_per_host_bounds=per_host, num_slices=1)
    except Exception as e:  # noqa: BLE001 — no libtpu, or a shape the compiler does not know
        raise ConfigError(f"--topology {topology!r}: cannot describe it here ({str(e).splitlines()[0][:200]}); "
                          f"install the tpu extra: pip install -e '.[tpu]'") from None
    return topo.devices, HBM_GIB[chip] * GiB


def required_bytes(error: Exception) -> float | None:
    """The bytes an over-HBM program needed, from the TPU compiler's RESOURCE_EXHAUSTED message (else None)."""
    m = re.search(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT])\) exceeds", str(error), re.S)
    return None if m is None else float(m.group(1)) * 1024 ** ("KMGT".index(m.group(2)) + 1)
