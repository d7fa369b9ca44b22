"""The `metatrain` command line: meta-training, pretraining, export, gradient checks, benchmarks, data.

Each command group registers its own subcommands (`run`, `check`, `bench`, `data`). A problem with the
user's input (`MetatrainError`: a config field, a task, a data source, a work dir) is printed as one
line naming what to change, with exit code 2; anything else keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except MetatrainError as e:
        print(f"metatrain {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"metatrain {args.command}: interrupted", file=sys.stderr)
        return 130
