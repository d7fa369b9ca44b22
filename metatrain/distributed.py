"""Joining a multi-host job: every process runs the same program and JAX's multi-controller runtime
connects them. Call `initialize` before anything touches a device.

- explicit: `--coordinator HOST:PORT --num-processes N --process-id I` (or the environment variables
  METATRAIN_COORDINATOR, METATRAIN_NUM_PROCESSES, METATRAIN_PROCESS_ID, which the local launcher sets);
- detected: on a TPU VM slice or under SLURM (or with METATRAIN_DISTRIBUTED=auto, which the TPU
  launcher sets), `jax.distributed.initialize()` finds its peers itself;
- otherwise (a plain single process) nothing is done.

A process that stops sending heartbeats for `heartbeat_timeout` seconds is declared dead by the
coordinator and the others are stopped with an error, so a crash never leaves a job hanging.

On CPU (XLA's Gloo collectives: the local launcher, tests) a multi-process job compiles every program itself:
JAX's persistent compilation cache is turned off there, because programs loaded from it sometimes run their
collectives in a different order on each process (Gloo then stops the job: "Received data size doesn't match
expected size"), where freshly compiled ones agree.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import threading
import time

from metatrain.errors import ConfigError

ENV = {"coordinator": "METATRAIN_COORDINATOR", "num_processes": "METATRAIN_NUM_PROCESSES",
       "process_id": "METATRAIN_PROCESS_ID"}
SINGLE = "single process"  # what `initialize` says when it joined nothing


def _detected() -> str | None:
    """The cluster JAX can join on its own, if this process runs inside one."""
    if os.environ.get("METATRAIN_DISTRIBUTED") == "auto":  # set by launch.tpu on every worker
        return "auto-detected by JAX"
    try:  # JAX's own detectors (TPU VMs through the metadata server, SLURM, Open MPI, Kubernetes)
        from jax._src import clusters

        for env in clusters.ClusterEnv._cluster_types:
            if env.__name__ != "Mpi4pyCluster" and env.is_env_present():
                return env.__name__
    except Exception:  # a private API: fall back to the environment variables below
        pass
    if os.environ.get("TPU_WORKER_HOSTNAMES") and "," in os.environ["TPU_WORKER_HOSTNAMES"]:
        return "a TPU VM slice"
    if os.environ.get("TPU_ACCELERATOR_TYPE") and os.environ.get("TPU_WORKER_ID"):
        return "a TPU VM"
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return "SLURM"
    return None


_notices: list[bool] = [True]  # whether JAX's preemption notifier kept SIGTERM when this process joined its job


def agrees_on_stops() -> bool:
    """Whether this process is one of several whose stop step is agreed through JAX's preemption service
    (`multihost_utils.reached_preemption_sync_point`): its notifier takes SIGTERM, from the joining of the job on
    (unless `initialize` gave SIGTERM back to the program)."""
    import jax

    return _notices[0] and jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               heartbeat_timeout: int = 60, timeout: int = 300, preemption_notices: bool = True) -> str:
    """Join the job this process belongs to; returns a line saying what was done.

    Joining a job of several processes gives SIGTERM to JAX's preemption notifier, which only records it. With
    `preemption_notices` (the default, as JAX has it) it keeps it: the Trainer's steps ask it when to stop
    (`agrees_on_stops`). Without, SIGTERM goes back to the handler this program had, so that a command that is no
    training loop (`filter`) stops as it does alone; under the notifier it ran on to its end."""
    import jax

    before = signal.getsignal(signal.SIGTERM)
    try:
        return _join(jax, coordinator, num_processes, process_id, heartbeat_timeout, timeout)
    finally:
        if (not preemption_notices and before is not None and jax.distributed.is_initialized()
                and threading.current_thread() is threading.main_thread()):
            signal.signal(signal.SIGTERM, before)
            _notices[0] = False


def _join(jax, coordinator, num_processes, process_id, heartbeat_timeout, timeout) -> str:
    coordinator = coordinator or os.environ.get(ENV["coordinator"])
    num_processes = num_processes if num_processes is not None else _env_int("num_processes")
    process_id = process_id if process_id is not None else _env_int("process_id")
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ConfigError("a multi-process start needs all of --coordinator HOST:PORT, --num-processes N and "
                         "--process-id I (or METATRAIN_COORDINATOR, METATRAIN_NUM_PROCESSES, METATRAIN_PROCESS_ID)")
    if all(given):
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"--process-id {process_id} is not in [0, {num_processes})")
        if num_processes == 1:
            return SINGLE
        # checked first: where JAX's coordinator cannot listen, or no coordinator answers in time, the process
        # crashes in C++ (a segmentation fault, a check failure) instead of raising
        address = _address(coordinator)
        if process_id:
            _wait_for_coordinator(coordinator, address, timeout)
        else:
            _check_port_free(coordinator, address[1])
        jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=timeout,
                                   heartbeat_timeout_seconds=heartbeat_timeout)
        return f"process {process_id} of {num_processes} (coordinator {coordinator})" + _no_cpu_cache()
    where = _detected()
    if where is None:
        return SINGLE
    jax.distributed.initialize(initialization_timeout=timeout, heartbeat_timeout_seconds=heartbeat_timeout)
    return f"process {jax.process_index()} of {jax.process_count()} ({where})" + _no_cpu_cache()


def _address(text: str, what: str = "the coordinator", where: str = "--coordinator, METATRAIN_COORDINATOR"
             ) -> tuple[str, int]:
    """(host, port) of an address HOST:PORT ([IPv6]:PORT), or a ConfigError naming it (`what`, given as `where`)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} {text!r} ({where}) is not HOST:PORT with a port from 1 to 65535, e.g. "
                          f"10.0.0.2:8476")
    return host.strip("[]"), int(port)


