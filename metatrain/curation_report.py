"""The curation experiment's report: tables (JSON and Markdown), NLL curves (PNG), each rater's defect table.

Every figure is recomputable from what the experiment stored: each arm's held-out NLL curve per seed and its kept
documents and tokens (`arms/*/result.json`), and the FLOPs of the programs that ran (`flops.json`, counted from
their jaxprs by `metatrain.flops`). Costs are in training-token equivalents of the target model: FLOPs divided by
a target pretraining step's FLOPs per token.

For an arm, `tokens` is where its mean NLL curve over seeds (linear between evaluations) reaches the unfiltered
models' final mean NLL (NaN if it never does within the budget):

- gross gain = 1 − tokens / budget;
- net gain, as DataRater counts it (Calian et al. 2025): 1 − (tokens + inference) / budget, where inference is the
  selector's forward passes on the candidates the target draws: for each kept document 1/(1−ρ) candidates, each
  read by its first `score_rows` rows (the rows the scorer actually reads), the target reading budget / kept tokens
  passes over its kept documents; that is budget × (rows the scorer reads of the pool) / (kept tokens) rows;
- full gain: also charging the selector's one-off cost to this one model: the rater's meta-training, or the
  perplexity proxy's training;
- runs to break even: how many target runs of this budget pay back the one-off cost, ⌈one-off / (budget − tokens −
  inference)⌉ (infinite when the net saving is not positive).

Random drop and the oracle cost nothing.
"""

from __future__ import annotations

import glob
import math
import os

import numpy as np

from metatrain.paths import read_json, write_json

RATER_METHODS = ("rater_score", "rater_lm")
PPL_METHODS = ("ppl_low", "ppl_mid", "ppl_high")
METHODS = ("unfiltered", *RATER_METHODS, "random", *PPL_METHODS, "oracle")  # the experiment's arms


def arm_name(method: str, drop: float | None) -> str:
    """An arm's name: its method, and the share of the pool it drops (`rater_score_0.25`)."""
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


def standard_error(values) -> float:
    """The standard error of the mean of `values` (sample standard deviation / √n); NaN for fewer than two."""
    values = np.asarray(values, float)
    return float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan


def selector(method: str) -> str | None:
    """The scorer whose FLOPs an arm's selection costs: a rater, the perplexity proxy, or None."""
    return method if method in RATER_METHODS else "proxy" if method in PPL_METHODS else None


def costs(flops: dict, method: str, budget: float, kept_tokens: float, pool_rows: float) -> dict:
    """An arm's selection costs in FLOPs: `inference` (the selector's forward passes on the candidates a target run
    of `budget` tokens draws, `pool_rows` the rows it reads of the whole pool) and `one_off` (its meta-training or
    training)."""
    who = selector(method)
    if who is None:
        return {"inference": 0.0, "one_off": 0.0}
    return {"inference": budget * pool_rows / kept_tokens * flops[f"{who}_per_row"],
            "one_off": flops[f"{who}_training"]}


def runs_to_break_even(one_off: float, saving: float) -> float:
    """Target runs whose net savings (`saving` each, training tokens) pay back `one_off` (training tokens)."""
    if saving != saving:
        return math.nan
    return math.inf if saving <= 0 else float(math.ceil(one_off / saving))


def _arms(directory: str) -> dict[tuple[str, float | None], list[dict]]:
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(directory, "arms", "*", "result.json"))):
        r = read_json(path, "arm result")
        if r["method"] in METHODS:  # arms of methods an earlier version ran are left out
            out.setdefault((r["method"], r["drop"]), []).append(r)
    return out


