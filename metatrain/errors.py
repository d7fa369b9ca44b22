"""The errors metatrain raises for bad input: the command line prints them as one line and exits 2.

Every error a user can fix (a config field, a task, a data source, a work dir, a run that cannot go
on) is a `MetatrainError`, and its message names the field or file and says what to do. Anything else
is a bug, ours or a library's, and keeps its traceback.
"""

from __future__ import annotations


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
