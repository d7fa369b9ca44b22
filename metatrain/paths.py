"""Paths a user gives (work dirs, checkpoints, data sources): `~` expanded and made absolute once, where they enter.

Orbax and TFDS resolve some paths themselves and read a relative one differently from the process (Orbax's
`metadata()` of a relative checkpoint dir returns no tree), so every path is absolute before they see it.
URL-style paths (`gs://...`) are left as they are.
"""

from __future__ import annotations

import os


def is_remote(path: str) -> bool:
    """gs://... and other URL-style paths (read and written through etils.epath, as Orbax does)."""
    return "://" in path


def local(path: str | None) -> str | None:
    """`path` with `~` expanded, absolute; empty, None and URL-style paths unchanged."""
    if not path or is_remote(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


def prefixed(spec: str | None, prefixes: tuple[str, ...], bare: bool = False) -> str | None:
    """`kind:PATH` with PATH made `local` when `kind:` is one of `prefixes` (e.g. `hf:DIR`, `jsonl:GLOB`); with
    `bare`, a spec with none of them is a path itself (a checkpoint dir beside `hf:DIR`)."""
    for prefix in prefixes:
        if spec and spec.startswith(prefix):
            return prefix + local(spec[len(prefix):])
    return local(spec) if bare else spec
