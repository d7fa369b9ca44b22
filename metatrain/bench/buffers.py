"""What fills a compiled program's memory over its schedule and at its peak, from the compiler's own buffer
assignment.

XLA writes, per compiled module, the buffer assignment (every logical value: its allocation, offset, size,
shape and the JAX op that made it) and each value's live range over the program's schedule (`xla_dump_to` as
a compile option: no flag changes for the rest of the process). Values that share a place in memory (a while
loop's carry, the buffer a scan output is written into and its updates, a donated argument and the output
aliasing it) are one region here, counted once. `read_dump` gives the regions; `timeline` the bytes live at
each position of the schedule (a loop's body appears once: its iterations reuse the same buffers);
`peak_regions` those live where that sum peaks; `breakdown` sorts them into the program's inputs (arguments:
the state and batches), parameter-sized buffers (a leaf of θ's shape, or a stack of a few:
gradients, cotangents, HVP results, kept inner states, Adam moments) and the rest (activations and their
derivatives, small buffers). On a TPU the live sum where it peaks is the compiled peak (`peak_memory_in_bytes`)
and the figures are the HBM's (memory space 0; VMEM is left out); on CPU it is at most the compiled peak (the
allocator also leaves gaps).
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
from collections import Counter

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8}


@contextlib.contextmanager
def fresh_compiles():
    """Compile for real inside: a program read from JAX's persistent compilation cache writes no dump. (JAX decides
    once per process whether it uses the cache: the decision is reset on the way in and out.)"""
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
        compilation_cache.reset_cache()


def dump_options(folder: str) -> dict:
    """Compile options that make XLA write its buffer assignment and live ranges into `folder`."""
    return {"xla_dump_to": folder, "xla_dump_hlo_as_text": True}


def _main_module(folder: str) -> str:
    """The dump prefix of the largest module compiled into `folder` (the outer step, not helper programs)."""
    files = glob.glob(os.path.join(folder, "*after_optimizations-buffer-assignment.txt"))
    if not files:
        raise FileNotFoundError(f"no buffer assignment was written to {folder}")
    return max(files, key=os.path.getsize)[: -len("-buffer-assignment.txt")]


def _op(names: list[str], ops: dict) -> str:
    """The first JAX op name among a buffer's values (an instruction's output tuple index dropped)."""
    return next((ops[v.split("{")[0]] for v in names if ops.get(v.split("{")[0])), "")


def read_dump(folder: str) -> tuple[list[dict], int]:
    """(the program's memory regions, the schedule's length). A region: bytes, shape, kind (argument | temp |
    output), the JAX op that made it (the first of its values' `op_name`s), start and end (schedule positions,
    inclusive: from the first of its values to be defined to the last use of any). A place the allocator reuses
    for another value later gives one region per use; arguments and outputs, in their own allocations, span the
    whole program (as `memory_analysis()` counts them)."""
    prefix = _main_module(folder)
    regions, where, kind, alloc = {}, {}, "temp", None
    with open(prefix + "-buffer-assignment.txt") as f:
        for line in f:
            if line.startswith("allocation "):
                alloc, size = (int(x) for x in re.match(r"allocation (\d+): size (\d+)", line).groups())
                kind = ("argument" if "parameter" in line else "output" if "output shape" in line
                        else "constant" if "constant" in line else "thread-local" if "thread-local" in line
                        else "temp")
                space = re.search(r"color (\d+)", line)
                kind = kind if space is None or space.group(1) == "0" else "other memory space"
            m = re.match(r" value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)", line)
            if m and kind in ("argument", "temp", "output"):
                # an argument's or output's allocation is one region (its values include in-place updates)
                key = (alloc, int(m.group(3)), int(m.group(2))) if kind == "temp" else (alloc, 0, size)
                region = regions.setdefault(key, {"bytes": key[2], "shape": m.group(4), "kind": kind, "values": []})
                if kind != "temp" and int(m.group(2)) == size and not region["values"]:
                    region["shape"] = m.group(4)  # the argument itself, not a smaller value updating it in place
                region["values"].append(m.group(1))
                where[m.group(1)] = key
    ops = {}
    with open(prefix + "-buffer-assignment-values.txt") as f:
        for line in f:
            m = re.match(r" from instruction: %(\S+) = .*?op_name=\"([^\"]*)\"", line)
            if m:
                ops[m.group(1)] = m.group(2)
    n, spans = 0, {}
    with open(prefix + "-live-range.txt") as f:
        for line in f:
            m = re.match(r"HloLiveRange \(max (\d+)\)", line)
            if m:
                n = int(m.group(1)) + 1
            m = re.match(r"\s+(\S+?)(\{[\d,]*\})?:(\d+)-(\d+)$", line)
            if m:
                name = m.group(1) + ("" if m.group(2) in (None, "{}") else m.group(2))
                key = where.get(name, where.get(m.group(1)))
                if key is not None and regions[key]["kind"] == "temp":  # arguments, outputs: the whole program
                    spans.setdefault(key, []).append((int(m.group(3)), int(m.group(4)), name))
    out = []
    for r in regions.values():
        if r["kind"] != "temp":  # an argument's or output's own allocation: held for the whole program
            out.append({"name": r["values"][0], "bytes": r["bytes"], "shape": r["shape"], "kind": r["kind"],
                        "op": _op(r["values"], ops), "start": 0, "end": max(n - 1, 0)})
    for key, values in spans.items():
        # one place in memory holds one value at a time: overlapping or adjacent ranges are one buffer under
        # several names (aliases), disjoint ones are later buffers reusing the place
        values.sort()
        r = regions[key]
        groups = [[values[0]]]
        for v in values[1:]:
            if v[0] <= max(e for _, e, _ in groups[-1]) + 1:
                groups[-1].append(v)
            else:
                groups.append([v])
        for g in groups:
            names = [name for _, _, name in g]
            out.append({"name": names[0], "bytes": r["bytes"], "shape": r["shape"], "kind": r["kind"],
                        "op": _op(names, ops), "start": g[0][0], "end": max(e for _, e, _ in g), "values": names,
                        "value_ops": [ops.get(v.split("{")[0], "") for v in names]})
    return out, max(n, 1 + max((r["end"] for r in out), default=0))


def timeline(regions: list[dict], n: int, select=lambda r: True) -> np.ndarray:
    """Bytes live at each of the schedule's `n` positions, over the regions `select` keeps."""
    diff = np.zeros(n + 1, np.int64)
    for r in regions:
        if select(r):
            diff[r["start"]] += r["bytes"]
            diff[r["end"] + 1] -= r["bytes"]
    return np.cumsum(diff[:-1])


