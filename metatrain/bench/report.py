"""Presenting `bench memory` rows: the paper side by side, and PNG plots."""

from __future__ import annotations

import numpy as np

from metatrain.aot import GiB
from metatrain.unroll import kept_states

# The MixFlow-MG paper's Table 2 ("Case study for 489M transformer") and Table 3 ("Case study for 44M
# transformer"), TPU HBM in G, each row (mixed mode, block remat, save grads) by our variant name. The tables
# state no task, batch, sequence length or T; the setting we put them beside (MAML, B=4 and T=2 as for its
# Figs. 7-8, S=2048) is our assumption.
ABLATION = ("autodiff", "autodiff+save", "autodiff+remat", "autodiff+remat+save", "mixflow", "mixflow+save",
            "mixflow+remat", "mixflow+remat+save")
PAPER_ABLATION_TPU = {"44m": dict(zip(ABLATION, (70.2, 45.8, 32.8, 34.1, 45.1, 45.5, 12.7, 12.9))),
                      "489m": dict(zip(ABLATION, (273.9, 176.6, 123.7, 130.8, 168.1, 176.8, 43.8, 46.9)))}
PAPER_TPU = {name: (t["autodiff+remat"], t["mixflow+remat+save"]) for name, t in PAPER_ABLATION_TPU.items()}
PAPER_CONFIG = {"task": "maml", "batch": 4, "seq_len": 2048, "inner_steps": 2}


def _paper_setting(row: dict) -> bool:
    return (all(row[k] == v for k, v in PAPER_CONFIG.items()) and row["backend"] == "tpu"
            and row.get("attention", "dense") == "dense" and row.get("compute_dtype", "float32") == "float32")


def ablation_comparison(rows: list[dict], name: str) -> str:
    """The ablation grid (mode x remat x save) of one model beside the paper's Table 2 / Table 3 (TPU HBM), each
    side's peak ratio against its own `autodiff+remat` row (the paper's "- + -")."""
    paper = PAPER_ABLATION_TPU.get(name) if rows and _paper_setting(rows[0]) else None
    by = {r["variant"]: r for r in rows}
    base = by.get("autodiff+remat")
    lines = ["| mixed mode | block remat | save grads | variant | ours: peak GiB | paper: TPU HBM G | ours: ratio | "
             "paper: ratio |", "|" + "---|" * 8]
    flag = lambda on: "+" if on else "-"
    for v in ABLATION:
        r = by.get(v)
        if r is None:
            continue
        over = " (over HBM)" if r.get("fits") is False else ""
        p = paper.get(v) if paper else None
        ours_ratio = f"{base['peak_bytes'] / r['peak_bytes']:.2f}x" if base else "-"
        paper_ratio = f"{paper['autodiff+remat'] / p:.2f}x" if p else "-"
        lines.append(f"| {flag(v.startswith('mixflow'))} | {flag('+remat' in v)} | {flag('+save' in v)} | {v} | "
                     f"{r['peak_bytes'] / GiB:.2f}{over} | {p or '-'} | {ours_ratio} | {paper_ratio} |")
    table = ("Table 2 ('Case study for 489M transformer')" if name == "489m"
             else "Table 3 ('Case study for 44M transformer')")
    note = (f"GiB per chip; paper: TPU HBM of its {table}, which states no task or shapes: MAML, B=4, T=2, S=2048, "
            "float32 and dense attention are our assumptions; ratios: autodiff+remat ÷ row, each side against its own"
            if paper else "no paper figures: the paper's Tables 2-3 are for 44m and 489m, MAML on TPU at B=4 "
                          "S=2048 T=2 (our assumed setting for them)")
    return "\n".join(lines) + f"\n({note})"