def compute(arms: dict, flops: dict, tokens_per_step: int, steps: int, pool_rows: float) -> dict:
    """The report's figures from the stored arms (`_arms`) and FLOPs."""
    per_token = flops["pretrain_step"] / tokens_per_step
    budget = steps * tokens_per_step
    curves, rows = {}, []
    unfiltered = arms[("unfiltered", None)]
    target = float(np.mean([r["curve"][-1][1] for r in unfiltered]))
    for (method, drop), runs in sorted(arms.items(), key=lambda kv: (METHODS.index(kv[0][0]), kv[0][1] or 0)):
        evaluated_at = np.asarray([p[0] for p in runs[0]["curve"]])  # the steps of the evaluations
        nll = np.asarray([[p[1] for p in r["curve"]] for r in runs])  # [seeds, evaluations]
        tokens = evaluated_at * tokens_per_step
        mean = nll.mean(0)
        reach = budget if method == "unfiltered" else tokens_to_reach(tokens, mean, target)
        c = {k: v / per_token for k, v in costs(flops, method, budget, runs[0]["kept_tokens"], pool_rows).items()}
        finals = nll[:, -1]
        rho = drop if drop is not None else (0.0 if method == "unfiltered" else 1 - runs[0]["kept"] / runs[0]["of"])
        saving = budget - reach - c["inference"]
        rows.append({"method": method, "drop": rho, "kept": runs[0]["kept"], "of": runs[0]["of"],
                     "kept_tokens": runs[0]["kept_tokens"], "seeds": len(runs),
                     "nll": float(finals.mean()), "nll_se": standard_error(finals), "nll_seeds": finals.tolist(),
                     "tokens_to_match": reach, "gross_gain": 1 - reach / budget,
                     "inference_tokens": c["inference"], "net_gain": saving / budget,
                     "one_off_tokens": c["one_off"], "full_gain": (saving - c["one_off"]) / budget,
                     "runs_to_break_even": runs_to_break_even(c["one_off"], saving) if c["one_off"] else None})
        curves[arm_name(method, drop)] = {"tokens": tokens.tolist(), "nll_mean": mean.tolist(),
                                          "nll_seeds": nll.tolist()}
    return {"budget_tokens": budget, "target_nll": target, "flops_per_training_token": per_token, "arms": rows,
            "curves": curves, "best": {m: _best(rows, m) for m in RATER_METHODS if any(r["method"] == m
                                                                                      for r in rows)}}


