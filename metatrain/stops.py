"""The signals that stop a command as Ctrl-C does, after it saves or cleans up what it was writing: SIGINT, SIGTERM
(a scheduler, `timeout`, `docker stop`) and SIGHUP (a terminal closed, an ssh connection dropped). Where the program
was started to ignore SIGHUP (`nohup`) or SIGINT (a shell script's background job), it goes on ignoring it."""

from __future__ import annotations

import signal

ALL = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # a stopped command exits 128 + one of them


def signals() -> tuple[signal.Signals, ...]:
    """The stop signals of this process now: SIGTERM, and SIGINT and SIGHUP where they are not ignored."""
    return tuple(s for s in ALL if s == signal.SIGTERM or signal.getsignal(s) != signal.SIG_IGN)
