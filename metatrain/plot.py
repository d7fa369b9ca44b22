"""The run report: a PNG of one or more runs from their metrics.jsonl (and eval_weights.json).

Panels, each only where a run has its data: held-out validation loss of the learned run vs the uniform
baseline over steps (the headline; a population's members thin beside their mean); corrupted-vs-clean AUC
over steps; a histogram of the final weights of
clean vs corrupted held-out examples (all examples without flags); training losses, smoothed (EMA) over the
faint raw curve; the (meta-)gradient norm. Several work dirs overlay, named in the legends.
"""

from __future__ import annotations

import json
import os
import sys

import matplotlib
import numpy as np

from metatrain import paths
from metatrain import workdir as workdir_lib
from metatrain.errors import DataError

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _read(workdir: str) -> tuple[list[dict], list[dict], dict | None]:
    """(training rows, evaluation rows, final weights) of a work dir."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise DataError(f"{workdir} has no metrics.jsonl: is it a metatrain work dir?")
    rows = _rows(path)
    if not rows:
        raise DataError(f"{path} is empty: nothing to plot yet")
    weights_path = os.path.join(workdir, "eval_weights.json")
    weights = paths.read_json(weights_path, "run's final weights") if os.path.exists(weights_path) else None
    evals = [r for r in rows if "eval_validation_loss" in r]
    return [r for r in rows if "eval_validation_loss" not in r], evals, weights


def _rows(path: str) -> list[dict]:
    """The rows of a metrics.jsonl. A last line cut off (a run killed mid-write) is skipped with a word on stderr.
    A run resumed from an earlier checkpoint appends the steps after it again: the last row of each step (and
    kind: training or evaluation) is the one kept, in step order."""
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise DataError(f"{path}:{i + 1}: not a JSON line; is this a metatrain metrics file?") from None
            print(f"plot: skipped the last line of {path}, cut off (a run stopped while writing it)", file=sys.stderr)
    last = {("eval_validation_loss" in r, r.get("step")): r for r in rows}
    return sorted(last.values(), key=lambda r: (r.get("step") or 0, "eval_validation_loss" in r))


def ema(values: list[float], decay: float = 0.9) -> np.ndarray:
    """Exponential moving average, bias-corrected so the first points are not pulled to 0."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc = decay * acc + (1 - decay) * v
        out.append(acc / (1 - decay ** (i + 1)))
    return np.asarray(out)


def _series(rows: list[dict], key: str):
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _dot(values) -> dict:
    """A marker for a series of one point, which a line alone leaves invisible (a short run logs its last step only)."""
    return {"marker": "o", "ms": 3} if len(values) == 1 else {}


def _member_keys(rows: list[dict], key: str) -> list[str]:
    """`key/member_i` keys of a population's rows, in member order."""
    found = {k for r in rows for k in r if k.startswith(f"{key}/member_")}
    return sorted(found, key=lambda k: int(k.rsplit("_", 1)[1]))


