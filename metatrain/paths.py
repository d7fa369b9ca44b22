"""Paths a user gives (work dirs, checkpoints, data sources): `~` expanded and made absolute once, where they enter.

Orbax and TFDS resolve some paths themselves and read a relative one differently from the process (Orbax's
`metadata()` of a relative checkpoint dir returns no tree), so every path is absolute before they see it.
URL-style paths (`gs://...`) are left as they are.
"""

from __future__ import annotations

import json
import os


def is_remote(path: str) -> bool:
    """gs://... and other URL-style paths (read and written through etils.epath, as Orbax does)."""
    return "://" in path


def local(path: str | None) -> str | None:
    """`path` with `~` expanded, absolute; empty (or blank), None and URL-style paths unchanged."""
    if not path or not path.strip() or is_remote(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


def prefixed(spec: str | None, prefixes: tuple[str, ...], bare: bool = False) -> str | None:
    """`kind:PATH` with PATH made `local` when `kind:` is one of `prefixes` (e.g. `hf:DIR`, `jsonl:GLOB`); with
    `bare`, a spec with none of them is a path itself (a checkpoint dir beside `hf:DIR`)."""
    for prefix in prefixes:
        if spec and spec.startswith(prefix):
            return prefix + local(spec[len(prefix):])
    return local(spec) if bare else spec


def output_file(path: str, flag: str) -> str:
    """A file a command will write, checked before any work: absolute, not a directory; its folder is made."""
    from metatrain.errors import ConfigError

    path = local(path)
    if os.path.isdir(path):
        raise ConfigError(f"{flag}: {path} is a directory; give the path of a file to write")
    parent = os.path.dirname(path)
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise ConfigError(f"{flag}: {parent} is a file, so {path} cannot be written; give another path")
    os.makedirs(parent, exist_ok=True)
    return path


def output_dir(path: str, flag: str, foreign, overwrite: bool = False, source: tuple[str, str] | None = None) -> str:
    """A directory a command will fill, checked before any work. It must be new or empty; with `overwrite`, it may
    hold what a command of ours wrote there (`foreign(path)`: the names in it that we did not write) and nothing
    else. A file, a run's work dir, the command's own input (`source`: its path and what to call it) or a folder
    with anything else in it is refused: nothing a user wrote is ever replaced."""
    from metatrain.errors import ConfigError

    path = local(path)
    if source is not None and path == local(source[0]):
        raise ConfigError(f"{flag}: {path} is {source[1]} itself; give a new directory")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag}: {path} is a file; give a new directory")
    held = sorted(os.listdir(path)) if os.path.isdir(path) else []
    if {"config.yaml", "checkpoints"} & set(held):
        raise ConfigError(f"{flag}: {path} is a run's work dir; give a new directory (e.g. {path}/export)")
    if held and not overwrite:
        raise ConfigError(f"{flag}: {path} already exists and is not empty; give a new directory, or --overwrite "
                          "to replace what an earlier export or import wrote there")
    others = foreign(path) if held else []
    if others:
        raise ConfigError(f"{flag}: {path} holds files metatrain did not write ({', '.join(others[:3])}); give a "
                          "new directory")
    return path


def read_json(path: str, what: str) -> dict:
    """A JSON object from `path`; a file that is not one is a DataError naming it (`what`: the kind of file)."""
    from metatrain.errors import DataError

    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); is the {what} complete?") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: a {what} holds a JSON object, found {type(value).__name__}")
    return value


def write_json(path: str, payload) -> None:
    """`payload` as JSON at `path`, through a temporary file: an interruption never leaves half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)
