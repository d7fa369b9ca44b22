"""Standard output and error that outlive their reader.

A pipe whose reader ended (`| head`, a `tee` stopped by the same Ctrl-C), a terminal that hung up or a dropped ssh
connection make Python raise at the next write (`BrokenPipeError`, or EIO on a terminal), wherever that write is: in
a progress bar while a run saves its checkpoint, it ended the run and lost the save. Inside `kept`, such a stream is
pointed at /dev/null instead and the command goes on: to its end, or to the stop it was asked for (Ctrl-C, SIGTERM,
SIGHUP save a run's checkpoint and stop it). A lost standard output is said on standard error, while that one has a
reader (a lost standard error is said nowhere: standard output may be a command's product).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
from collections.abc import Iterator


def _terminal(stream) -> bool:
    try:
        return os.isatty(stream.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        return False


class _Kept:
    """A text stream whose writes and flushes never fail for want of a reader: see the module's docstring."""

    def __init__(self, stream, name: str, warn=None):
        self._stream, self._name, self._warn = stream, name, warn
        self._terminal = _terminal(stream)  # asked now: a terminal that hung up is no terminal any more

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._gone(e)
            return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._gone(e)

    def _gone(self, error: OSError) -> None:
        """`error` of a write or flush: where the reader is gone (a pipe's reader ended, EPIPE; a terminal hung up,
        EIO), the stream is discarded; otherwise (a full disk under `> log`, EIO of a file) it is raised, naming the
        stream."""
        if not (error.errno == errno.EPIPE or error.errno == errno.EIO and self._terminal):
            error.filename = error.filename or self._name
            raise error
        self.discard()
        if self._warn:
            self._warn(f"{self._name} has no reader any more ({os.strerror(error.errno)}): the rest of it is discarded")

    def discard(self) -> None:
        """From now on, and what is still buffered: to /dev/null. The descriptor itself is pointed there, so that C
        code's writes (XLA's logs) and the interpreter's last flush at its exit go there too."""
        try:
            fd = self._stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, fd)
            finally:
                os.close(null)
            with contextlib.suppress(OSError):
                self._stream.flush()
        except (OSError, ValueError, io.UnsupportedOperation):  # no descriptor of its own
            self._stream = open(os.devnull, "w")  # noqa: SIM115 — kept for the rest of the process

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def kept(prefix: list[str]) -> Iterator[None]:
    """Inside, `sys.stdout` and `sys.stderr` outlive their readers (see the module's docstring).

    Args:
      prefix: a one-item list, the start of the warning line (`metatrain train`), read when it is said.
    """
    def warn(message: str) -> None:
        sys.stderr.write(f"{prefix[0]}: warning: {message}\n")
        sys.stderr.flush()

    before = sys.stdout, sys.stderr
    sys.stdout = _Kept(sys.stdout, "standard output", warn)
    sys.stderr = _Kept(sys.stderr, "standard error")
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):  # what is still buffered: at the interpreter's exit it could fail
            if isinstance(stream, _Kept):
                try:
                    stream.flush()
                except OSError:  # said already (a full disk): what it holds cannot be written
                    stream.discard()
        sys.stdout, sys.stderr = before