def static_parts(row: dict) -> dict:
    """A row's static bytes, named: η, the meta-optimizer state, the meta-gradient ∇η, the kept inner states
    (and the inner Adam state υ inside them), the carried inner state, and the rest (the batches)."""
    kept = kept_states(row["inner_steps"], row.get("kept_states", "every_step"), row.get("inner_peeled", False))
    measured = row.get("static_from") == "buffers"  # no loop left: the states the compiler kept, υ not told apart
    parts = {"eta": row["param_bytes"], "meta_opt": row["meta_opt_bytes"], "grad": row["grad_bytes"],
             "kept": min(row["kept_live_bytes"], row["kept_bytes"]) if measured
             else row["kept_bytes"], "inner": row["inner_bytes"]}
    return parts | {"adam_in_kept": None if measured else kept * row["adam_bytes"],
                    "other": row["static_bytes"] - sum(parts.values())}


def paper_comparison(rows: list[dict], names: dict[int, str], baseline: str, variant: str) -> str:
    """Per model size: measured peak and dynamic GiB of `baseline` and `variant` beside the paper's peak, and the
    static part named (η, ∇η, kept inner states with the inner Adam state υ in them, the rest)."""
    by = {(r["params"], r["variant"]): r for r in rows}
    head = ("| model | params | " + f"{baseline} peak (dyn.) | {variant} peak (dyn.) | peak ratio | dynamic ratio | "
            "paper peak | static of variant: η + meta-opt + ∇η + kept states (υ in them) + inner + other | "
            "static share |\n|"
            + "---|" * 9)
    lines, dominated = [head], []
    same_setting = _paper_setting(rows[0])
    for params, name in names.items():
        b, v = by.get((params, baseline)), by.get((params, variant))
        if b is None or v is None:
            continue
        g = lambda x: "-" if x is None else f"{x / GiB:.1f}"
        fit = lambda r: " refused" if r.get("exact") is False else (" over HBM" if r.get("fits") is False else "")
        paper = PAPER_TPU.get(name) if same_setting else None
        static, share, dynamic_ratio = "- (not split)", "-", "-"
        if b["dynamic_bytes"] is not None and v["dynamic_bytes"] is not None:
            dynamic_ratio = f"{b['dynamic_bytes'] / v['dynamic_bytes']:.2f}x"
        if v["dynamic_bytes"] is not None:
            p = static_parts(v)
            share = f"{100 * v['static_bytes'] / v['peak_bytes']:.0f}%"
            if v["static_bytes"] / v["peak_bytes"] >= 0.45:
                dominated.append(name)
            static = (f"{g(p['eta'])} + {g(p['meta_opt'])} + {g(p['grad'])} + {g(p['kept'])} "
                      f"(υ {g(p['adam_in_kept'])}) + {g(p['inner'])} + {g(p['other'])} = {g(v['static_bytes'])}")
        lines.append(
            f"| {name} | {params / 1e6:,.0f}M | {g(b['peak_bytes'])}{fit(b)} ({g(b['dynamic_bytes'])}) | "
            f"{g(v['peak_bytes'])}{fit(v)} ({g(v['dynamic_bytes'])}) | {b['peak_bytes'] / v['peak_bytes']:.2f}x | "
            f"{dynamic_ratio} | "
            f"{f'{paper[0]} -> {paper[1]}' if paper else '-'} | {static} | {share} |")
    note = ("GiB per chip; paper: TPU HBM of Table 2 ('Case study for 489M transformer') and Table 3 ('Case study "
            "for 44M transformer'), which state no task or shapes: MAML, B=4, T=2, S=2048, float32 and dense "
            "attention are our assumptions" if same_setting else "GiB" + (" per chip" if rows[0]["backend"] == "tpu"
                                                                           else "")
            + "; the paper's Tables 2-3 are shown only beside MAML on TPU at B=4 S=2048 T=2, dense float32 (our "
              "assumed setting for them)")
    if dominated:
        note += (f"; static memory is about half or more of {variant}'s peak from {dominated[0]} on: the next "
                 "savings must come from it (FSDP over chips, a kept-states schedule: metagrad.kept_states=sqrt)")
    return "\n".join(lines) + f"\n({note})"


def _nan(x):
    """None (a row without a static/dynamic split) as a gap in a plotted line."""
    return float("nan") if x is None else x


