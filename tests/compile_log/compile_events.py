"""JAX's compile events of a process, as JSON lines in $METATRAIN_COMPILE_LOG/PID.jsonl: which test (pytest's current
test, inherited by the subprocesses it starts), which command, the event (tracing, lowering, compiling, a persistent
cache hit or miss), its seconds and the function. `report.py` sums them up. Installed before JAX is imported: by
tests/conftest.py in the pytest processes, by sitecustomize.py (this folder on PYTHONPATH) in their subprocesses."""

import importlib.abc
import importlib.util
import json
import os
import sys

EVENTS = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
          "backend_compile_duration": "compile", "cache_hits": "hit", "cache_misses": "miss"}


def _listen(monitoring, folder: str) -> None:
    path = os.path.join(folder, f"{os.getpid()}.jsonl")
    command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200]
    state = {"file": None}

    def write(event, seconds, fun_name=""):
        if event not in EVENTS or state["file"] is False:
            return
        try:  # never fail what is measured (a test's `ulimit -f` stops the log, not the test)
            if state["file"] is None:
                os.makedirs(folder, exist_ok=True)
                state["file"] = open(path, "a", buffering=1)
            test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
            state["file"].write(json.dumps({"test": test, "command": command, "event": EVENTS[event],
                                            "seconds": round(seconds, 4), "function": fun_name}) + "\n")
        except OSError:
            state["file"] = False

    monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: write(event.rsplit("/", 1)[-1], seconds, kw.get("fun_name", "")))
    monitoring.register_event_listener(lambda event, **kw: write(event.rsplit("/", 1)[-1], 0.0))


class _OnImport(importlib.abc.MetaPathFinder):
    """Registers the listeners as `jax._src.monitoring` is imported (importing JAX here would read its settings
    before conftest sets them)."""

    def __init__(self, folder: str):
        self.folder = folder

    def find_spec(self, name, path, target=None):
        if name != "jax._src.monitoring":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _listen(module, self.folder)

        spec.loader.exec_module = exec_module
        return spec


_installed = False


def install() -> None:
    """Log this process's compile events where $METATRAIN_COMPILE_LOG says (nothing when it is unset), once."""
    global _installed
    folder = os.environ.get("METATRAIN_COMPILE_LOG")
    if not folder or _installed:
        return
    _installed = True
    if "jax._src.monitoring" in sys.modules:
        _listen(sys.modules["jax._src.monitoring"], folder)
    else:
        sys.meta_path.insert(0, _OnImport(folder))
