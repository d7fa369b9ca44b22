"""Built-in BLO tasks, and loading a user's task by import path (`package.module:Class`)."""

from __future__ import annotations

import importlib
import inspect
import traceback

from metatrain.errors import MetatrainError
from metatrain.tasks.base import Task, TaskError, batch_mean, validate
from metatrain.tasks.learned_lr import LearnedLR
from metatrain.tasks.loss_weighting import LossWeighting
from metatrain.tasks.maml import MAML

BUILTIN = {"maml": MAML, "learned_lr": LearnedLR, "loss_weighting": LossWeighting}


def task_class(name: str) -> type[Task]:
    """A built-in task name or `package.module:Class` → the task class."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise TaskError(f"unknown task {name!r}: use one of {sorted(BUILTIN)} or an import path "
                        "'package.module:ClassName' to your own Task subclass")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskError(f"task {name!r}: cannot import module {module_name!r} ({e}); "
                        "is it installed or on PYTHONPATH?") from None
    except Exception as e:  # noqa: BLE001 — the user's module failed while importing: name it
        where = next((f"{f.filename}:{f.lineno}" for f in reversed(traceback.extract_tb(e.__traceback__))
                      if f.filename.endswith(module_name.replace(".", "/") + ".py")), module_name)
        why = (str(e).splitlines() or [""])[0][:200]
        raise TaskError(f"task {name!r}: importing module {module_name!r} raised {type(e).__name__} at {where}: "
                        f"{why}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise TaskError(f"task {name!r}: module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TaskError(f"task {name!r}: {attr} is not a subclass of metatrain.tasks.Task")
    return cls


def accepted(cls: type, kwargs: dict) -> dict:
    """The keyword arguments that `cls.__init__` takes (all of them when it takes **kwargs): a task that brings
    its own model may take no model config at all."""
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}


def make_task(name: str, **kwargs) -> Task:
    """Builds a task: `make_task("maml", model=cfg, inner_lr=1e-3)`. A task's `__init__` gets those of the
    arguments it names."""
    cls = task_class(name)
    try:
        task = cls(**accepted(cls, kwargs))
    except MetatrainError:
        raise
    except Exception as e:  # noqa: BLE001 — the user's constructor failed: name the task and the reason
        raise TaskError(f"task {name!r}: {cls.__name__}(...) raised {type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:200]}") from None
    if "name" not in vars(type(task)):  # a subclass that did not name itself is called as it was loaded
        task.name = name
    return task


__all__ = ["BUILTIN", "MAML", "LearnedLR", "LossWeighting", "Task", "TaskError", "batch_mean", "make_task",
           "task_class", "validate"]
