"""Where a compiled step's time goes: a JAX profiler trace of a few calls, summed per XLA op.

The trace is JAX's own (`jax.profiler.trace`, an XSpace `.xplane.pb` that TensorBoard's profile plugin and
xprof also open); the summary reads it with `jax.profiler.ProfileData`. An op's time is the summed self time of
the events that name it (`hlo_op`): an event's duration less that of the events nested in it on the same line
(a `while` loop's body ops are counted in themselves, not again in the loop). The events are those of the device
planes on a GPU or TPU (their `XLA Ops` line where the trace has one, else every line: the kernels on each
stream), those of the host's XLA threads on a CPU.
"""

from __future__ import annotations

import collections
import glob
import os
import re

from metatrain.bench import census
from metatrain.bench.census import op_class


def op_times(data) -> dict[tuple[str, str], list[float]]:
    """{(hlo_module, hlo_op): [total ns, events]} of a `jax.profiler.ProfileData`."""
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    device = [p for p in planes if any("hlo_op" in dict(e.stats) for line in p.lines for e in line.events)]
    chosen = device or [p for p in data.planes if p.name.startswith("/host:")]
    out: dict = collections.defaultdict(lambda: [0.0, 0])
    for plane in chosen:
        lines = list(plane.lines)
        for line in [line for line in lines if line.name == "XLA Ops"] or lines:
            for key, self_ns in _self_times(line.events):
                out[key][0] += self_ns
                out[key][1] += 1
    return dict(out)


def _self_times(events):
    """(key, self time) of a line's op events, each less the events nested directly inside it."""
    ops = []
    for e in events:
        stats = dict(e.stats)
        if "hlo_op" in stats:
            ops.append((e.start_ns, -e.duration_ns, e.end_ns, (str(stats.get("hlo_module", "")), str(stats["hlo_op"]))))
    ops.sort()
    stack, out = [], []  # stack: [end, index into out] of the open events
    for start, neg_duration, end, key in ops:
        while stack and stack[-1][0] <= start:
            stack.pop()
        if stack and end <= stack[-1][0]:
            out[stack[-1][1]][1] += neg_duration  # the enclosing event's self time loses this one's
        out.append([key, -neg_duration])
        stack.append((end, len(out) - 1))
    return [(key, max(0.0, t)) for key, t in out]


def top_ops(data, steps: int, n: int = 15) -> dict:
    """The `n` ops that took longest, per step of `steps` traced ones, and every op's time by class:
    {"op_ms_per_step": all ops' time, "top_ops": [{"module", "op", "kind", "ms_per_step", "share",
    "events_per_step"}], "by_class": [{"class", "ms_per_step", "share", "ops"}]} (kind: the op's name without its
    number, e.g. `fusion`, `custom-call`, `cublas-gemm`; class: `op_class`)."""
    times = op_times(data)
    total = sum(ns for ns, _ in times.values())
    rows = [{"module": module, "op": op, "kind": re.sub(r"[.\d]+$", "", op), "ms_per_step": ns / 1e6 / steps,
             "share": ns / total if total else 0.0, "events_per_step": count / steps}
            for (module, op), (ns, count) in sorted(times.items(), key=lambda kv: -kv[1][0])[:n]]
    classes = collections.defaultdict(lambda: [0.0, 0])
    for (_, op), (ns, _) in times.items():
        entry = classes[op_class(op)]  # [ns, ops]
        entry[0] += ns
        entry[1] += 1
    by_class = [{"class": name, "ms_per_step": ns / 1e6 / steps, "share": ns / total if total else 0.0, "ops": ops}
                for name, (ns, ops) in sorted(classes.items(), key=lambda kv: -kv[1][0])]
    return {"op_ms_per_step": total / 1e6 / steps, "top_ops": rows, "by_class": by_class}


def hlo_ops(hlo_text: str) -> dict[str, dict]:
    """{instruction name: {"shape", "opcode", "source"}} of a compiled module's HLO text (`compiled.as_text()`),
    every computation's; `source` is the JAX operation it came from (its `op_name` metadata), "" without one; a
    shape or source longer than 300 characters is cut (a loop's tuple: its start; a source: its end)."""
    out = {}
    for comp in census.parse(hlo_text)[0].values():
        for inst in comp["instructions"]:
            source = re.search(r'op_name="([^"]*)"', inst["attrs"])
            out[inst["name"]] = {"shape": inst["shape"][:300], "opcode": inst["opcode"],
                                 "source": source.group(1)[-300:] if source else ""}
    return out


def trace(call, steps: int, directory: str, hlo_text: str | None = None) -> dict:
    """Run `call()` `steps` times under the profiler, the trace in `directory`; its `top_ops` summary. With the
    compiled program's `hlo_text`, it is kept beside the trace (`program.hlo.txt`) and each top op gets its shape,
    opcode and the JAX operation it came from (`hlo_ops`)."""
    import jax

    os.makedirs(directory, exist_ok=True)
    with jax.profiler.trace(directory):
        for _ in range(steps):
            call()
    paths = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    summary = {"trace": paths[-1], **top_ops(jax.profiler.ProfileData.from_file(paths[-1]), steps)}
    if hlo_text is not None:
        with open(os.path.join(directory, "program.hlo.txt"), "w") as f:
            f.write(hlo_text)
        described = hlo_ops(hlo_text)
        summary["program"] = f.name
        costs, known = census.kernels(hlo_text)
        summary["top_ops"] = [{**o, **described.get(o["op"], {}), **achieved(o, costs.get(o["op"]))}
                              for o in summary["top_ops"]]
        summary["census"] = census.summary(costs, known)
    return summary


def achieved(op: dict, cost: dict | None) -> dict:
    """What a traced op computes and moves per step by the compiled program's census (`metatrain.bench.census`),
    and the rates that makes in the time it took: {"calls_per_step", "flops_per_step", "bytes_per_step",
    "tflop_per_s", "gb_per_s"} (none for an op the census does not count as a kernel)."""
    if not cost:
        return {}
    seconds = op["ms_per_step"] / 1e3
    return {"calls_per_step": cost["calls"], "flops_per_step": cost["flops"], "bytes_per_step": cost["bytes"],
            "tflop_per_s": cost["flops"] / seconds / 1e12 if seconds else None,
            "gb_per_s": cost["bytes"] / seconds / 1e9 if seconds else None}


def file_name(text: str) -> str:
    """`text` as a file name of letters, digits, `.`, `_` and `-` only (`mixflow+remat+save` → `mixflow_remat_save`)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)
