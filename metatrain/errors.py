"""The errors metatrain raises for bad input: the command line prints them as one line and exits 2.

Every error a user can fix (a config field, a task, a data source, a work dir, a run that cannot go
on) is a `MetatrainError`, and its message names the field or file and says what to do. Anything else
is a bug, ours or a library's, and keeps its traceback.
"""

from __future__ import annotations

import warnings


class MetatrainError(Exception):
    """A problem with the user's input or run; the message is one line that says what to change."""


class ConfigError(MetatrainError, ValueError):
    """A bad configuration value or command-line flag; the message names the field."""


class TaskError(MetatrainError, ValueError):
    """A task that cannot be loaded or breaks the task contract; the message names the task."""


class DataError(MetatrainError, ValueError):
    """A data source, dataset or tokenizer that cannot be used; the message names the file or source."""


class TrainingError(MetatrainError, RuntimeError):
    """A run that cannot go on (or cannot start here); the message says why and what is intact."""


class StoppedBySignal(TrainingError):
    """A run stopped by SIGTERM or SIGINT after saving; the message says what was saved and how to continue. The
    `metatrain` command prints it as one line (no "error:") and exits 128 + `signum`, as every stopped command does.

    Args:
      message: what was saved and how to continue.
      signum: the signal's number.
    """

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class RenamedWarning(DeprecationWarning):
    """A name metatrain had before a rename (a config key or value, a flag, a variant token, an argument): it still
    works, for at least one release after the rename, and the warning names the new one. The `metatrain` command
    prints it as one line."""


def renamed(old: str, new: str, stacklevel: int = 2) -> None:
    """Warn (`RenamedWarning`) that `old` is now `new`.

    Args:
      old: the old name, as given (e.g. `mode=default`).
      new: what to write instead.
      stacklevel: as `warnings.warn`'s, counted from the caller of this function.
    """
    warnings.warn(f"{old} is now {new}; the old name still works in this release and will be removed in a later one",
                  RenamedWarning, stacklevel=stacklevel + 1)
