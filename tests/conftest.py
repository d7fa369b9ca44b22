"""Session-wide test setup: how the tests compile, and one tiny training run shared by the tests that only read
what it leaves behind.

- One compilation cache (JAX's persistent cache, in a temporary folder removed at the end) for this
  process, its pytest-xdist workers and every metatrain subprocess the tests start: each distinct
  program is still compiled, once; identical ones (the same tiny outer step in many runs) are not
  compiled again. It changes no result.
- XLA:CPU's LLVM backend at optimisation level 0, and (jaxlib 0.10) its older loop emitters for fusions instead of
  the MLIR fusion emitters: the suite compiles a few hundred tiny programs and runs each for milliseconds, so
  compile time is what counts (check-grads: 44 s -> 28 s at -O0; a tiny outer step's compile 5.7 s -> 3.7 s
  without the fusion emitters). The HLO programs and the checks are the same; float results may differ in
  the last bits (check-grads still agrees to ~1e-15, against tolerances of 1e-10).
- Dots as XLA's own dot kernels instead of YNNPACK fusions (`ynn_fusion_type=-individual_dot`): XLA:CPU builds a
  YNNPACK runtime for each such fusion the first time a program runs, a twentieth of a tiny `train`'s CPU time
  (5.8 -> 5.5 s, 3 runs each), for matrices of a few dozen rows. The same HLO dots; float results may differ in the
  last bits, as above.
- The garbage collector of each pytest process (the controller and its workers, which live for the whole suite) is
  set as the `metatrain` command sets its own (`metatrain.collector`): what is imported at start-up (JAX, Flax,
  Orbax, pytest) is frozen out of its reach; and it collects the oldest generation only after 100,000 collections of
  the younger ones instead of 10 (the command: 100), because a worker's heap grows with every program it has traced
  and each full collection rescans all of it (a sixth of the suite's tests, one worker: 155 -> 145 CPU s; peak RSS
  unchanged, 3.7 GB).
- The LLVM module of a program compiled as one piece (`parallel_codegen_split_count=1`): XLA:CPU splits it for
  codegen threads by default, which costs more CPU than it saves wall time when two workers already keep both
  cores busy (a tiny outer step: 7.0 -> 5.3 CPU s, median of 5). The HLO program is the same.
"""

import contextlib
import fcntl
import gc
import io
import json
import os
import shutil
import sys
import tempfile
from importlib.metadata import version

if os.environ.get("METATRAIN_COMPILE_LOG"):  # where the compile time goes: tests/compile_log/report.py
    COMPILE_LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_log")
    os.environ["METATRAIN_COMPILE_LOG"] = os.path.abspath(os.environ["METATRAIN_COMPILE_LOG"])
    os.makedirs(os.environ["METATRAIN_COMPILE_LOG"], exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (COMPILE_LOG, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, COMPILE_LOG)
    import compile_events

    compile_events.install()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # before JAX is imported anywhere
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="metatrain-test-jax-cache-")
    os.environ["METATRAIN_TEST_OWNS_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
# the compile options of the module docstring, and one CPU device in this process unless asked for more: a run's
# mesh.cpu_devices=0 (the main job's) would otherwise split the CPU of a test process whose backend has not started
# yet, for every test that runs in it after
FLAGS = ["--xla_backend_optimization_level=0", "--xla_cpu_parallel_codegen_split_count=1",
         "--xla_force_host_platform_device_count=1"]
JAXLIB = tuple(int(n) for n in version("jaxlib").split(".")[:2])
if JAXLIB < (0, 11):  # jaxlib 0.11 no longer has the flag
    FLAGS.append("--xla_cpu_use_fusion_emitters=false")
if JAXLIB == (0, 10):  # the version CI tests (an unknown flag aborts)
    FLAGS.append("--xla_cpu_experimental_ynn_fusion_type=-individual_dot")
for flag in FLAGS:
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402
from helpers import TESTS, TINY  # noqa: E402

gc.freeze()
gc.set_threshold(*gc.get_threshold()[:2], 100_000)

FAKES = os.path.join(TESTS, "fakes")
# the shared run: TINY with a uniform baseline, 4 steps, checkpoints and evaluations at 2 and 4,
# logging to a W&B stand-in
SHARED_RUN = [*TINY, "baseline=uniform", "steps=4", "checkpoint_every=2", "eval_every=2", "log.wandb=true"]


def pytest_collection_modifyitems(items):
    """The slow tests first, so that the two xdist workers (work stealing) end together."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session):
    owned = os.environ.get("METATRAIN_TEST_OWNS_CACHE")
    if owned and not hasattr(session.config, "workerinput"):  # the controller, not an xdist worker
        shutil.rmtree(owned, ignore_errors=True)


@contextlib.contextmanager
def fake_wandb(log_path):
    """`import wandb` finds the recording stand-in in tests/fakes while the block runs."""
    sys.path.insert(0, FAKES)
    previous = os.environ.get("FAKE_WANDB_LOG")
    os.environ["FAKE_WANDB_LOG"] = str(log_path)
    try:
        yield
    finally:
        sys.path.remove(FAKES)
        sys.modules.pop("wandb", None)
        if previous is None:
            os.environ.pop("FAKE_WANDB_LOG")
        else:
            os.environ["FAKE_WANDB_LOG"] = previous


def _run_shared(root):
    from metatrain import cli

    workdir, out, err = os.path.join(root, "run"), io.StringIO(), io.StringIO()
    with (fake_wandb(os.path.join(root, "wandb.jsonl")), contextlib.redirect_stdout(out),
          contextlib.redirect_stderr(err)):
        code = cli.main(["train", *SHARED_RUN, f"workdir={workdir}"])
    assert code == 0, out.getvalue()[-3000:] + err.getvalue()[-3000:]
    with open(os.path.join(root, "result.json"), "w") as f:
        json.dump({"stdout": out.getvalue(), "stderr": err.getvalue()}, f)


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """{"workdir", "stdout", "stderr", "wandb"} of the shared tiny run (made once per test session, also under xdist).
    Tests must not change its work dir: copy it first."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared_run"  # one for all workers
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "result.json").exists():
            _run_shared(str(root))
    result = json.loads((root / "result.json").read_text())
    return {"workdir": root / "run", "stdout": result["stdout"], "stderr": result["stderr"],
            "wandb": root / "wandb.jsonl"}