def _pyplot():
    """matplotlib's pyplot, without a display; imported only for a plot (a table needs none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(rows: list[dict], grid: str, baseline: str, path: str) -> str:
    """Ladder: ratios vs parameter count. Layers: memory and ratios vs depth. Tasks/ablation: peak per variant."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    others = [v for v in variants if v != baseline]
    if grid in ("ladder", "layers"):
        x_key, x_label = ("params", "parameters") if grid == "ladder" else ("n_layers", "layers")
        for v in variants:
            rs = [r for r in rows if r["variant"] == v]
            xs = [r[x_key] for r in rs]
            left.plot(xs, [r["peak_bytes"] / GiB for r in rs], "o-", label=f"{v} peak")
            left.plot(xs, [_nan(r["dynamic_bytes"]) / GiB for r in rs], "x--", label=f"{v} dynamic")
        for v in others:
            rs = [r for r in rows if r["variant"] == v and r["peak_ratio"]]
            right.plot([r[x_key] for r in rs], [r["peak_ratio"] for r in rs], "o-", label=f"peak, {v}")
            right.plot([r[x_key] for r in rs], [_nan(r["dynamic_ratio"]) for r in rs], "x--", label=f"dynamic, {v}")
        for ax in (left, right):
            ax.set_xlabel(x_label)
            if grid == "ladder":
                ax.set_xscale("log")
        left.set(ylabel="GiB", title="memory", yscale="log")
        right.set(ylabel=f"{baseline} ÷ variant", title="memory ratio")
    else:
        groups = list(dict.fromkeys(r["task"] for r in rows))
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            rs = {r["task"]: r for r in rows if r["variant"] == v}
            xs = [j + i * width for j in range(len(groups))]
            left.bar(xs, [rs[t]["peak_bytes"] / GiB for t in groups], width, label=v)
            right.bar(xs, [rs[t]["peak_ratio"] or 0 for t in groups], width, label=v)
        for ax in (left, right):
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups)
        left.set(ylabel="GiB", title="peak memory")
        right.set(ylabel=f"{baseline} ÷ variant", title="peak memory ratio")
    r0 = rows[0]
    where = f"{r0['topology']} (per chip)" if r0["topology"] else r0["backend"]
    model = "".join(f", {r0[k]}" for k, usual in (("attention", "dense"), ("compute_dtype", "float32"))
                    if r0.get(k, usual) != usual)
    fig.suptitle(f"{where}: B={r0['batch']} S={r0['seq_len']} T={r0['inner_steps']}{model}")
    for ax in (left, right):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def timeline_plot(rows: list[dict], path: str) -> str:
    """Live memory over each compiled program's schedule (rows with a "timeline"), one panel per row: in all, in
    parameter-sized buffers and in arguments. x: the position in the schedule, as a fraction (a loop body once)."""
    rows = [r for r in rows if r.get("timeline")]
    if not rows:
        raise ValueError("no row has a timeline: compile with --timeline")
    plt = _pyplot()
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 2.6 * len(rows)), sharex=True, squeeze=False)
    top = max(max(r["timeline"]["live_bytes"]) for r in rows) / GiB
    for ax, r in zip(axes[:, 0], rows):
        t = r["timeline"]
        x = np.linspace(0, 1, len(t["live_bytes"]))
        ax.fill_between(x, np.array(t["live_bytes"]) / GiB, color="tab:blue", alpha=0.35, label="all live buffers")
        ax.plot(x, np.array(t["param_sized_bytes"]) / GiB, color="tab:red", label="parameter-sized temporaries")
        ax.plot(x, np.array(t["argument_bytes"]) / GiB, color="k", ls=":", label="arguments (state, batches)")
        title = f"{r['variant']}, {r['params'] / 1e6:,.1f}M parameters: compiled peak {r['peak_bytes'] / GiB:.2f} GiB"
        ax.set(ylabel="GiB", ylim=(0, 1.05 * top), title=title)
        ax.legend(loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("position in the compiled program's schedule (fraction; each loop body appears once)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
