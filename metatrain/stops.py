"""The signals that stop a command as Ctrl-C does, after it saves or cleans up what it was writing: SIGINT, SIGTERM
(a scheduler, `timeout`, `docker stop`) and SIGHUP (a terminal closed, an ssh connection dropped). Where the program
was started to ignore SIGHUP (`nohup`) or SIGINT (a shell script's background job), it goes on ignoring it."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator

ALL = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # a stopped command exits 128 + one of them


def signals() -> tuple[signal.Signals, ...]:
    """The stop signals of this process now: SIGTERM, and SIGINT and SIGHUP where they are not ignored."""
    return tuple(s for s in ALL if s == signal.SIGTERM or signal.getsignal(s) != signal.SIG_IGN)


@contextlib.contextmanager
def caught(handler: Callable, which: Iterable[signal.Signals] | None = None) -> Iterator[None]:
    """`handler(signum, frame)` for the stop signals while the block runs, the handlers found put back after it.

    Args:
      handler: a Python signal handler.
      which: the signals to catch; default `signals()`, this process's stop signals now.

    Python sets handlers on the main thread only: on another thread (a user's), none is set and the signals keep
    their handlers.
    """
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, handler) for s in (signals() if which is None else which)}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)
