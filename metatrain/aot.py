"""Ahead-of-time helpers: a compiled program's memory, and TPU or NVIDIA GPU devices to compile for without one.

Depends on JAX alone, so the Trainer (mode=auto), `metatrain compile` and the benchmarks can all use
it. A TPU topology comes from libtpu (the `tpu` extra); its compiler refuses a program whose
temporaries pass the chip's HBM with RESOURCE_EXHAUSTED, and `compile_exact` compiles such a program past
the limit to get its exact figures. A GPU topology (`h100`, `h200`, or `h100:8` for eight in one host) comes from
JAX's CUDA plugin (the `cuda` extra), which compiles for a described device without one: XLA's GPU compiler with
the device's figures (`GPUS`) in place of a query; it refuses nothing, and the program fits where its peak is
within the memory JAX's allocator gives a process (`XLA_PYTHON_CLIENT_MEM_FRACTION` of the GPU's, 0.75 unless
set).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import threading

import jax

from metatrain import hostmem
from metatrain.errors import ConfigError, TrainingError

GiB = 2**30
HBM_GIB = {"v4": 32.0, "v5e": 16.0, "v5p": 95.74, "v6e": 32.0}  # per chip
# Generations that gcloud's accelerator types name otherwise (v5litepod-8), by the name libtpu knows
TYPE_GENERATIONS = {"v5litepod": "v5e"}
# NVIDIA GPUs to compile for (CUDA's device properties, which XLA's GPU compiler otherwise queries: SMs, shared
# memory and registers per SM, L2, clock, memory bandwidth and size). The memory: the H100's as CUDA reports it
# (79.1 GiB of 80 GB); the H200's estimated alike, nvidia-smi's 143,771 MiB less the 564 MiB the driver keeps on an
# H100 (139.85 GiB; JAX took 132.8 GiB of the H200 we measured at a memory fraction of 0.95).
_HOPPER = {"core_count": 132, "clock_rate_ghz": 1.98, "l2_cache_size": 50 * 2**20, "shared_memory_per_core": 233472,
           "shared_memory_per_block_optin": 232448, "compute_capability": (9, 0)}
GPUS = {"h100": dict(_HOPPER, name="NVIDIA H100 80GB HBM3", memory_bytes=84_929_347_584, memory_bandwidth=3.35e12),
        "h200": dict(_HOPPER, name="NVIDIA H200", memory_bytes=150_163_357_696, memory_bandwidth=4.8e12)}


def compiled_memory(compiled) -> dict:
    """A compiled program's buffer sizes, its peak and XLA's FLOPs (None where XLA counts none).

    On a TPU the peak is the compiler's own (`peak_memory_in_bytes`): the high-water mark of its buffer
    assignment over the schedule, arguments and outputs included, which is the figure libtpu holds against the
    chip's HBM when it decides whether a program fits. libtpu's `temp_size_in_bytes` counts more than that
    assignment holds (on loops over stacked buffers, up to half as much again), so arguments + outputs - aliased + temp
    overstates the peak there; it is kept as `temp_sum_bytes`. libtpu's `peak_memory_in_bytes` also adds the
    arguments and outputs placed in host memory (e.g. `meta_opt.offload_moments`'s moments), which are not in the HBM:
    they are taken out again (`host_io_bytes`). Elsewhere (CPU) the peak is that sum."""
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    sizes = {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
             "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
             "host_temp_bytes": mem.host_temp_size_in_bytes,  # e.g. offloaded checkpoints; not in the peak
             # arguments and outputs in host memory, each place once (a donated one is its output too)
             "host_io_bytes": (mem.host_argument_size_in_bytes + mem.host_output_size_in_bytes
                               - mem.host_alias_size_in_bytes)}
    total = sizes["argument_bytes"] + sizes["output_bytes"] - sizes["alias_bytes"] + sizes["temp_bytes"]
    peak = mem.peak_memory_in_bytes - sizes["host_io_bytes"] if platform(compiled) == "tpu" else total
    flops = (cost or {}).get("flops")  # None where the compiler reports no cost (a GPU described without one)
    return sizes | {"peak_bytes": peak, "temp_sum_bytes": total, "flops": None if flops is None else float(flops)}


def memory_here(device) -> int | None:
    """The bytes a program may use on `device`: an accelerator's limit (JAX's allocator's `bytes_limit`), or on a CPU
    the host's available memory (`MemAvailable`, within this process's cgroup limit where one is set); None where
    neither is known. CPU devices of one process share it."""
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        return int(stats["bytes_limit"]) if stats.get("bytes_limit") else None
    return hostmem.available()


FIT_FIX = ("use smaller batches (data.batch), shorter sequences (data.seq_len) or a smaller model, or compare settings "
           "that need less with `metatrain bench memory`")


def check_fits(memory: dict, devices, what: str = "the outer step", fix: str = FIT_FIX) -> None:
    """Refuses (one TrainingError line) a compiled program whose peak (`compiled_memory`) passes the memory of the
    devices it runs on here (`memory_here`). On an accelerator each device's peak is held against its limit. On CPU
    the devices of this process share the host's available memory, which the program's arguments (the state, already
    allocated) have taken their share of: what each device's peak holds beyond its arguments, times the devices, is
    held against it. Unknown memory passes. `fix`: what the error tells the user to change."""
    local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
    if not local:
        return
    device, peak = local[0], memory["peak_bytes"]
    shared = device.platform == "cpu"
    need = (peak - memory.get("argument_bytes", 0)) * len(local) if shared else peak
    have = memory_here(device)
    if have is None or need <= have:
        return
    if shared:
        per = f" per device x {len(local)} CPU devices" if len(local) > 1 else ""
        said = (f"needs {hostmem.size(need)} beyond its arguments (in memory already) at its peak "
                f"({hostmem.size(peak)}{per}), more than the {hostmem.size(have)} available on this machine")
    else:
        said = (f"needs {hostmem.size(need)} at its peak, more than the {hostmem.size(have)} of the "
                f"{device.device_kind} JAX may use")
    raise TrainingError(f"{what} {said}; {fix}")


def check_bytes_fit(need: int, what: str, fix: str, detail: str = "", device=None) -> None:
    """Refuses (one ConfigError line: "WHAT SIZE DETAIL, more than ...; FIX") `need` bytes where they pass the memory
    of `device` here (`memory_here`; default JAX's first device), before they are allocated. Unknown memory passes."""
    device = device if device is not None else jax.devices()[0]
    have = memory_here(device)
    if have is not None and need > have:
        where = "available on this machine" if device.platform == "cpu" else f"of the {device.device_kind} JAX may use"
        raise ConfigError(f"{what} {hostmem.size(need)}{detail}, more than the {hostmem.size(have)} {where}; {fix}")


def tree_bytes(tree) -> int:
    """The bytes of a tree's arrays (or `ShapeDtypeStruct`s), all of each."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def state_bytes(shapes, shardings) -> tuple[int, int]:
    """What one device holds of a state with these shapes (`ShapeDtypeStruct`s) and shardings: its bytes in the
    device's memory and in host memory (leaves placed in `pinned_host`), its shard of each leaf (a copy where the
    leaf is replicated)."""
    held = [0, 0]

    def add(shape, sharding):
        n = shape.dtype.itemsize
        for extent in sharding.shard_shape(shape.shape):
            n *= extent
        held[getattr(sharding, "memory_kind", None) == "pinned_host"] += n

    jax.tree.map(add, shapes, shardings)
    return held[0], held[1]


def check_state_fits(shapes, shardings, devices, what: str, fix: str) -> None:
    """Refuses (one ConfigError line) a state that passes the memory here before it is allocated: on CPU what this
    process's devices hold of it together against the host's available memory; on an accelerator a device's share
    against its limit, and the host-placed leaves of this process's devices against the host's memory. It was
    allocated, then the process was killed for memory (or the accelerator's allocator failed deep inside JAX).
    Unknown memory passes. `what`: the state, as the error names it; `fix`: what it tells the user to change."""
    local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
    if not local:
        return
    device, (on_device, on_host) = local[0], state_bytes(shapes, shardings)
    here = "available on this machine"
    if device.platform == "cpu":  # a process's CPU devices share the host's memory
        need = (on_device + on_host) * len(local)
        per = f" ({hostmem.size(need // len(local))} per device x {len(local)} CPU devices)" if len(local) > 1 else ""
        checks = [(need, per, hostmem.available(), here)]
    else:
        checks = [(on_device, " per device", memory_here(device), f"of the {device.device_kind} JAX may use")]
        if on_host:
            checks.append((on_host * len(local), " in host memory", hostmem.available(), here))
    for need, said, have, where in checks:
        if have is not None and need > have:
            raise ConfigError(f"{what} takes {hostmem.size(need)}{said}, more than the {hostmem.size(have)} {where}; "
                              f"{fix}")


@contextlib.contextmanager
def out_of_memory(what: str, fix: str):
    """An allocation the device refuses inside the block (RESOURCE_EXHAUSTED, or XLA:CPU's "Out of memory"): one
    TrainingError line, `what` ran out of memory (the first line of XLA's message); `fix`, not a JaxRuntimeError
    from deep inside JAX. Other errors pass as they are."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        said = str(e)
        if "RESOURCE_EXHAUSTED" not in said and "Out of memory" not in said:
            raise
        first = said.strip().splitlines()[0].strip().rsplit("Error dispatching computation: ", 1)[-1].rstrip(".")
        raise TrainingError(f"{what} ran out of memory ({first}); {fix}") from None


def platform(compiled) -> str:
    """The platform a compiled program is for ("tpu" for an ahead-of-time TPU topology too)."""
    for sharding in jax.tree.leaves(compiled.input_shardings):
        return next(iter(sharding.device_set)).platform
    return jax.default_backend()


def _tpu_chips_here() -> bool:
    """Whether this machine has TPU chips (JAX's own test; where that private API is gone, their device files)."""
    try:
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:  # noqa: BLE001
        return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


@contextlib.contextmanager
def _libtpu_host(chip: str):
    """While libtpu starts, on a machine without TPU chips: a TPU type and host name for it, which it otherwise asks
    the cloud metadata server for, printing the failure as errors (the compiled programs are the same either way).
    Only for that moment: a process this one starts later must not take itself for a TPU VM."""
    given = {k: os.environ.get(k) for k in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")}
    if not _tpu_chips_here():
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{'v5litepod' if chip == 'v5e' else chip}-8")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    try:
        yield
    finally:
        for key, value in given.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def topology_backend(topology: str | None) -> str | None:
    """The backend a `--topology` compiles for: "gpu" (h100, h200[:N]), "tpu" (GENERATION:AxBxC), None (here)."""
    if not topology:
        return None
    return "gpu" if topology.split(":")[0] in GPUS else "tpu"


def _gpu_target_config(spec: dict) -> str:
    """XLA's GPU target config (a text proto) for a described device: what the compiler would query from it."""
    major, minor = spec["compute_capability"]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 threads_per_core_limit: 2048
  shared_memory_per_block: 49152 shared_memory_per_core: {spec["shared_memory_per_core"]}
  shared_memory_per_block_optin: {spec["shared_memory_per_block_optin"]}
  core_count: {spec["core_count"]} fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(spec["memory_bandwidth"])} l2_cache_size: {spec["l2_cache_size"]}
  clock_rate_ghz: {spec["clock_rate_ghz"]} device_memory_size: {spec["memory_bytes"]}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{spec["name"]}"
"""


def gpu_memory_fraction() -> float:
    """The share of a GPU's memory JAX's allocator gives this process (`XLA_PYTHON_CLIENT_MEM_FRACTION`)."""
    raw = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    try:
        fraction = float(raw)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r}: give a number in (0, 1], e.g. 0.95")
    return fraction


def check_topology(topology: str) -> str:
    """`topology` when it is spelled as `--topology` takes it (GENERATION:AxB[xC] of a known TPU generation, sizes
    at least 1; NAME or NAME:COUNT of a known GPU); else a ConfigError saying how to write it. Describing its
    devices (`topology_devices`) may still fail: that needs libtpu or JAX's CUDA plugin."""
    if topology_backend(topology) == "gpu":
        m = re.fullmatch(r"([a-z]\d+)(?::(\d+))?", topology)
        if not m or int(m.group(2) or 1) < 1:
            raise ConfigError(f"--topology {topology!r}: write a GPU as NAME or NAME:COUNT (GPUs in one host), e.g. "
                              f"h100 or h100:8")
        return topology
    m = re.fullmatch(r"(v\d+[a-z]*):(\d+)x(\d+)(?:x(\d+))?", topology)
    if not m and (hint := _accelerator_type_hint(topology)):
        raise ConfigError(f"--topology {topology!r}: {hint}")
    if not m:
        raise ConfigError(f"--topology {topology!r}: write it as GENERATION:AxBxC for a TPU slice, e.g. v5p:2x2x1, "
                          f"or as {' or '.join(sorted(GPUS))} for GPUs (NAME:COUNT for several in one host)")
    chip, dims = m.group(1), [int(d) for d in m.groups()[1:] if d is not None]
    if chip in TYPE_GENERATIONS:
        raise ConfigError(f"--topology {topology!r}: write the generation as {TYPE_GENERATIONS[chip]}, e.g. "
                          f"{TYPE_GENERATIONS[chip]}:{topology.split(':')[1]}")
    if chip not in HBM_GIB:
        raise ConfigError(f"--topology {topology!r}: unknown TPU generation {chip!r}; one of {sorted(HBM_GIB)} (or a "
                          f"GPU: {', '.join(sorted(GPUS))})")
    if min(dims) < 1:
        raise ConfigError(f"--topology {topology!r}: every size must be at least 1 chip, e.g. {chip}:2x2x1")
    return topology


# The default slice shape of a TPU accelerator type (gcloud's `--accelerator-type GEN-N`), by its chips: 3-D for the
# generations that count 2 TensorCores a chip in N (v4, v5p), 2-D for those that count chips (v5e, v6e)
_CUBE_SHAPES = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
                512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_GRID_SHAPES = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


PER_CORE_TYPES = ("v4", "v5p")  # generations whose accelerator types count TensorCores (two per chip), not chips


def accelerator_chips(accelerator_type: str) -> tuple[str, int, str | None] | None:
    """(generation, chips, default shape or None) of a TPU accelerator type as gcloud names it (`v5p-16`: 16
    TensorCores, 8 chips, 2x2x2; `v5litepod-8`: v5e, 8 chips, 2x4); None for another name. JAX has one device per
    chip on each of these generations."""
    m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", accelerator_type)
    chip = m and TYPE_GENERATIONS.get(m.group(1), m.group(1))
    if chip not in HBM_GIB:
        return None
    per_core = chip in PER_CORE_TYPES
    chips = int(m.group(2)) // 2 if per_core else int(m.group(2))
    return chip, chips, (_CUBE_SHAPES if per_core else _GRID_SHAPES).get(chips)


def _accelerator_type_hint(topology: str) -> str | None:
    """What to write instead where `topology` is a TPU accelerator type (`v5p-16`, `v5litepod-8`); else None."""
    found = accelerator_chips(topology)
    if found is None:
        return None
    (chip, chips, shape), n = found, int(topology.rsplit("-", 1)[1])
    per_core = chip in PER_CORE_TYPES
    if shape is None:
        return (f"that looks like an accelerator type; --topology takes the slice's chips as GENERATION:AxB[xC], e.g. "
                f"{chip}:{'2x2x1' if per_core else '2x4'}")
    counted = f"{n} TensorCores, {chips} chips" if per_core else f"{chips} chips"
    return (f"that is an accelerator type ({counted}); --topology takes the slice's chips as GENERATION:AxB[xC], "
            f"e.g. {chip}:{shape}, its default shape (`gcloud compute tpus tpu-vm describe` shows a slice's as "
            f"acceleratorConfig.topology)")


def libtpu_installed() -> bool:
    """Whether this Python finds libtpu (the tpu extra), started or not."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


# The extra that brings each backend's ahead-of-time compiler (neither needs the device).
EXTRAS = {"tpu": "libtpu (it compiles without a TPU): pip install 'metatrain[tpu]'",
          "gpu": "JAX's CUDA plugin (it compiles without a GPU): pip install 'metatrain[cuda]'"}


def check_compiler(backend: str, what: str) -> None:
    """A ConfigError saying which extra to install where this Python lacks the compiler for `backend` ("tpu" or
    "gpu"), which `what` (e.g. "--topology 'h100'") asks for; nothing where it has it, or for "cpu"."""
    have = {"tpu": libtpu_installed, "gpu": cuda_plugin_installed}.get(backend)
    if have is not None and not have():
        raise ConfigError(f"{what}: compiling for a {backend.upper()} needs {EXTRAS[backend]}")


def cuda_plugin_installed() -> bool:
    """Whether this Python finds JAX's CUDA plugin (CUDA 12's or 13's), started or not."""
    import importlib.util

    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def _gpu_devices(topology: str):
    name, _, count = topology.partition(":")
    count = int(count or 1)
    spec, fraction = GPUS[name], gpu_memory_fraction()
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}",
                                            target_config=_gpu_target_config(spec))
    except Exception as e:  # noqa: BLE001 — no CUDA plugin, one that did not start, or one that cannot describe it
        if not isinstance(e, NotImplementedError):
            fix = "compile on the GPU itself (no --topology)"
        elif cuda_plugin_installed():  # it stops at its CUDA checks where no GPU is seen, unless JAX is kept to the CPU
            fix = (f"JAX's CUDA plugin is installed but did not start (JAX_PLATFORMS="
                   f"{os.environ.get('JAX_PLATFORMS', '')!r}); set JAX_PLATFORMS=cpu (compiling ahead of time needs no "
                   f"GPU)")
        else:
            fix = f"install {EXTRAS['gpu']}"
        raise ConfigError(f"--topology {topology!r}: cannot describe it here ({str(e).splitlines()[0][:200]}); "
                          f"{fix}") from None
    return topo.devices, fraction * spec["memory_bytes"]


def topology_devices(topology: str):
    """(TPU devices of e.g. "v5p:2x2x1", or GPUs of e.g. "h100" or "h200:8", for ahead-of-time compilation; the
    memory a program may use per device: the chip's HBM, or the GPU's share JAX gives a process). A TPU needs
    libtpu (the tpu extra), a GPU JAX's CUDA plugin (the cuda extra); neither needs the device."""
    check_topology(topology)
    if topology_backend(topology) == "gpu":
        return _gpu_devices(topology)
    from jax.experimental import topologies

    # AOT compiles touch no chip: let them run beside another JAX process that holds libtpu's lock file
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    chip, shape = topology.split(":")
    dims = tuple(int(d) for d in shape.split("x"))
    per_host = tuple(min(d, b) for d, b in zip(dims, (2, 2, 1))) + (1,) * (3 - len(dims))  # v5e/v6e: 2-D names
    try:
        with _libtpu_host(chip):
            # v4: one device per chip (its two TensorCores as one, "megacore"), as JAX has them on a v4 VM; libtpu's
            # default describes each TensorCore as a device, half a chip's HBM each
            topo = topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                                chip_config_name="megacore" if chip == "v4" else "default",
                                                chips_per_host_bounds=per_host, num_slices=1)
    except Exception as e:  # noqa: BLE001 — no libtpu, or a shape the compiler does not know
        fix = f"install {EXTRAS['tpu']}" if not libtpu_installed() else f"give a slice shape that {chip} comes in"
        raise ConfigError(f"--topology {topology!r}: cannot describe it here ({str(e).splitlines()[0][:200]}); "
                          f"{fix}") from None
    return topo.devices, HBM_GIB[chip] * GiB


