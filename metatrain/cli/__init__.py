"""The `metatrain` command line: meta-training, pretraining, export, gradient checks, benchmarks, data.

Each command group registers its own subcommands (`run`, `check`, `bench`, `data`). A problem with the
user's input (`MetatrainError`: a config field, a task, a data source, a work dir) is printed as one
line naming what to change, with exit code 2; anything else keeps its traceback. SIGTERM (a scheduler,
`timeout`, `docker stop`) stops a command as Ctrl-C does: what it was writing is cleaned up, and it exits 128 +
the signal's number.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from metatrain.cli import bench, check, data, experiment, generate, run
from metatrain.errors import MetatrainError

GROUPS = (run, check, bench, data, experiment, generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metatrain", description=__doc__.split("\n\n")[0],
                                     epilog="`metatrain COMMAND --help` for each command's flags; see README.md")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised where the program is (as SIGINT raises KeyboardInterrupt), so that the same clean-up runs."""

    signum = signal.SIGTERM


def _stop(signum, _frame):
    raise Stopped()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    handled = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if handled:
        signal.signal(signal.SIGTERM, _stop)
    try:
        return args.fn(args)
    except MetatrainError as e:
        print(f"metatrain {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"metatrain {args.command}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    finally:
        if handled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