def write(exp, raters: dict[str, np.ndarray], seconds: float) -> dict:
    """Compute the report of a finished experiment `exp` (`curation.Experiment`), write DIR/report/ and return it
    (`raters`: each rater's scores; `seconds`: what this call of the experiment took up to the report)."""
    s = exp.scale
    out_dir = os.path.join(exp.dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    pool_rows = exp.pool_rows
    figures = compute(_arms(exp.dir), exp.flops, s.tokens_per_step, exp.steps, pool_rows)
    scale = {**{k: getattr(s, k) for k in s.__dataclass_fields__}, "target": s.target and vars(s.target)}
    report = {"settings": exp.settings, "scale": scale, "target_model": vars(s.target_arch),
              "rater_model": vars(s.rater_arch), "pool_rows_read": pool_rows, "flops": exp.flops,
              **figures, "defects": {name: _defects(exp, scores) for name, scores in raters.items()},
              "seconds_this_call": seconds}
    write_json(os.path.join(out_dir, "report.json"), report)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(markdown(report))
    plot(report, os.path.join(out_dir, "curves.png"))
    return report


def _defects(exp, scores: np.ndarray) -> dict:
    """{ρ: {kind: the fraction of its documents a rater dropped}} (empty without labels)."""
    if not exp.docs.labelled:
        return {}
    labels = np.asarray(exp.docs.defects)
    kinds = ["none"] + sorted(set(labels) - {"none"})
    out = {}
    for drop in exp.drops:
        keep = exp.keep_by_rater(scores, drop)
        out[f"{drop:g}"] = {k: float(np.mean(~keep[labels == k])) for k in kinds if (labels == k).any()}
    return out


def _best(rows: list[dict], method: str) -> dict:
    """Rater `method`'s best ρ, and its margins over unfiltered, random at that ρ and the best perplexity filter, each
    with the standard error of the difference of the two means."""
    raters = [r for r in rows if r["method"] == method]
    best = min(raters, key=lambda r: r["nll"])
    ppl = [r for r in rows if r["method"] in PPL_METHODS]
    others = {"unfiltered": next(r for r in rows if r["method"] == "unfiltered"),
              "random": next((r for r in rows if r["method"] == "random" and r["drop"] == best["drop"]), None),
              "best_ppl": min(ppl, key=lambda r: r["nll"]) if ppl else None}
    margins = {}
    for name, other in others.items():
        if other is None:
            continue
        se = math.hypot(best["nll_se"], other["nll_se"])
        margin = other["nll"] - best["nll"]  # > 0: the rater is better
        margins[name] = {"method": other["method"], "drop": other["drop"], "nll": other["nll"],
                         "nll_se": other["nll_se"], "margin": margin, "margin_se": se,
                         "margin_in_se": margin / se if se > 0 else math.nan}
    return {"drop": best["drop"], "nll": best["nll"], "nll_se": best["nll_se"], "net_gain": best["net_gain"],
            "full_gain": best["full_gain"], "vs": margins}


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None or x != x else "never" if x == math.inf else format(x, spec)


def markdown(report: dict) -> str:
    """The report's tables as Markdown."""
    t, r_ = report["target_model"], report["rater_model"]
    layers = lambda n: f"{n} layer{'s' * (n != 1)}"
    lines = [f"Target model d_model {t['d_model']}, {layers(t['n_layers'])}; raters' model d_model {r_['d_model']}, "
             f"{layers(r_['n_layers'])}. Budget {report['budget_tokens']:,} training tokens per target model; the "
             f"unfiltered models' final held-out NLL {report['target_nll']:.4f} is the target. Costs in target "
             "training-token equivalents.", "",
             "| method | ρ | kept | final NLL (mean ± se) | NLL per seed | tokens to match | gross gain | inference "
             "| net gain | one-off | full gain | runs to break even |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["arms"]:
        seeds = ", ".join(f"{x:.4f}" for x in r["nll_seeds"])
        lines.append(f"| {r['method']} | {r['drop']:.2f} | {r['kept']:,} | {r['nll']:.4f} ± {_fmt(r['nll_se'], '.4f')}"
                     f" | {seeds} | {_fmt(r['tokens_to_match'], ',.0f')} | {_fmt(r['gross_gain'])} | "
                     f"{r['inference_tokens']:,.0f} | {_fmt(r['net_gain'])} | {r['one_off_tokens']:,.0f} | "
                     f"{_fmt(r['full_gain'])} | {_fmt(r['runs_to_break_even'], '.0f')} |")
    for name, defects in report["defects"].items():
        if not defects:
            continue
        kinds = list(next(iter(defects.values())))
        lines += ["", f"Fraction of each kind {name} dropped:", "",
                  "| ρ | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
        for drop, fractions in defects.items():
            lines.append(f"| {drop} | " + " | ".join(f"{fractions[k]:.2f}" for k in kinds) + " |")
    for name, best in report["best"].items():
        lines += ["", f"Best ρ for {name}: {best['drop']:g} (NLL {best['nll']:.4f} ± {_fmt(best['nll_se'], '.4f')}).",
                  "", "| against | its NLL (mean ± se) | margin | se of the margin | margin / se |",
                  "|---|---|---|---|---|"]
        for other, m in best["vs"].items():
            lines.append(f"| {other} ({m['method']}, ρ {m['drop']:.2f}) | {m['nll']:.4f} ± {_fmt(m['nll_se'], '.4f')} "
                         f"| {m['margin']:+.4f} | {_fmt(m['margin_se'], '.4f')} | {_fmt(m['margin_in_se'], '+.1f')} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    """Held-out NLL against training tokens, one panel per ρ: each method's mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drops = report["settings"]["drops"]
    fig, axes = plt.subplots(1, len(drops), figsize=(4.2 * len(drops), 3.6), sharey=True, squeeze=False)
    colors = dict(zip(METHODS, ("black", "tab:red", "tab:orange", "tab:gray", "tab:blue", "tab:cyan", "tab:purple",
                                "tab:green")))
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
    """`arm <method> drop <ρ> nll <mean> se <se> gross_gain <g> net_gain <n> full_gain <f>`, one per arm (over seeds),
    then `rater_cost meta_flops <x> target_runs_to_break_even <k>` for the rater arm with the best net gain."""
    lines = [f"arm {r['method']} drop {r['drop']:.2f} nll {r['nll']:.4f} se {r['nll_se']:.4f} "
             f"gross_gain {r['gross_gain']:.3f} net_gain {r['net_gain']:.3f} full_gain {r['full_gain']:.3f}"
             for r in report["arms"]]
    best = best_rater_arm(report)
    if best is not None:
        k = best["runs_to_break_even"]
        lines.append(f"rater_cost meta_flops {report['flops'][best['method'] + '_training']:.4g} "
                     f"target_runs_to_break_even {'inf' if k == math.inf else 'nan' if k != k else int(k)}")
    return lines


def best_rater_arm(report: dict) -> dict | None:
    """The rater arm with the highest net gain (the lowest NLL where none reaches the target)."""
    arms = [r for r in report["arms"] if r["method"] in RATER_METHODS]
    if not arms:
        return None
    reached = [r for r in arms if r["net_gain"] == r["net_gain"]]
    return max(reached, key=lambda r: r["net_gain"]) if reached else min(arms, key=lambda r: r["nll"])
