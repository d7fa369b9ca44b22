"""Joining a job: the checks on a partial multi-process start, and the compilation cache turned off on CPU."""

import socket

import jax
import pytest

from metatrain import distributed
from metatrain.errors import ConfigError


def test_a_partial_multi_process_start_is_refused():
    with pytest.raises(ConfigError, match="needs all of"):
        distributed.initialize(coordinator="127.0.0.1:1234")
    with pytest.raises(ConfigError, match="not in"):
        distributed.initialize("127.0.0.1:1234", 2, 2)


def test_a_multi_process_cpu_job_compiles_without_the_persistent_cache(monkeypatch):
    """Executables loaded from JAX's persistent cache sometimes run their Gloo collectives in another order on
    each process; a multi-process CPU job turns the cache off, a single process keeps it."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", True)
    try:
        assert distributed._no_cpu_cache() == "" and jax.config.jax_enable_compilation_cache
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        assert distributed._no_cpu_cache() == ", compilation cache off on CPU"
        assert not jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def test_a_coordinator_address_that_cannot_work_is_one_line_before_jax_joins():
    """Each of these crashed the process inside JAX's C++ (an IndexError for no port; a segmentation fault where the
    port was taken; a check failure, after the 300 s wait, where no coordinator answered) instead of one line."""
    with pytest.raises(ConfigError, match=r"'localhost' .* is not HOST:PORT"):
        distributed.initialize("localhost", 2, 0)
    with pytest.raises(ConfigError, match="is not HOST:PORT with a port from 1 to 65535"):
        distributed.initialize("127.0.0.1:99999", 2, 1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} is in use on this machine"):
            distributed.initialize(f"127.0.0.1:{port}", 2, 0)
    # the port is free now: nothing listens there
    with pytest.raises(ConfigError, match=f"no coordinator answered at 127.0.0.1:{port} .* within 1 s"):
        distributed.initialize(f"127.0.0.1:{port}", 2, 1, timeout=1)
    assert not jax.distributed.is_initialized()
