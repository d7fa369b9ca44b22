"""Joining a job: the checks on a partial multi-process start, and the compilation cache turned off on CPU."""

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
