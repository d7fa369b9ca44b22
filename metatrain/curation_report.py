"""The curation experiment's report: tables (JSON and Markdown), NLL curves (PNG), the per-defect table.

Compute gain of an arm: its mean NLL curve over seeds (linear between evaluations) reaches the unfiltered arm's
final mean NLL after `tokens` training tokens; gross = 1 − tokens / budget, net = 1 − (tokens + cost) / budget,
where cost is what choosing the arm's data took in training-token equivalents (FLOPs / a pretraining step's FLOPs
per token): the rater's meta-training and scoring, or the proxy model's training (one unfiltered arm) and scoring
for the perplexity filters; nothing for random drop and the oracle. An arm that never reaches it within the budget
has no gain to state (NaN).
"""

from __future__ import annotations

import glob
import math
import os

import numpy as np

from metatrain.paths import read_json, write_json

METHODS = ("unfiltered", "rater", "random", "ppl_low", "ppl_mid", "ppl_high", "oracle")  # the experiment's arms


def arm_name(method: str, drop: float | None) -> str:
    """An arm's name: its method, and the share of the pool it drops (`rater_0.25`)."""
    return method if drop is None else f"{method}_{drop:g}"


def tokens_to_reach(tokens: np.ndarray, nll: np.ndarray, target: float) -> float:
    """The first point where the curve (linear between points, from its first) reaches `target`; NaN if never."""
    for i in range(len(nll)):
        if nll[i] <= target:
            if i == 0:
                return float(tokens[0])
            t0, t1, y0, y1 = tokens[i - 1], tokens[i], nll[i - 1], nll[i]
            return float(t0 + (t1 - t0) * (y0 - target) / (y0 - y1))
    return math.nan


def _arms(directory: str) -> dict[tuple[str, float | None], list[dict]]:
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(directory, "arms", "*", "result.json"))):
        r = read_json(path, "arm result")
        out.setdefault((r["method"], r["drop"]), []).append(r)
    return out


