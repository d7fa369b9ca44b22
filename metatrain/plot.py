"""PNG of a run's curves from its metrics.jsonl."""

from __future__ import annotations

import json
import os

import matplotlib

from metatrain.errors import DataError

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_run(workdir: str, out: str | None = None) -> str:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise DataError(f"{workdir} has no metrics.jsonl: is it a metatrain work dir?")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if not rows:
        raise DataError(f"{path} is empty: nothing to plot yet")
    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_grad) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("outer_loss", "-"), ("inner_loss", "--"), ("baseline_outer_loss", ":"),
                       ("baseline_inner_loss", "-.")):
        if key in rows[0]:
            ax_loss.plot(steps, [r[key] for r in rows], style, label=key.replace("_", " "))
    ax_loss.set(xlabel="outer step", ylabel="loss", title="losses")
    ax_loss.legend()
    norm = "meta_grad_norm" if "meta_grad_norm" in rows[0] else "grad_norm"  # pretrain runs: no meta level
    ax_grad.plot(steps, [r[norm] for r in rows])
    ax_grad.set(xlabel="step", ylabel="norm", title=norm.replace("_", " "), yscale="log")
    fig.tight_layout()
    out = out or os.path.join(workdir, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
