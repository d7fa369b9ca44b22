"""What the command groups share: the problem flags (task, model, shapes), progress, JSON output."""

from __future__ import annotations

import argparse
import json
import os

from metatrain.argtypes import fraction, nonnegative_int, positive_float, positive_int, positive_ints  # noqa: F401 (the commands' types)
from metatrain.errors import renamed
from metatrain.models import LADDER, PRETRAINED_SHAPES, SMALL_PRESETS
from metatrain.tasks import BUILTIN
from metatrain.unroll import KEPT_STATES

MODEL_FLAGS = {"d_model": "--d-model", "n_heads": "--n-heads", "d_ff": "--d-ff", "vocab_size": "--vocab",
               "n_layers": "--n-layers"}
TASK_HELP = " | ".join(BUILTIN) + " | package.module:Class"


def write_json(path, payload, quiet: bool = False) -> None:
    """Writes `payload` to `path` (nothing without a path) through a temporary file, so an interruption never
    leaves half a file."""
    if path:
        from metatrain import paths

        paths.write_json(path, payload)
        if not quiet:
            print(f"wrote {path}")


def read_rows(path) -> list[dict]:
    """The rows of a `bench … --json` file (a list, or {"rows": [...]}); none when there is no file yet."""
    from metatrain.errors import ConfigError

    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            payload = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--resume: cannot read {path} ({e}); move it away or drop --resume") from None
    rows = payload.get("rows") if isinstance(payload, dict) else payload
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"--resume: {path} is not a list of rows written by `bench memory --json`; move it away "
                          "or drop --resume")
    from metatrain.bench.variants import upgrade_row

    return [upgrade_row(r) for r in rows]


def add_problem_args(p: argparse.ArgumentParser, model: str | None, seq_len: int | None, batch: int | None,
                     inner_steps: int | None, model_flags: bool = True, task: str | None = "maml",
                     kept_states: str | None = "every_step") -> None:
    """The problem's flags (task, model, batch shapes, model options) with these defaults; None: given or not is
    told apart (`compile --config` refuses them), the command sets the value."""
    p.add_argument("--task", default=task, help=TASK_HELP)
    if model_flags:
        p.add_argument("--model", default=model, help=f"a preset: {', '.join(SMALL_PRESETS)}, a ladder size "
                                                      f"({', '.join(LADDER)}), or a pretrained model's shape "
                                                      f"({', '.join(PRETRAINED_SHAPES)})")
        for field, flag in MODEL_FLAGS.items():
            p.add_argument(flag, dest=field, type=positive_int, default=None, help=f"override the preset's {field}")
    add_model_option_args(p, kept_states)
    p.add_argument("--seq-len", type=positive_int, default=seq_len)
    p.add_argument("--batch", type=positive_int, default=batch)
    p.add_argument("--inner-steps", type=positive_int, default=inner_steps)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def add_model_option_args(p: argparse.ArgumentParser, kept_states: str | None = "every_step") -> None:
    p.add_argument("--attention", choices=["dense", "blockwise"], default=None,
                   help="override the preset's (a variant's +blockwise wins)")
    p.add_argument("--attention-block", type=positive_int, default=None, help="block size of blockwise attention")
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default=None,
                   help="matmuls and activations (parameters, optimizer states, softmax and losses stay float32); "
                        "a variant's +bf16 wins")
    p.add_argument("--no-scan-layers", action="store_true",
                   help="the blocks as straight-line code, not a loop (model.scan_layers=false, as the main job)")
    p.add_argument("--kept-states", choices=KEPT_STATES, default=kept_states,
                   help="inner states kept for the backward pass (a variant's +sqrt / +binomial wins)")
    p.add_argument("--inner-checkpoint", dest="kept_states", choices=KEPT_STATES, help=argparse.SUPPRESS,
                   type=lambda v: renamed("--inner-checkpoint", "--kept-states") or v)  # its name until a rename


def model_options(args) -> dict:
    """Model options that apply to any preset (ladder grids included)."""
    options = {f: getattr(args, f) for f in ("attention", "attention_block", "compute_dtype")
               if getattr(args, f, None) is not None}
    return options | ({"scan_layers": False} if getattr(args, "no_scan_layers", False) else {})


def model(args, **extra):
    from metatrain import models

    overrides = {f: getattr(args, f) for f in MODEL_FLAGS if getattr(args, f) is not None}
    return models.preset(args.model, **overrides, **model_options(args), **extra)


def data_shapes(args):
    """The batch shapes of the problem flags as the data config that carries them."""
    from metatrain.data.pipeline import DataConfig

    return DataConfig(seq_len=args.seq_len, batch=args.batch, inner_steps=args.inner_steps)


def variants(args, names: str, baseline: str | None = None) -> list:
    """The comma-listed variants (with --kept-states unless a name says +sqrt/+binomial), `baseline` first
    when given and not among them."""
    from metatrain.bench.variants import parse_variant

    chosen = [parse_variant(v, args.kept_states) for v in names.split(",")]
    if baseline and baseline not in {v.name for v in chosen}:
        chosen.insert(0, parse_variant(baseline))
    return chosen
