"""The command line as Markdown: each command's `--help` as the installed version prints it (the docs' Command line
page, written when the site is built)."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

WIDTH = 100  # the help's line width on the page


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    """argparse wraps help at the terminal's width (COLUMNS, less 2): the same width wherever the page is built."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width + 2)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def _commands(parser: argparse.ArgumentParser, path: list[str]) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    """(the command's words, its parser) for `parser`'s commands and theirs, in the order `--help` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                yield [*path, name], command
                yield from _commands(command, [*path, name])


def _section(level: int, title: str, parser: argparse.ArgumentParser) -> str:
    return f"{'#' * level} `{title}`\n\n```text\n{parser.format_help().rstrip()}\n```\n"


def markdown(width: int = WIDTH) -> str:
    """Every `metatrain` command's help, then the launchers', as Markdown sections.

    Args:
      width: the help text's line width.

    Returns:
      One section per command (`## metatrain train`, `### metatrain bench memory`, ...), each its `--help` in a
        code block.
    """
    from metatrain import cli
    from metatrain.launch import local, tpu

    with _columns(width):
        top = cli.build_parser()
        parts = [_section(2, "metatrain", top)]
        parts += [_section(2 + len(path) - 1, "metatrain " + " ".join(path), command)
                  for path, command in _commands(top, [])]
        parts += [_section(2, parser.prog, parser) for parser in (local.build_parser(), tpu.build_parser())]
    return "\n".join(parts)
