"""Paths a user gives (work dirs, checkpoints, data sources): `~` expanded and made absolute once, where they enter.

Orbax and TFDS resolve some paths themselves and read a relative one differently from the process (Orbax's
`metadata()` of a relative checkpoint dir returns no tree), so every path is absolute before they see it.
URL-style paths (`gs://...`) are left as they are.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import time

# A write the disk refused (a full disk, a quota, a file size limit), and how it is worded (strerror), also inside
# TensorStore's and Arrow's errors, which carry no errno
REFUSED_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
WRITE_REFUSED = ("No space left on device", "Disk quota exceeded", "File too large")


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


def _nearest_existing(folder: str) -> str:
    """`folder`, or the nearest folder above it that exists ("" where none does)."""
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return folder


def unwritable_folder(folder: str) -> str | None:
    """Why `folder` (there or to be made) cannot be written, or None: the nearest path of it or above it that exists
    is a file, or a folder this process cannot write in. A URL-style folder (gs://...) is its store's to refuse."""
    if is_remote(folder):
        return None
    above = _nearest_existing(os.path.abspath(folder))
    if above and not os.path.isdir(above):
        return f"{above} is a file"
    if above and not os.access(above, os.W_OK | os.X_OK):
        return f"{above} is not writable"
    if above:  # what access() allows may still be refused (root in /proc or /sys, an NFS server): try a file there
        try:
            tempfile.TemporaryFile(dir=above).close()
        except OSError as e:
            return f"{above} is not writable ({e.strerror})"
    return None


def output_file(path: str, flag: str) -> str:
    """A file a command will write, checked before any work: absolute, not a directory, in a folder that can be
    made and written; its folder is made."""
    from metatrain.errors import ConfigError

    path = local(path)
    if os.path.isdir(path):
        raise ConfigError(f"{flag}: {path} is a directory; give the path of a file to write")
    blocked = unwritable_folder(os.path.dirname(path))
    if blocked:
        raise ConfigError(f"{flag}: {blocked}, so {path} cannot be written; give another path")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


def image_file(path: str, flag: str) -> str:
    """A figure a command will write (`output_file`), in a format matplotlib writes (from its extension; none: PNG,
    and ".png" is added, as matplotlib does), checked before any work."""
    from matplotlib.backend_bases import FigureCanvasBase

    from metatrain.errors import ConfigError

    path = local(path)
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if not ext:
        path, ext = path + ".png", "png"
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext not in formats:
        raise ConfigError(f"{flag}: {path} ends in .{ext}, which matplotlib does not write; give a .png path (or "
                          f"{', '.join('.' + f for f in sorted(formats) if f != 'png')})")
    return output_file(path, flag)


def _same(a: str, b: str) -> bool:
    a, b = os.path.realpath(a), os.path.realpath(b)
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def output(path: str, flag: str, *, directory: bool = False, inputs=(), overwrite: bool | None = None) -> str:
    """The one rule for what `scores`, `filter`, `data make-noisy`/`make-chat` and `experiment curation` write,
    checked before any work: OUT is refused when it is one of the command's inputs, when a file stands where a
    directory is needed (OUT itself, or a folder above it), when the folder it goes in cannot be written, or when it
    is already there: a file, or a directory holding anything. `overwrite` None: the command has no --overwrite;
    False/True: whether it was given (then an existing file is replaced). Returns OUT absolute; nothing is made yet
    (`staged_file`, `filled_dir` do).

    Args:
      path: OUT as the user gave it.
      flag: how the error names it (e.g. `scores --out`).
      directory: OUT is a directory the command fills (else a file).
      inputs: the paths the command reads.
      overwrite: see above.
    """
    from metatrain.errors import ConfigError

    path = local(path)
    for given in inputs:
        if given and not is_remote(str(given)) and os.path.exists(given) and os.path.exists(path) and _same(
                path, given):
            raise ConfigError(f"{flag}: {path} is one of the command's inputs; give a new path")
    why = unwritable_folder(os.path.dirname(path))
    if why:
        raise ConfigError(f"{flag}: {why}, so {path} cannot be made; give another path")
    if directory and os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag}: {path} is a file; give a new directory")
    if not directory and os.path.isdir(path):
        raise ConfigError(f"{flag}: {path} is a directory; give the path of a file to write")
    there = os.path.isfile(path) or (os.path.isdir(path) and bool(os.listdir(path)))
    if there and not overwrite:
        what = "already exists and is not empty; give a new directory" if directory else \
            "already exists; give a new path"
        raise ConfigError(f"{flag}: {path} {what}{'' if overwrite is None else ', or --overwrite to replace it'}")
    return path