# Compiler refusals a user can act on: (a pattern of the compiler's message, what to do).
FIXABLE = ((re.compile(r"CompileTimeScopedVmemOom|scoped vmem", re.I),
            "the TPU compiler ran out of scoped VMEM at libtpu's default limit; set "
            "LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=32768 and run again"),)


def compile(lowered, options: dict | None = None):
    """`lowered.compile(options)`; a refusal in `FIXABLE` is one TrainingError line saying what to set."""
    try:
        return _wait_for_compile(lambda: lowered.compile(compiler_options=options))
    except Exception as e:  # noqa: BLE001 — re-raised unless it is a refusal we can explain
        for pattern, fix in FIXABLE:
            if pattern.search(str(e)):
                raise TrainingError(f"compiling the outer step: {fix} (the compiler said: "
                                    f"{str(e).strip().splitlines()[0][:200]})") from None
        raise


def _wait_for_compile(compile_fn):
    """`compile_fn()` on a thread of its own while the main thread waits in Python, so that a stop signal's handler
    runs during a compile of minutes, not after it: the command line then says that it stops once the compile
    returns, and a second stop ends it at once (`metatrain.cli`). A KeyboardInterrupt raised while waiting is raised
    once the compile has returned: cut there, the compile went on in XLA's threads while the interpreter shut down,
    and crashed it. Off the main thread, where no handler runs, `compile_fn()` itself."""
    if threading.current_thread() is not threading.main_thread():
        return compile_fn()
    done: dict = {}

    def run():
        try:
            done["value"] = compile_fn()
        except BaseException as e:  # noqa: BLE001 — handed to the waiting thread, raised there
            done["error"] = e

    worker = threading.Thread(target=run, name="metatrain-compile", daemon=True)
    worker.start()
    interrupted = None
    while worker.is_alive():
        try:
            worker.join(0.05)
        except KeyboardInterrupt as e:
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted
    if "error" in done:
        raise done["error"]
    return done["value"]