def plot_runs(workdirs: list[str], out: str | None = None) -> str:
    """Writes the run report of `workdirs` (overlaid) to `out`: a PNG path, or a directory to hold curves.png
    (default: the first work dir). Returns the file written."""
    workdirs = [paths.local(w) for w in workdirs]
    for w in workdirs:  # before --out (the first work dir by default) is checked: a file given as a run
        workdir_lib.require_dir(w)
    out = paths.local(out or workdirs[0])
    out = paths.image_file(os.path.join(out, "curves.png") if os.path.isdir(out) else out, "plot --out")
    runs = {os.path.basename(os.path.normpath(w)) or w: _read(w) for w in workdirs}
    several = len(runs) > 1
    colors = dict(zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    has = lambda key, part=1: any(any(key in r for r in run[part]) for run in runs.values())
    panels = [p for p, ok in (("val", has("eval_validation_loss")), ("auc", has("eval_auc")),
                              ("weights", any(run[2] for run in runs.values())),
                              ("train", True), ("norm", True)) if ok]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4))
    axes = dict(zip(panels, np.atleast_1d(axes)))
    for i, (name, (train, evals, weights)) in enumerate(runs.items()):
        c, tag = colors[name], (f"{name}: " if several else "")
        if "val" in axes:
            ax = axes["val"]
            members = _member_keys(evals, "eval_validation_loss")
            ax.plot(*_series(evals, "eval_validation_loss"), "-o", ms=3, color=c,
                    label=f"{tag}learned" + (f" (mean of {len(members)} members)" if members else ""))
            for k, key in enumerate(members):  # a population: each member, thin
                steps, values = _series(evals, key)
                ax.plot(steps, values, "-", lw=0.8, alpha=0.5, color=c, label=f"{tag}members" if k == 0 else None,
                        **_dot(values))
            if any("eval_baseline_validation_loss" in r for r in evals):
                ax.plot(*_series(evals, "eval_baseline_validation_loss"), "--s", ms=3, color=c, alpha=0.7,
                        label=f"{tag}uniform baseline")
        if "auc" in axes and any("eval_auc" in r for r in evals):
            axes["auc"].plot(*_series(evals, "eval_auc"), "-o", ms=3, color=c, label=name)
        w = np.asarray(weights["weights"], dtype=float) if "weights" in axes and weights else np.zeros(0)
        finite = np.isfinite(w)  # a diverged η: NaN weights, said in the plot rather than drawn
        if len(w) and not finite.any():
            axes["weights"].text(0.5, 0.5 - 0.1 * i, f"{tag}no finite weight (the meta-training diverged)",
                                 ha="center", va="center", color=c, transform=axes["weights"].transAxes)
        elif len(w):
            flags = weights.get("corrupted")
            w, flags = w[finite], None if flags is None else np.asarray(flags)[finite]
            groups = ([("clean", w[flags == 0], "tab:green"), ("corrupted", w[flags == 1], "tab:red")]
                      if flags is not None else [("all examples", w, c)])
            bins = np.linspace(w.min(), w.max() + 1e-9, 30)
            for label, values, color in groups:
                axes["weights"].hist(values, bins=bins, alpha=0.55, color=color if not several else None,
                                     label=f"{tag}{label} (mean {values.mean():.2f})" if len(values) else label)
        ax = axes["train"]
        for key, style in (("outer_loss", "-"), ("baseline_outer_loss", "--"), ("inner_loss", ":"),
                           ("loss", "-")):
            steps, values = _series(train, key)
            if values:
                ax.plot(steps, values, style, color=c, alpha=0.2, lw=0.8)
                ax.plot(steps, ema(values), style, color=c, label=f"{tag}{key.replace('_', ' ')}", **_dot(values))
        for k, key in enumerate(_member_keys(train, "outer_loss")):  # a population: each member's outer loss (EMA)
            steps, values = _series(train, key)
            ax.plot(steps, ema(values), "-", lw=0.6, alpha=0.45, color=c,
                    label=f"{tag}members' outer losses" if k == 0 else None, **_dot(values))
        norm = "meta_grad_norm" if has("meta_grad_norm", 0) else "grad_norm"  # pretrain runs: no meta level
        steps, values = _series(train, norm)
        axes["norm"].plot(steps, values, color=c, label=name, **_dot(values))
    titles = {"val": ("held-out validation loss: learned vs uniform", "outer step", "next-token loss"),
              "auc": ("corrupted vs clean: ROC AUC of the scores", "outer step", "AUC (0.5 = chance)"),
              "weights": ("final weights of held-out examples", "weight α (mean 1 per batch)", "examples"),
              "train": ("training losses (EMA; raw faint)", "step", "loss"),
              "norm": ("meta-gradient norm" if has("meta_grad_norm", 0) else "gradient norm", "step", "norm")}
    for panel, ax in axes.items():
        title, xlabel, ylabel = titles[panel]
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        if panel == "norm":
            ax.set_yscale("log")
        if panel == "auc":
            ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        if ax.get_legend_handles_labels()[0] and (panel not in ("norm", "auc") or several):
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
