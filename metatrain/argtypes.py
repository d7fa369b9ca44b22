"""argparse types for numbers in a range and for text that must not be empty, shared by the `metatrain` commands
and the launchers.

Standard library only: the launchers (`python -m metatrain.launch.local`) parse their flags without importing JAX.
Each raises `argparse.ArgumentTypeError`, which argparse prints as one line naming the flag.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

# The largest whole number a command or a config key takes: JAX computes in 32-bit integers (x64 off), and a size,
# count or seed past that overflows far from where it was given (in a compiled program, numpy or Grain)
MAX_INT = 2**31 - 1
TOO_LARGE = f"at most {MAX_INT} (a 32-bit integer)"


def number(kind, low: float, high: float, what: str, above: str | None = None):
    """An argparse type: a `kind` (int or float) in [low, high].

    Args:
      kind: `int` or `float`.
      low: the smallest value allowed.
      high: the largest value allowed (`math.inf`: no bound).
      what: the range in words, for the error ("must be {what}, got ...").
      above: the error's words for a value above `high` (default: `what`).

    Returns:
      A function from the flag's text to its value.
    """
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' * (kind is int)}number") from None
        if not low <= value <= high:  # (NaN is in no range)
            raise argparse.ArgumentTypeError(f"must be {above if above and value > high else what}, got {text}")
        return value

    return parse


positive_int = number(int, 1, MAX_INT, ">= 1", above=TOO_LARGE)
nonnegative_int = number(int, 0, MAX_INT, ">= 0", above=TOO_LARGE)


def mesh_size(text: str) -> int:
    """An argparse type: a mesh axis size, -1 (all the devices) or a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value != -1 and value < 1:
        raise argparse.ArgumentTypeError(f"must be -1 (all the devices) or >= 1, got {text}")
    if value > MAX_INT:
        raise argparse.ArgumentTypeError(f"must be {TOO_LARGE}, got {text}")
    return value


def positive_ints(text: str) -> list[int]:
    """An argparse type: a comma list of whole numbers >= 1, e.g. "2,8"."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma list of whole numbers, e.g. 2,8; got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be whole numbers >= 1, got {text}")
    if max(values) > MAX_INT:
        raise argparse.ArgumentTypeError(f"must be whole numbers {TOO_LARGE}, got {text}")
    return values


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0 (a tolerance, a step)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def fraction(what: str, zero: bool = False):
    """An argparse type: a number in (0, 1), or [0, 1) with `zero`; the error names `what`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ((0 <= value) if zero else (0 < value)) or not value < 1:
            raise argparse.ArgumentTypeError(f"{what} must be in {'[' if zero else '('}0, 1), got {value}")
        return value

    return parse


def given(action: argparse.Action, required: bool = False):
    """An argparse type for `action`'s text: refused when empty (an unset shell variable leaves '', which would
    otherwise stand for the argument's default, or for a path named ''), else as it is. `required`: the flag is one
    of a required group (a flag of the group must be given)."""
    if action.option_strings and not (action.required or required):
        fix = f"give one, or leave out {action.option_strings[0]} for its default"
    elif action.nargs in ("*", "?"):
        fix = "give one, or leave it out"
    else:
        fix = "give one"

    def parse(text: str) -> str:
        if text == "":
            raise argparse.ArgumentTypeError(f"empty (as an unset shell variable leaves it); {fix}")
        return text

    return parse


def refuse_empty(parser: argparse.ArgumentParser) -> None:
    """Gives every text argument of `parser` the type `given`: those without a type of its own, and paths
    (`type=Path`: `Path('')` is the current folder). Not those with choices, which name what they take (subcommands
    included), nor those whose default is '' already."""
    grouped = {a for g in parser._mutually_exclusive_groups if g.required for a in g._group_actions}
    for action in parser._actions:
        if (action.type in (None, Path) and action.nargs not in (0, argparse.REMAINDER) and not action.choices
                and action.default != ""):
            check = given(action, action in grouped)
            action.type = check if action.type is None else lambda text, check=check: Path(check(text))
