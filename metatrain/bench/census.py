"""What a compiled program's kernels compute and move, read off its optimized HLO text (`compiled.as_text()`).

A kernel is an instruction of a computation that runs on the device (the entry computation, loop bodies and
conditions, branches, called computations), other than those that only name data (parameters, tuples, bitcasts,
constants, ...); instructions inside a fusion are part of their fusion's kernel. Each kernel counts as often as its
computation runs per call of the program: a loop body `known_trip_count` times (a loop without one: once, and the
census says so). Per kernel:

- FLOPs: 2·M·N·K of each matrix product it holds (`dot`, in the kernel or in the fusion it calls at any depth, or a
  cuBLAS `custom-call`); other arithmetic is not counted.
- bytes: its operands and outputs in full, except that a dynamic slice reads and writes its slice (twice the
  output) and an in-place dynamic update writes its update (twice the operands less the buffer it updates). The
  bytes a kernel moves through memory at most, where the kernel reads each operand once; an estimate, not a
  measurement (a cache may serve some, a kernel may read an operand more than once).

An asynchronous pair (`fusion-start`, `fusion-done`) is one kernel, its start, whose output is the pair's result.
"""

from __future__ import annotations

import collections
import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \((.*)\) -> (.*) \{$")
PARAMETER = re.compile(r"([\w.\-]+): (\([^)]*\)|\w+\[[0-9,]*\](?:\{[^}]*\})?)")
INSTRUCTION = re.compile(r"^\s+(ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*?)\)(, .*)?$")
# instructions that name data without running a kernel
NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "opt-barrier", "partition-id",
             "replica-id", "after-all", "add-dependency", "get-dimension-size", "copy-start", "copy-done"}


# classes of ops by their names (XLA's GPU, TPU and CPU names: `gemm_fusion_dot.4`, `cublas-gemm.3`,
# `input_reduce_fusion.2`, `loop_transpose_fusion`, `ynn_fusion.1` (a dot on CPU), `while.5`); the first that matches
CLASSES = (("matmul", r"gemm|cublas|(^|_)dot|matmul|convolution|ynn_fusion"),
           ("collective", r"all-reduce|all-gather|reduce-scatter|all-to-all|collective"),
           ("transpose or copy", r"transpose|^copy"), ("reduction", r"reduce"),
           ("scatter or gather", r"scatter|gather"), ("dynamic slice or update", r"dynamic"),
           ("loop or control", r"^(while|conditional|call)"),
           ("other fusion", r"fusion"))


def op_class(op: str) -> str:
    """The class of an XLA op, from its name (`CLASSES`); "other" where none matches."""
    return next((name for name, pattern in CLASSES if re.search(pattern, op)), "other")


