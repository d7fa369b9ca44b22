"""What fills a compiled program's memory at its peak, from the compiler's own buffer assignment.

XLA writes, per compiled module, the buffer assignment (every logical buffer: its allocation, size, shape and
the JAX op that made it) and the live ranges over the program's schedule, ending with the buffers live at the
peak (`xla_dump_to` as a compile option: no flag changes for the rest of the process). `peak_buffers` reads
them back; `breakdown` sorts the peak's buffers into the program's inputs (arguments: the state and batches),
parameter-sized temporaries (as many elements as a leaf of θ, e.g. a stacked layer weight: gradients,
cotangents, HVP results, per-step checkpoints, Adam moments) and the rest (activations and their
derivatives, and small buffers). On a TPU the figures are the HBM's (memory space 0); VMEM is left out.
"""

from __future__ import annotations

import glob
import math
import os
import re
from collections import Counter

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8}


def dump_options(folder: str) -> dict:
    """Compile options that make XLA write its buffer assignment and live ranges into `folder`."""
    return {"xla_dump_to": folder, "xla_dump_hlo_as_text": True}


def _elements(shape: str) -> int:
    m = re.match(r"[a-z0-9]+\[([\d,]*)\]", shape)
    return math.prod(int(d) for d in m.group(1).split(",") if d) if m else 0


def _main_module(folder: str) -> str:
    """The dump prefix of the largest module compiled into `folder` (the outer step, not helper programs)."""
    files = glob.glob(os.path.join(folder, "*after_optimizations-buffer-assignment.txt"))
    if not files:
        raise FileNotFoundError(f"no buffer assignment was written to {folder}")
    return max(files, key=os.path.getsize)[: -len("-buffer-assignment.txt")]


def peak_buffers(folder: str) -> list[dict]:
    """The buffers live at the program's peak, largest first: name, bytes, shape, kind (argument | temp |
    output | constant) and the JAX op that made it (its `op_name`)."""
    prefix = _main_module(folder)
    values, kind = {}, "temp"
    with open(prefix + "-buffer-assignment.txt") as f:
        for line in f:
            if line.startswith("allocation "):
                kind = ("argument" if "parameter" in line else "output" if "output shape" in line
                        else "constant" if "constant" in line else "temp")
                space = re.search(r"color (\d+)", line)
                kind = kind if space is None or space.group(1) == "0" else "other memory space"
            m = re.match(r" value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=\d+\): (\S+)", line)
            if m:
                values[m.group(1)] = {"kind": kind, "shape": m.group(3)}
    ops = {}
    with open(prefix + "-buffer-assignment-values.txt") as f:
        for line in f:
            m = re.match(r" from instruction: %(\S+) = .*?op_name=\"([^\"]*)\"", line)
            if m:
                ops[m.group(1)] = m.group(2)
    live, at_peak = [], False
    with open(prefix + "-live-range.txt") as f:
        for line in f:
            if "(peak):" in line:
                at_peak = True
            elif at_peak:
                m = re.match(r"\s+(\S+?)(\{[\d,]*\})?: (\d+) bytes", line)
                if not m:
                    break
                name, index = m.group(1), m.group(2) or "{}"
                info = values.get(name + ("" if index == "{}" else index), values.get(name, {}))
                live.append({"name": name + ("" if index == "{}" else index), "bytes": int(m.group(3)),
                             "shape": info.get("shape", "?"), "kind": info.get("kind", "temp"),
                             "op": ops.get(name, "")})
    if not at_peak:
        raise ValueError(f"{prefix}-live-range.txt has no peak section")
    return sorted((b for b in live if b["kind"] != "other memory space"), key=lambda b: -b["bytes"])


def _param_sized(elements: int, sizes: set[int]) -> bool:
    """As many elements as a leaf of θ, or k <= 16 times as many (a stack of per-step copies, e.g. T checkpoints)."""
    return any(elements % n == 0 and elements // n <= 16 for n in sizes) if elements else False


def breakdown(buffers: list[dict], param_leaves: list[tuple[int, ...]], param_bytes: int) -> dict:
    """The peak's bytes split into arguments, parameter-sized temporaries (as many elements as a leaf of θ, or a
    stack of up to 16 such; per shape: how many buffers) and the rest; `param_units`: the parameter-sized bytes
    in units of θ's. Leaves under 64K elements are too small to tell apart from activations and are left out."""
    sizes = {math.prod(s) for s in param_leaves if math.prod(s) >= 65536}
    parts = Counter()
    per_leaf = Counter()
    for b in buffers:
        if b["kind"] == "argument":
            parts["argument_bytes"] += b["bytes"]
        elif _param_sized(_elements(b["shape"]), sizes):
            parts["param_sized_bytes"] += b["bytes"]
            per_leaf[b["shape"].split("{")[0]] += 1
        else:
            parts["other_bytes"] += b["bytes"]
    total = sum(b["bytes"] for b in buffers)
    return {"live_bytes": total, **{k: parts[k] for k in ("argument_bytes", "param_sized_bytes", "other_bytes")},
            "param_units": parts["param_sized_bytes"] / param_bytes if param_bytes else None,
            "param_sized_shapes": dict(per_leaf.most_common()),
            "largest": [{k: b[k] for k in ("name", "bytes", "shape", "kind", "op")} for b in buffers[:16]]}