def peak_regions(regions: list[dict], n: int) -> list[dict]:
    """The regions live where the live bytes peak, largest first."""
    t = int(np.argmax(timeline(regions, n)))
    return sorted((r for r in regions if r["start"] <= t <= r["end"]), key=lambda r: -r["bytes"])


def _dims(shape: str) -> tuple[int, ...]:
    m = re.match(r"[a-z0-9]+\[([\d,]*)\]", shape)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def _leaves(param_leaves: list[tuple[int, ...]]) -> set[tuple[int, ...]]:
    """θ's leaf shapes of 64K elements or more: smaller ones cannot be told apart from activations."""
    return {tuple(s) for s in param_leaves if math.prod(s) >= 65536}


def tells_apart(param_leaves: list[tuple[int, ...]]) -> bool:
    """Whether a dump can tell θ-sized buffers from activations: θ has a leaf of 64K elements or more."""
    return bool(_leaves(param_leaves))


def _param_sized(dims: tuple[int, ...], leaves: set[tuple[int, ...]]) -> bool:
    """A θ leaf's shape, or a stack of k <= 16 of them (per-step copies, e.g. T checkpoints). By shape, not
    element count: an activation [layers, batch, seq, d_model] can have as many elements as a weight."""
    return dims in leaves or (len(dims) > 1 and dims[0] <= 16 and dims[1:] in leaves)


def breakdown(buffers: list[dict], param_leaves: list[tuple[int, ...]], param_bytes: int) -> dict:
    """The peak's bytes split into arguments, parameter-sized temporaries (a leaf of θ's shape, or a stack of up
    to 16 such; per shape: how many buffers) and the rest; `param_units`: the parameter-sized bytes
    in units of θ's. Leaves under 64K elements are too small to tell apart from activations and are left out.
    `by_shape`: every live buffer by dtype and shape, [shape, how many, bytes], the 24 largest in bytes."""
    leaves = _leaves(param_leaves)
    parts = Counter()
    per_leaf = Counter()
    shape_bytes, shape_count = Counter(), Counter()
    for b in buffers:
        shape = b["shape"].split("{")[0]
        shape_bytes[shape] += b["bytes"]
        shape_count[shape] += 1
        if b["kind"] == "argument":
            parts["argument_bytes"] += b["bytes"]
        elif _param_sized(_dims(b["shape"]), leaves):
            parts["param_sized_bytes"] += b["bytes"]
            per_leaf[b["shape"].split("{")[0]] += 1
        else:
            parts["other_bytes"] += b["bytes"]
    total = sum(b["bytes"] for b in buffers)
    return {"live_bytes": total, **{k: parts[k] for k in ("argument_bytes", "param_sized_bytes", "other_bytes")},
            "param_units": parts["param_sized_bytes"] / param_bytes if param_bytes else None,
            "param_sized_shapes": dict(per_leaf.most_common()),
            "largest": [{k: b[k] for k in ("name", "bytes", "shape", "kind", "op")} for b in buffers[:16]],
            "by_shape": [[shape, shape_count[shape], n] for shape, n in shape_bytes.most_common(24)]}