def array_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape (a tuple's: their sum)."""
    total = 0
    for dtype, dims in ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES[dtype]
    return total


def elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (an array's shape: itself)."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 1:
            out.append(shape[start:i])
            start = i + 1
    out.append(shape[start:-1])
    return [re.sub(r"/\*[^*]*\*/", "", e).strip() for e in out]


def dims(shape: str) -> list[int]:
    m = ARRAY.search(shape)
    return [int(d) for d in filter(None, m.group(2).split(","))] if m else []


def parse(hlo_text: str) -> tuple[dict, str]:
    """({computation: {"shapes": {name: shape}, "instructions": [...]}}, the entry computation's name)."""
    computations, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        head = HEADER.match(line)
        if head:
            current = {"shapes": dict(PARAMETER.findall(head.group(3))), "instructions": []}
            computations[head.group(2)] = current
            entry = head.group(2) if head.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        m = INSTRUCTION.match(line) if current is not None else None
        if m:
            name, shape, opcode, args, attrs = m.group(2), m.group(3), m.group(4), m.group(5), m.group(6) or ""
            current["shapes"][name] = shape
            current["instructions"].append({"name": name, "shape": shape, "opcode": opcode, "attrs": attrs,
                                            "operands": re.findall(r"%([\w.\-]+)", args), "root": bool(m.group(1))})
    return computations, entry


def _called(attrs: str, key: str) -> str | None:
    m = re.search(key + r"=%?([\w.\-]+)", attrs)
    return m.group(1) if m else None


def _product_flops(inst: dict, shapes: dict) -> int:
    """2·M·N·K of a matrix product, a `dot` or a cuBLAS call (by its backend config's dimension numbers): its
    output's elements (a cuBLAS call's result is a tuple: its first array, then the workspace) times the sizes of
    its left operand's contracting dimensions."""
    contracting = re.search(r'lhs_contracting_dims=\{([0-9,]*)\}|"lhs_contracting_dimensions":\[([^\]]*)\]',
                            inst["attrs"])
    k, n, lhs = 1, 1, dims(shapes.get(inst["operands"][0], ""))
    for d in re.findall(r"\d+", contracting.group(contracting.lastindex) or "") if contracting else []:
        k *= lhs[int(d)]
    for d in dims(inst["shape"]):
        n *= d
    return 2 * n * k


def _fusion_flops(computations: dict, name: str, seen: int = 0) -> tuple[int, str]:
    """(FLOPs of the products in a fused computation, at any depth; the opcode of its root)."""
    comp = computations.get(name)
    if comp is None or seen > 8:
        return 0, ""
    flops, root = 0, ""
    for inst in comp["instructions"]:
        if inst["opcode"] == "dot":
            flops += _product_flops(inst, comp["shapes"])
        elif inst["opcode"] == "fusion":
            flops += _fusion_flops(computations, _called(inst["attrs"], "calls"), seen + 1)[0]
        if inst["root"]:
            root = inst["opcode"]
    return flops, root


def kernels(hlo_text: str) -> tuple[dict[str, dict], bool]:
    """({kernel name: {"opcode", "shape", "calls", "flops", "bytes", "source"}} per call of the program, with
    `calls` the times it runs and `flops`, `bytes` summed over them; whether every loop had a known trip count)."""
    computations, entry = parse(hlo_text)
    out: dict[str, dict] = {}
    known = [True]

    def walk(name: str, calls: int, depth: int = 0) -> None:
        comp = computations.get(name)
        if comp is None or depth > 64:
            return
        shapes = comp["shapes"]
        for inst in comp["instructions"]:
            opcode, attrs = inst["opcode"], inst["attrs"]
            if opcode == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
                known[0] &= trip is not None
                n = int(trip.group(1)) if trip else 1
                walk(_called(attrs, "body"), calls * n, depth + 1)
                walk(_called(attrs, "condition"), calls * (n + 1), depth + 1)
                continue
            if opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", attrs)
                names = re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else \
                    [c for c in (_called(attrs, "true_computation"), _called(attrs, "false_computation")) if c]
                for branch in names:  # which branch runs is data: each counts as if it ran
                    walk(branch, calls, depth + 1)
                continue
            if opcode == "call":
                walk(_called(attrs, "to_apply"), calls, depth + 1)
                continue
            if opcode in NO_KERNEL or opcode.endswith("-done"):  # an async op's kernel is its start's
                continue
            out_bytes = array_bytes(inst["shape"])
            in_bytes = sum(array_bytes(shapes.get(o, "")) for o in inst["operands"])
            shape, parts = inst["shape"], elements(inst["shape"])
            if opcode.endswith("-start") and len(parts) > 1 and array_bytes(parts[0]) == in_bytes:
                shape = parts[1]  # ((operands), output, context): the output alone
                out_bytes = array_bytes(shape)
            flops, root = 0, opcode
            if opcode in ("fusion", "fusion-start"):
                flops, root = _fusion_flops(computations, _called(attrs, "calls"))
            elif opcode == "dot" or opcode == "custom-call" and re.search(r'custom_call_target="[^"]*(gemm|cublas)',
                                                                          attrs):
                flops = _product_flops(inst, shapes)
            if root == "dynamic-slice":
                moved = 2 * out_bytes
            elif root == "dynamic-update-slice":
                moved = 2 * max(in_bytes - out_bytes, 0)
            else:
                moved = in_bytes + out_bytes
            source = re.search(r'op_name="([^"]*)"', attrs)
            k = out.setdefault(inst["name"], {"opcode": opcode, "shape": shape[:120], "calls": 0,
                                               "flops": 0, "bytes": 0,
                                               "source": source.group(1)[-200:] if source else ""})
            k["calls"] += calls
            k["flops"] += calls * flops
            k["bytes"] += calls * moved

    if entry is not None:
        walk(entry, 1)
    return out, known[0]


def census(hlo_text: str, top: int = 8) -> dict:
    """A compiled program's kernels summed per call (`summary` of its `kernels`)."""
    return summary(*kernels(hlo_text), top=top)


def summary(found: dict[str, dict], known: bool = True, top: int = 8) -> dict:
    """`kernels`' figures summed: {"kernels", "flops", "bytes", "trip_counts_known", "by_class": [{"class", "kernels",
    "flops", "bytes"}], "products": the `top` matrix-product kernels by FLOPs ({"op", "shape", "calls", "flops",
    "bytes", "flops_per_byte"})}. Classes are those of a profile's op names (`op_class`), so that a trace's time per
    class stands beside them."""
    classes = collections.defaultdict(lambda: [0, 0, 0])
    for name, k in found.items():
        c = classes[op_class(name)]
        c[0] += k["calls"]
        c[1] += k["flops"]
        c[2] += k["bytes"]
    products = sorted(((n, k) for n, k in found.items() if k["flops"]), key=lambda nk: -nk[1]["flops"])[:top]
    return {"kernels": sum(k["calls"] for k in found.values()), "flops": sum(k["flops"] for k in found.values()),
            "bytes": sum(k["bytes"] for k in found.values()), "trip_counts_known": known,
            "by_class": [{"class": c, "kernels": n, "flops": f, "bytes": b}
                         for c, (n, f, b) in sorted(classes.items(), key=lambda kv: -kv[1][2])],
            "products": [{"op": n, "shape": k["shape"], "calls": k["calls"], "flops": k["flops"], "bytes": k["bytes"],
                          "flops_per_byte": round(k["flops"] / max(k["bytes"], 1), 1)} for n, k in products]}