def _check_port_free(coordinator: str, port: int) -> None:
    """A ConfigError where the coordinator's port is taken on this machine (JAX's service listens on every address:
    `[::]:PORT`, or JAX_COORDINATOR_BIND_ADDRESS)."""
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", f"[::]:{port}")
    host, port = _address(bind, "the address JAX's coordinator listens on", "JAX_COORDINATOR_BIND_ADDRESS")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: a closed job's port is free
            s.bind((host, port))
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            return  # no IPv6 here, say: JAX finds its own way
        raise ConfigError(f"the coordinator {coordinator} (--coordinator, METATRAIN_COORDINATOR): port {port} is in "
                          f"use on this machine (another job's coordinator, another program); give a free port") \
            from None


def _wait_for_coordinator(coordinator: str, address: tuple[str, int], timeout: int) -> None:
    """Wait until the coordinator's port takes connections, at most `timeout` seconds; a ConfigError after."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(address, timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(f"no coordinator answered at {coordinator} (--coordinator, METATRAIN_COORDINATOR) "
                                  f"within {timeout} s ({e.strerror or e}): start process 0 with the same address, "
                                  f"or check its host and port") from None
            time.sleep(0.5)


def _no_cpu_cache() -> str:
    """Turn JAX's persistent compilation cache off in a multi-process CPU job (see the module docstring); the
    words to add to the line `initialize` returns."""
    import jax

    if jax.process_count() == 1 or jax.default_backend() != "cpu" or not jax.config.jax_enable_compilation_cache:
        return ""
    jax.config.update("jax_enable_compilation_cache", False)
    return ", compilation cache off on CPU"


def barrier(name: str, timeout: int = 1800) -> None:
    """Wait until every process of a multi-process job has reached `name` (nothing in a single process).

    The coordination service's barrier, not a device collective: the first collective over a set of CPU devices
    sets up XLA:CPU's Gloo context, which gives up after 30 s if a peer is not there yet. Called after work whose
    length differs between processes (compiling the outer step), it lets them reach the next collective together.
    A peer that dies meanwhile is still caught by the heartbeat timeout."""
    import jax

    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed  # the client that jax.distributed.initialize made

    client = jax_distributed.global_state.client
    if client is not None:
        client.wait_at_barrier(f"metatrain:{name}", timeout * 1000)


def _env_int(name: str) -> int | None:
    value = os.environ.get(ENV[name])
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{ENV[name]}={value!r} is not an integer") from None