def remove(path: str) -> None:
    """A file or directory gone, if it was there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        with contextlib.suppress(OSError):
            os.remove(path)


def remove_settled(*paths: str, settle: float = 0.2, limit: float = 5.0) -> None:
    """`remove` each path, again until nothing has written any of them for `settle` seconds (at most `limit`): after
    a failed Orbax write, TensorStore's other writes may still be landing in them (and making their folders again)."""
    deadline = time.monotonic() + limit
    while paths:
        for path in paths:
            remove(path)
        time.sleep(settle)
        paths = [path for path in paths if os.path.lexists(path)]
        if time.monotonic() > deadline:
            return


def refused_words(text: str) -> str | None:
    """The words (`WRITE_REFUSED`) in an error's text that say the disk refused a write, else None."""
    return next((why for why in WRITE_REFUSED if why in text), None)


@contextlib.contextmanager
def naming(path: str):
    """A write that fails in the block (a full disk, a quota, a file size limit) is an OSError naming `path`: Python's
    errors for a write to an open file name none, Arrow's and ArrayRecord's only say it in words, so the error line
    could only say "writing a file failed"."""
    worded = lambda e: REFUSED_ERRNOS[WRITE_REFUSED.index(why)] if (why := refused_words(str(e))) else None
    try:
        yield
    except OSError as e:
        if e.filename is None:
            code = e.errno or worded(e)  # Arrow's: "... Detail: [errno 28] No space left on device"
            if code is not None:
                raise OSError(code, os.strerror(code) if code in REFUSED_ERRNOS else e.strerror, path) from e
        raise
    except RuntimeError as e:  # ArrayRecord's (TFDS's writer): 'write() failed: No space left on device; writing ...'
        code = worded(e)
        if code is not None:
            raise OSError(code, os.strerror(code), path) from e
        raise


@contextlib.contextmanager
def staged_file(path: str):
    """Write `path` through `path.tmp`: the block writes the temporary file, which replaces `path` at the end; an
    error or a signal (KeyboardInterrupt) in the block removes it, so nothing half-written is ever left."""
    tmp, first = f"{path}.tmp", first_missing(os.path.dirname(path))
    try:  # from the making of its folders on: a signal at any point takes them away
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with naming(path):  # the file it was for
            yield tmp
        os.replace(tmp, path)
        first = None
    finally:
        remove(tmp)
        if first:  # folders made for it, on the way to an error
            remove(first)


def first_missing(folder: str) -> str | None:
    """The highest folder on the way to `folder` that does not exist yet (None: it exists)."""
    first = None
    while folder and not os.path.exists(folder):
        first, folder = folder, os.path.dirname(folder)
    return first


@contextlib.contextmanager
def filled_dir(path: str):
    """A directory the block fills (made if missing): an error or a signal in the block takes out what the block
    put there (the whole directory when the block made it), so a re-run finds it as it was."""
    first = first_missing(path)
    before = set() if first else set(os.listdir(path))
    try:  # from the making of the folder on: a signal at any point takes it away
        os.makedirs(path, exist_ok=True)
        with naming(path):  # a write to an open file (a full disk): the folder
            yield path
    except BaseException:
        remove_settled(*([first] if first else [os.path.join(path, name) for name in set(os.listdir(path)) - before]))
        raise


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
    blocked = unwritable_folder(path)
    if blocked:  # a file above it, or a folder we cannot write in
        raise ConfigError(f"{flag}: {blocked}, so {path} cannot be made; give another path")
    held = sorted(os.listdir(path)) if os.path.isdir(path) else []
    if held and folder_kind(path) == "run":
        raise ConfigError(f"{flag}: {path} is a run's work dir; give a new directory (e.g. {path}/export)")
    if held and not overwrite:
        raise ConfigError(f"{flag}: {path} already exists and is not empty; give a new directory, or --overwrite "
                          "to replace what an earlier export or import wrote there")
    others = foreign(path) if held else []
    if others:
        raise ConfigError(f"{flag}: {path} holds files metatrain did not write ({', '.join(others[:3])}); give a "
                          "new directory")
    return path


def folder_kind(path: str) -> str | None:
    """What a folder holds, by the files that mark it: "export" (`metatrain export` or `import hf`: export.json),
    "run" (a work dir: config.yaml or checkpoints/), "hf" (a Hugging Face model: config.json and its safetensors),
    "adapters" (PEFT adapters: adapter_config.json), else None."""
    has = lambda name: os.path.exists(os.path.join(path, name))
    if has("export.json"):
        return "export"
    if has("config.yaml") or has("checkpoints"):
        return "run"
    if has("config.json") and (has("model.safetensors") or has("model.safetensors.index.json")):
        return "hf"
    return "adapters" if has("adapter_config.json") else None


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
    """`payload` as JSON at `path` (its folder made if missing), through a temporary file (`staged_file`): an
    interruption or a full disk never leaves half a file, and a failed write names `path`."""
    with staged_file(path) as tmp, open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