def write(exp, rater: np.ndarray, seconds: float) -> dict:
    """Compute the report of a finished experiment `exp` (`curation.Experiment`), write DIR/report/ and return it
    (`seconds`: what this call of the experiment took up to the report)."""
    s = exp.scale
    out_dir = os.path.join(exp.dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    arms = _arms(exp.dir)
    per_token = exp.flops["pretrain_step"] / s.tokens_per_step
    budget = exp.steps * s.tokens_per_step
    cost = {"rater": (exp.flops["rater_training"] + exp.flops["rater_scoring"]) / per_token,
            "ppl": budget + exp.flops["proxy_scoring"] / per_token}
    curves, rows = {}, []
    unfiltered = arms[("unfiltered", None)]
    target = float(np.mean([r["curve"][-1][1] for r in unfiltered]))
    for (method, drop), runs in sorted(arms.items(), key=lambda kv: (METHODS.index(kv[0][0]), kv[0][1] or 0)):
        steps = np.asarray([p[0] for p in runs[0]["curve"]])
        nll = np.asarray([[p[1] for p in r["curve"]] for r in runs])  # [seeds, evaluations]
        tokens = steps * s.tokens_per_step
        mean = nll.mean(0)
        reach = budget if method == "unfiltered" else tokens_to_reach(tokens, mean, target)
        spent = cost["rater"] if method == "rater" else cost["ppl"] if method.startswith("ppl_") else 0.0
        finals = nll[:, -1]
        rho = drop if drop is not None else (0.0 if method == "unfiltered" else 1 - runs[0]["kept"] / runs[0]["of"])
        rows.append({"method": method, "drop": rho, "kept": runs[0]["kept"], "of": runs[0]["of"],
                     "nll": float(finals.mean()), "nll_seeds": finals.tolist(),
                     "tokens_to_match": reach, "gross_gain": 1 - reach / budget,
                     "cost_tokens": spent, "net_gain": 1 - (reach + spent) / budget})
        curves[arm_name(method, drop)] = {"tokens": tokens.tolist(), "nll_mean": mean.tolist(),
                                          "nll_seeds": nll.tolist()}
    report = {"settings": exp.settings, "scale": {k: getattr(s, k) for k in s.__dataclass_fields__},
              "budget_tokens": budget, "target_nll": target, "flops": exp.flops,
              "flops_per_training_token": per_token, "cost_tokens": cost, "arms": rows, "curves": curves,
              "defects": _defects(exp, rater), "best": _best(rows), "seconds_this_call": seconds}
    write_json(os.path.join(out_dir, "report.json"), report)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(markdown(report))
    plot(report, os.path.join(out_dir, "curves.png"))
    return report


def _defects(exp, rater: np.ndarray) -> dict:
    """{ρ: {kind: the fraction of its documents the rater dropped}} (empty without labels)."""
    if not exp.docs.labelled:
        return {}
    from metatrain.filtering import topk_keep

    labels = np.asarray(exp.docs.defects)
    kinds = ["none"] + sorted(set(labels) - {"none"})
    out = {}
    for drop in exp.drops:
        keep = topk_keep(rater, 0, exp.scale.filter_batch, drop, 0, len(rater))
        out[f"{drop:g}"] = {k: float(np.mean(~keep[labels == k])) for k in kinds if (labels == k).any()}
    return out


def _best(rows: list[dict]) -> dict:
    """The rater's best ρ, and its margins over unfiltered, random at that ρ and the best perplexity filter."""
    raters = [r for r in rows if r["method"] == "rater"]
    if not raters:
        return {}
    best = min(raters, key=lambda r: r["nll"])
    ppl = [r for r in rows if r["method"].startswith("ppl_")]
    others = {"unfiltered": next(r for r in rows if r["method"] == "unfiltered"),
              "random": next((r for r in rows if r["method"] == "random" and r["drop"] == best["drop"]), None),
              "best_ppl": min(ppl, key=lambda r: r["nll"]) if ppl else None}
    margins = {}
    for name, other in others.items():
        if other is None:
            continue
        margins[name] = {"method": other["method"], "drop": other["drop"], "nll": other["nll"],
                         "margin": other["nll"] - best["nll"],  # > 0: the rater is better
                         # the worst rater seed against the best seed of the other
                         "margin_worst_seeds": min(other["nll_seeds"]) - max(best["nll_seeds"])}
    return {"drop": best["drop"], "nll": best["nll"], "nll_seeds": best["nll_seeds"], "vs": margins}


def _fmt(x: float, spec: str = ".3f") -> str:
    return "n/a" if x != x else format(x, spec)


def markdown(report: dict) -> str:
    """The report's tables as Markdown."""
    lines = [f"Budget {report['budget_tokens']:,} training tokens per model; the unfiltered models' final held-out "
             f"NLL {report['target_nll']:.4f} is the target. Costs in training-token equivalents: the rater "
             f"{report['cost_tokens']['rater']:,.0f}, the perplexity proxy {report['cost_tokens']['ppl']:,.0f}.", "",
             "| method | ρ | kept | final NLL (mean) | NLL per seed | tokens to match | gross gain | net gain |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["arms"]:
        seeds = ", ".join(f"{x:.4f}" for x in r["nll_seeds"])
        lines.append(f"| {r['method']} | {r['drop']:.2f} | {r['kept']:,} | {r['nll']:.4f} | {seeds} | "
                     f"{_fmt(r['tokens_to_match'], ',.0f')} | {_fmt(r['gross_gain'])} | {_fmt(r['net_gain'])} |")
    if report["defects"]:
        kinds = list(next(iter(report["defects"].values())))
        lines += ["", "Fraction of each kind the rater dropped:", "",
                  "| ρ | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
        for drop, fractions in report["defects"].items():
            lines.append(f"| {drop} | " + " | ".join(f"{fractions[k]:.2f}" for k in kinds) + " |")
    best = report["best"]
    if best:
        lines += ["", f"Best ρ for the rater: {best['drop']:g} (NLL {best['nll']:.4f}).", "",
                  "| against | its NLL | margin (mean) | margin (worst rater seed vs best other seed) |",
                  "|---|---|---|---|"]
        for name, m in best["vs"].items():
            lines.append(f"| {name} ({m['method']}, ρ {m['drop']:.2f}) | {m['nll']:.4f} | {m['margin']:+.4f} | "
                         f"{m['margin_worst_seeds']:+.4f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    """Held-out NLL against training tokens, one panel per ρ: each method's mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drops = report["settings"]["drops"]
    fig, axes = plt.subplots(1, len(drops), figsize=(4.2 * len(drops), 3.6), sharey=True, squeeze=False)
    colors = dict(zip(METHODS, ("black", "tab:red", "tab:gray", "tab:blue", "tab:cyan", "tab:purple", "tab:green")))
    c = report["curves"]
    for ax, drop in zip(axes[0], drops):
        for method in METHODS:
            name = arm_name(method, None if method in ("unfiltered", "oracle") else drop)
            if name in c:
                ax.plot(c[name]["tokens"], c[name]["nll_mean"], color=colors[method], label=method,
                        ls="--" if method in ("unfiltered", "oracle") else "-")
        ax.set_title(f"ρ = {drop:g}")
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out NLL")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def closing_lines(report: dict) -> list[str]:
    """`arm <method> drop <ρ> nll <x> gross_gain <g> net_gain <n>`, one per arm (means over seeds)."""
    return [f"arm {r['method']} drop {r['drop']:.2f} nll {r['nll']:.4f} gross_gain {r['gross_gain']:.3f} "
            f"net_gain {r['net_gain']:.3f}" for r in report["arms"]]
