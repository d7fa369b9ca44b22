"""The signals that stop a command as Ctrl-C does, after it saves or cleans up what it was writing: SIGINT, SIGTERM
(a scheduler, `timeout`, `docker stop`) and SIGHUP (a terminal closed, an ssh connection dropped), unless the program
was started to ignore SIGHUP (`nohup`): then it goes on."""

from __future__ import annotations

import signal


def signals() -> tuple[signal.Signals, ...]:
    """The stop signals of this process now: SIGINT, SIGTERM, and SIGHUP where it is not ignored."""
    hup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hup)
