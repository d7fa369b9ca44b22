"""Progress bars on stderr: redrawn on a terminal; in a log file (a scheduler's output, `2> log`), a line every 30 s."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def bar(total: float | None, desc: str, initial: float = 0, disable: bool = False, **options: Any) -> tqdm:
    """A tqdm bar on stderr: on a terminal redrawn ten times a second; elsewhere one line per update, every 30 s.

    Args:
      total: the count (or bytes) to reach.
      desc: the bar's name.
      initial: where it starts (a resumed run's step).
      disable: no bar at all.
      **options: more of tqdm's options (`unit`, `unit_scale`).

    Returns:
      The bar (a context manager).
    """
    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, disable=disable, file=sys.stderr if tty else _Lines(),
                mininterval=0.1 if tty else 30.0, ascii=not tty, **(_size() if tty else {}), **options)


def _size() -> dict:
    """tqdm's size options on the terminal of stderr: its width, followed as it changes; a terminal nobody sized
    (`pty.fork`, some containers' exec) reads 0 x 0, for which tqdm showed nothing at all: 80 x 24 there."""
    try:
        sized = min(os.get_terminal_size(sys.stderr.fileno())) > 0
    except (OSError, ValueError, AttributeError):
        sized = False
    return {"dynamic_ncols": True} if sized else {"ncols": 80, "nrows": 24}


def over(items: Iterable[T], desc: str = "") -> Iterator[T]:
    """`items` with a bar on a terminal that goes when they are done; nothing shown elsewhere."""
    tty = sys.stderr.isatty()
    return iter(tqdm(items, desc=desc, file=sys.stderr, leave=False, disable=not tty, **(_size() if tty else {})))


def lines(items: Iterable[T], desc: str = "") -> Iterator[T]:
    """`items` with a bar on a terminal; elsewhere (logs, CI) a line before each item, `desc i/n ...`, so that each of
    a few long items (compiles) shows."""
    if sys.stderr.isatty():
        yield from over(items, desc)
        return
    items = list(items)
    for i, item in enumerate(items):
        print(f"{desc} {i + 1}/{len(items)} ...", file=sys.stderr, flush=True)
        yield item


class _Lines:
    """stderr for a bar in a log file: each of tqdm's updates, which redraw the line after a carriage return, as a line
    of its own (a log read with `tail -f`, `grep` or a scheduler's viewer otherwise holds all the updates on one
    line)."""

    encoding = "utf-8"

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()  # tqdm pads an update with spaces over the longer one before it
        if line:
            sys.stderr.write(line + "\n")

    def flush(self) -> None:
        sys.stderr.flush()
