"""Document sources: the built-in corpus, local text files, and indexable sources for Grain.

The built-in corpus is the Python standard library's own source files (no tests): it is on every
machine that runs metatrain, needs no download, and holds ~12 MB (~3M tokens) of real text.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shlex
import sysconfig
from collections.abc import Sequence

from metatrain.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text", ".json", ".html", ".tex", ".csv", ".c", ".h")
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}
# how compressed files start (bzip2: its header, then a block or the end of the stream), their format and the
# command that decompresses them: documents are read as text (JSON lines by byte offset), never decompressed here
COMPRESSED = ((re.compile(rb"\x1f\x8b"), "gzip", "gunzip"), (re.compile(rb"\x28\xb5\x2f\xfd"), "zstd", "unzstd"),
              (re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)"), "bzip2", "bunzip2"),
              (re.compile(rb"\xfd7zXZ\x00"), "xz", "unxz"))
# the byte-order marks of UTF-32 and UTF-16 text (UTF-32 LE's first, it starts as UTF-16 LE's does): such text is
# converted to UTF-8 first (its ASCII would otherwise come with NUL bytes, and JSON lines split inside characters)
WIDE = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
        (b"\xfe\xff", "UTF-16"))


@dataclasses.dataclass
class DecodeStats:
    files: int = 0
    replaced_chars: int = 0  # undecodable bytes, replaced by U+FFFD


def builtin_corpus_files() -> list[str]:
    """The standard library's .py files, sorted (a stable document order on one Python version)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    if not files:
        raise DataError(f"the built-in corpus is empty: no .py files under {root}")
    return files


def expand_paths(paths: Sequence[str]) -> list[str]:
    """Files, folders (walked for text files) and globs → a sorted list of files; clear errors otherwise."""
    out = []
    for p in paths:
        matches = sorted(glob.glob(p, recursive=True)) if any(c in p for c in "*?[") else [p]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise DataError(f"no such file or folder: {p!r}")
        for m in matches:
            if os.path.isdir(m):
                found = [os.path.join(d, f) for d, _, fs in sorted(os.walk(m)) for f in sorted(fs)
                         if f.lower().endswith(TEXT_SUFFIXES)]
                if not found:
                    raise DataError(f"folder {m!r} has no text files (looked for {', '.join(TEXT_SUFFIXES)})")
                out += found
            else:
                out.append(m)
    if not out:
        raise DataError("no input files given")
    return out


def refuse_non_utf8(path: str, where: str) -> None:
    """Raise a DataError naming the format and the command that undoes it, where the file at `path` is compressed
    or UTF-16/UTF-32 text (metatrain reads UTF-8).

    Args:
      path: the file.
      where: what reads it, for the message (`data source jsonl:docs/*.jsonl`).
    """
    with open(path, "rb") as f:
        _refuse_non_utf8_bytes(f.read(10), path, where)


def _refuse_non_utf8_bytes(head: bytes, path: str, where: str) -> None:
    for magic, name, command in COMPRESSED:
        if magic.match(head):
            raise DataError(f"{where}: {path!r} is {name}-compressed; decompress it first ({command} "
                            f"{shlex.quote(path)}): metatrain reads plain text")
    for bom, name in WIDE:
        if head.startswith(bom):
            stem, ext = os.path.splitext(path)
            raise DataError(f"{where}: {path!r} is {name} text (it starts with a byte-order mark); metatrain reads "
                            f"UTF-8: convert it first (iconv -f {name} -t UTF-8 {shlex.quote(path)} > "
                            f"{shlex.quote(stem + '.utf8' + ext)})")


def read_text(path: str, stats: DecodeStats | None = None) -> str:
    """UTF-8 text; undecodable bytes are replaced (and counted in `stats`); compressed files are refused."""
    with open(path, "rb") as f:
        raw = f.read()
    _refuse_non_utf8_bytes(raw, path, "text file")
    text = raw.decode("utf-8", errors="replace")
    if stats is not None:
        stats.files += 1
        stats.replaced_chars += text.count("\ufffd")
    return text


class FileDocuments:
    """A random-access source of documents, one per file, read on demand (Grain `RandomAccessDataSource`)."""

    def __init__(self, files: Sequence[str]):
        self.files = list(files)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> str:
        return read_text(self.files[i])