def _outer(op: str) -> str:
    """An op name's outermost transformation: `jit(f)/transpose(jvp(g))/...` -> `transpose(jvp(g))`."""
    return op.split("/")[1] if op.count("/") else ""


def backward_start(regions: list[dict], leaves: set[tuple[int, ...]]) -> int | None:
    """The schedule position where the outer backward pass begins: its first parameter-sized buffer (the outer
    loss's gradient), one made by an instruction whose JAX op name's outermost transformation is a transpose
    (`jit(f)/transpose(...)/...`; the forward pass's inner gradients are `jit(f)/jvp(...)/...`). Broadcasts and
    copies are left out: XLA merges equal broadcasts of a constant (the zeros a gradient is accumulated into) from
    both passes and keeps either's name, and a copy takes its operand's. None: none found."""
    starts = [r["start"] for r in regions if r["kind"] == "temp" and _outer(r["op"]).startswith("transpose(")
              and "broadcast" not in r["name"] and not r["name"].startswith("copy")
              and _param_sized(_dims(r["shape"]), leaves)]
    return min(starts, default=None)


def kept_states_at_peak(regions: list[dict], n: int, param_leaves: list[tuple[int, ...]]) -> dict:
    """The kept inner states as the compiled program keeps them: parameter-sized temporaries written in the
    forward pass (before `backward_start`) and live at the peak (which can come before that start: the outer
    loss's gradient in [batch, seq, vocab] logits). Where no loop over inner steps is left the
    compiler frees or never keeps some of them (at T=2 it recomputes the first step's Adam moments from the
    saved gradient), so counting them from shapes overstates what is live. A buffer the forward pass never wrote
    is not a checkpoint: a constant splat (zeros XLA made early for the backward pass to accumulate into), or one
    only the backward pass wrote into (such a splat, then the outer loss's gradient accumulated into it)."""
    leaves = _leaves(param_leaves)
    t, start = int(np.argmax(timeline(regions, n))), backward_start(regions, leaves)
    kept = [] if start is None else [r for r in regions if r["kind"] == "temp" and r["start"] < start
                                     and r["start"] <= t <= r["end"] and _param_sized(_dims(r["shape"]), leaves)
                                     and written_forward(r)]
    return {"peak_position": t, "backward_start": start, "kept_live_bytes": sum(r["bytes"] for r in kept)}


def written_forward(region: dict) -> bool:
    """Whether the forward pass may have written the region: not when it is only a broadcast (a constant splat), nor
    when all its other values with a JAX op name were made by the backward pass (the name's outermost transformation
    a transpose; loop carries have no name, and a copy takes its operand's: they tell nothing)."""
    values = region.get("values", [region["name"]])
    ops = region.get("value_ops", [region["op"]] * len(values))
    named = [_outer(op) for v, op in zip(values, ops) if "broadcast" not in v and not v.startswith("copy") and op]
    if all("broadcast" in v for v in values):
        return False
    return not named or not all(o.startswith("transpose(") for o in named)


def profile(folder: str, param_leaves: list[tuple[int, ...]], param_bytes: int, points: int = 400) -> dict:
    """The program compiled into `folder`: `breakdown` at its peak, and its timeline in `points` bins (each bin's
    largest value, so peaks survive): live bytes in all and in parameter-sized buffers, over the schedule."""
    regions, n = read_dump(folder)
    leaves = _leaves(param_leaves)
    total = timeline(regions, n)
    param = timeline(regions, n, lambda r: r["kind"] != "argument" and _param_sized(_dims(r["shape"]), leaves))
    args = timeline(regions, n, lambda r: r["kind"] == "argument")
    edges = np.linspace(0, n, min(points, n) + 1).astype(int)
    binned = lambda a: [int(a[lo:hi].max()) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]
    return {"breakdown": breakdown(peak_regions(regions, n), param_leaves, param_bytes),
            "timeline": {"positions": n, "live_bytes": binned(total), "param_sized_bytes": binned(param),
                         "argument_bytes": binned(args)}}
