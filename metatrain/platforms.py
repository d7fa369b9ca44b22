"""Keeping JAX to the CPU: at the program's start where libtpu has no TPU (`metatrain.entry`), and for commands that
compile ahead of time for a described TPU or GPU (`metatrain.cli`). Imports nothing heavy."""

from __future__ import annotations

import os
import sys


def backends_started() -> bool:
    """Whether this process's JAX has started its backends (its platforms are chosen then)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def use_cpu() -> None:
    """JAX_PLATFORMS=cpu for this process and the processes it starts, and in JAX's config once JAX is imported
    (where its backends have not started yet)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules and not backends_started():
        sys.modules["jax"].config.update("jax_platforms", "cpu")