def compile_exact(lowered, tpu: bool, options: dict | None = None):
    """`lowered.compile()`, and for a TPU program the compiler refuses for HBM, the same program compiled past the
    limit: (compiled, the bytes the refusal asked for or None, its message or None).

    The refusal's figure is an early estimate (libtpu aborts a program "unlikely to fit" before assigning buffers)
    and counts other things than the compiled program's peak, so it is neither the peak nor a bound. libtpu's
    `xla_tpu_no_crash_on_oom` lets the compiler finish the buffer assignment anyway: its `memory_analysis()` is
    then exact. A program that fits compiles to the same figures with and without the option (tested). Where
    that compile fails too (v5e: "Invalid TPU program"), compiled is None."""
    try:
        return compile(lowered, options), None, None
    except Exception as e:  # noqa: BLE001 — only the TPU compiler's out-of-memory refusal is retried
        need = required_bytes(e) if tpu else None
        if need is None:
            raise
        message = str(e).splitlines()[0][:300]
    try:
        return compile(lowered, (options or {}) | PAST_HBM), need, message
    except Exception:  # noqa: BLE001
        return None, need, message


PAST_HBM = {"xla_tpu_no_crash_on_oom": True}  # libtpu: finish compiling a program over HBM (ahead of time only)


def required_bytes(error: Exception) -> float | None:
    """The bytes an over-HBM program needed, from the TPU compiler's RESOURCE_EXHAUSTED message (else None)."""
    m = re.search(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT])\) exceeds available HBM", str(error), re.S)
    return None if m is None else float(m.group(1)) * 1024 ** ("KMGT".index(m.group(2)) + 1)
