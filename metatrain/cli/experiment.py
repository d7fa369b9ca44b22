"""`metatrain experiment curation`: experiments that answer a question end to end, resumable in one directory."""

from __future__ import annotations

import argparse

from metatrain.cli import common


def _drops(text: str) -> tuple[float, ...]:
    parse = common.fraction("each fraction to drop")
    try:
        return tuple(parse(x) for x in text.split(",") if x.strip())
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def cmd_curation(args) -> int:
    from metatrain import paths
    from metatrain.curation import Experiment
    from metatrain.curation_report import closing_lines

    exp = Experiment(paths.local(args.dir), args.drop, args.scale, args.budget, args.seeds,
                     paths.local(args.data) if args.data else "")
    report = exp.run()
    print(f"report: {exp.dir}/report/report.md, report.json, curves.png "
          f"({report['seconds_this_call'] / 60:.1f} min)")
    for line in closing_lines(report):
        print(line)
    return 0


def register(sub) -> None:
    from metatrain.curation import SCALES

    group = sub.add_parser("experiment", help="end-to-end experiments (resumable in one directory)")
    kinds = group.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    p = kinds.add_parser("curation", help="raters, filters and fresh models at matched tokens: does curation pay?")
    p.add_argument("dir", metavar="DIR", help="the experiment's directory: new, or an earlier one to continue it")
    p.add_argument("--drop", type=_drops, default=None, metavar="LIST",
                   help="the fractions ρ to drop, comma-separated (default: the scale's; tiny and small: "
                        f"{','.join(f'{d:g}' for d in SCALES['tiny'].drops)}, transfer: "
                        f"{','.join(f'{d:g}' for d in SCALES['transfer'].drops)})")
    p.add_argument("--budget", type=common.positive_int, default=0, metavar="TOKENS",
                   help="training tokens per model (default: the scale's)")
    p.add_argument("--scale", choices=sorted(SCALES), default="tiny",
                   help="tiny: every arm at the raters' model; transfer: a target model 4.1x the raters' FLOPs per "
                        "token; small: an accelerator; micro: a smoke test (default tiny)")
    p.add_argument("--seeds", type=common.positive_int, default=0, metavar="N",
                   help="models per arm (default: the scale's)")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="a directory with train.jsonl, trusted.jsonl, heldout.jsonl (default: `metatrain data "
                        "make-noisy`'s corpus, made in DIR/data)")
    p.set_defaults(fn=cmd_curation)
