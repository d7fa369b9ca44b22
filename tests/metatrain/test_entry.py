import os
import subprocess
import sys

import pytest

from metatrain import entry
from metatrain.entry import hugepage_env


@pytest.mark.parametrize("glibc,thp,before,after", [
    ((2, 36), "madvise", None, "glibc.malloc.hugetlb=1"),
    ((2, 35), "madvise", "glibc.malloc.tcache_count=8", "glibc.malloc.tcache_count=8:glibc.malloc.hugetlb=1"),
    ((2, 36), "always", None, None),  # the kernel backs large blocks with huge pages already
    ((2, 36), "never", None, None),
    ((2, 36), None, None, None),  # no transparent huge pages at all
    ((2, 34), "madvise", None, None),  # no such tunable yet
    ((2, 36), "madvise", "glibc.malloc.hugetlb=0", None),  # the user's own choice stays
])
def test_hugepage_env_adds_the_tunable_only_where_it_helps(glibc, thp, before, after):
    environ = {"PATH": "/bin"} | ({"GLIBC_TUNABLES": before} if before else {})
    got = hugepage_env(environ, glibc=glibc, thp=thp)
    assert (got if got is None else got["GLIBC_TUNABLES"]) == after
    if got is not None:
        assert got["PATH"] == "/bin"


def test_not_glibc_is_left_alone(monkeypatch):
    monkeypatch.setattr(entry, "_glibc_version", lambda: None)
    assert hugepage_env({}, thp="madvise") is None


def test_relaunch_execs_the_same_command_with_the_tunable(monkeypatch):
    calls = []
    monkeypatch.setattr(entry, "hugepage_env", lambda environ: {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    monkeypatch.setattr(sys, "orig_argv", ["python3", "/venv/bin/metatrain", "train", "steps=3"])
    monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
    entry.relaunch()
    assert calls == [(sys.executable, [sys.executable, "/venv/bin/metatrain", "train", "steps=3"],
                      {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})]


def test_relaunch_in_a_real_process_runs_once_with_what_hugepage_env_says(tmp_path):
    """The program's process restarts itself at most once; it ends with the tunables `hugepage_env` gives for this
    machine (unchanged where huge pages do not help here)."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    script = tmp_path / "prog.py"
    script.write_text("import os, sys\nfrom metatrain import entry\n"
                      "print('start', flush=True)\nentry.relaunch()\n"
                      "print('tunables', os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])\n")
    out = subprocess.run([sys.executable, str(script), "a", "b c"], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    expected = (hugepage_env(env) or env).get("GLIBC_TUNABLES")
    assert out == ["start"] * (1 + (expected is not None)) + [f"tunables {expected} ['a', 'b c']"]
