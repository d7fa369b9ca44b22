"""tests/compile_log: the compile events of the subprocesses a test starts, logged and summed up."""

import os
import subprocess
import sys

from compile_log import report
from helpers import TESTS

PROGRAM = "import jax; f = jax.jit(lambda x: x + 1); f(1.0); f(2.0); jax.jit(lambda x: x * 3)(1.0)"


def test_subprocesses_log_each_compile_and_cache_hit_and_the_report_sums_them(tmp_path, capsys):
    """Two programs (f once, called twice), run twice over one persistent cache: misses, then hits."""
    folder = tmp_path / "log"
    env = dict(os.environ, METATRAIN_COMPILE_LOG=str(folder), PYTEST_CURRENT_TEST="tests/x.py::test_y (call)",
               PYTHONPATH=os.path.join(TESTS, "compile_log"), JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    for _ in range(2):
        subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, capture_output=True)
    report.main(str(folder))
    out = capsys.readouterr().out
    lines = out.splitlines()
    # each run: two programs traced, lowered and compiled (or read from the cache), each a miss or a hit
    assert lines[0].startswith("16 events: tracing ") and lines[0].endswith("(persistent cache: 2 hits, 2 misses)")
    test = next(line.split() for line in lines if line.endswith("  tests/x.py::test_y"))
    program = next(line.split() for line in lines if line.endswith("  <lambda>"))
    assert test[4:6] == ["2", "2"] and program[4] == "4", out
