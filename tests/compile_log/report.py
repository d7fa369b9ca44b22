"""Where a suite's compile time went: `python tests/compile_log/report.py DIR` after
`METATRAIN_COMPILE_LOG=DIR python -m pytest`. Seconds are CPU seconds of the processes that logged them (both
workers and their subprocesses), summed; tracing and lowering are paid again on a persistent cache hit."""

import collections
import json
import pathlib
import sys


def main(folder: str, top: int = 25) -> None:
    rows = []
    for path in pathlib.Path(folder).glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a killed process
                continue
    total, tests, programs = collections.Counter(), collections.defaultdict(collections.Counter), \
        collections.defaultdict(collections.Counter)
    for r in rows:
        event, where = r["event"], r["test"] or r["command"]
        if event in ("hit", "miss"):
            total[event] += 1
            tests[where][event] += 1
            continue
        program = programs[r["function"].removeprefix("jit(").removesuffix(")")]
        for counter in (total, tests[where], program):
            counter[event] += r["seconds"]
        program["n"] += event == "compile"
    print(f"{len(rows)} events: tracing {total['trace']:.1f} s, lowering {total['lower']:.1f} s, compiling "
          f"{total['compile']:.1f} s (persistent cache: {total['hit']} hits, {total['miss']} misses)")
    cost = lambda c: c["trace"] + c["lower"] + c["compile"]
    print(f"\n{'s':>7} {'trace':>6} {'lower':>6} {'compile':>7} {'hits':>5} {'miss':>5}  test (or command)")
    for name, c in sorted(tests.items(), key=lambda kv: -cost(kv[1]))[:top]:
        print(f"{cost(c):7.1f} {c['trace']:6.1f} {c['lower']:6.1f} {c['compile']:7.1f} {c['hit']:5d} {c['miss']:5d}  "
              f"{name}")
    print(f"\n{'s':>7} {'trace':>6} {'lower':>6} {'compile':>7} {'n':>5}  program")
    for name, c in sorted(programs.items(), key=lambda kv: -cost(kv[1]))[:top]:
        print(f"{cost(c):7.1f} {c['trace']:6.1f} {c['lower']:6.1f} {c['compile']:7.1f} {c['n']:5d}  {name}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
