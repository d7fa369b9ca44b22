"""Helpers shared by the tests: the tiny run config, running metatrain in a subprocess, reading a run's saved
state and comparing parameters."""

import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp

TESTS = os.path.dirname(os.path.abspath(__file__))

# a tiny loss-weighting run: well under a second per step on CPU; held-out evaluation at the end only (the shared
# run sets eval_every=2 where periodic rows are checked)
TINY = ["task=loss_weighting", "model.d_model=16", "model.n_heads=2", "model.d_ff=32", "data.vocab_size=300",
        "data.seq_len=16", "data.batch=8", "data.shuffle_window=256", "data.corrupt_fraction=0.3",
        "eval_batches=1", "eval_every=100000", "log_every=1", "inner_lr=0.01"]


def env(devices: int = 1, **extra) -> dict:
    """The environment of a metatrain subprocess: CPU with `devices` simulated devices, this test directory's
    task modules importable, and the session's compilation cache (set by conftest)."""
    path = os.pathsep.join([TESTS, os.path.join(TESTS, "metatrain"), os.environ.get("PYTHONPATH", "")])
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path,
                XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(), **extra)


def metatrain(*args, devices: int = 1, background: bool = False, cwd=None, extra_env=None):
    """`metatrain ARGS...` in a subprocess: its CompletedProcess (text), or the Popen when `background`."""
    cmd = [sys.executable, "-m", "metatrain.cli", *map(str, args)]
    e = env(devices, **(extra_env or {}))
    if background:
        return subprocess.Popen(cmd, env=e, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=e, cwd=cwd, capture_output=True, text=True)


def train(workdir, *extra, devices: int = 1, resume: bool = False, command: str = "train") -> str:
    """A tiny run in a subprocess that must succeed; returns its stdout."""
    res = metatrain(command, *TINY, f"workdir={workdir}", *extra, *(["--resume"] if resume else []), devices=devices)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def checkpoints(workdir) -> list[int]:
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def saved_state(workdir, step):
    """The saved state on this process's one device, whatever mesh wrote it."""
    import jax

    path = os.path.abspath(os.path.join(workdir, "checkpoints", str(step), "state"))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path).item_metadata.tree
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
        return ckptr.restore(path, target)


def leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_same_params(a, b):
    """Two float32 parameter trees agree up to reduction order. Adam turns a gradient entry that cancels to ~0
    into a step of about ±lr whose sign follows the reduction order, so on 1 vs several devices a handful of
    such entries legitimately differ by ~lr. We check that they stay a handful (<= 0.1% of entries off by more
    than 1e-5 of the largest, none by more than 1e-2 of it) and that all other entries agree to a relative
    error ||a - b|| / ||a|| <= 1e-5."""
    x, y = (np.concatenate([v.ravel() for v in leaves(s)]) for s in (a, b))
    diff, scale = np.abs(x - y), np.abs(x).max()
    flipped = diff > 1e-5 * scale
    assert flipped.mean() <= 1e-3, f"{flipped.sum()} of {x.size} entries differ"
    assert diff.max() <= 1e-2 * scale, diff.max()
    assert np.linalg.norm(np.where(flipped, 0, x - y)) / np.linalg.norm(x) <= 1e-5


def one_line_error(err: str, *needles: str) -> None:
    """A CLI error as users must see it: one line, no traceback, saying each of `needles`."""
    lines = [line for line in err.strip().splitlines() if line.startswith("metatrain ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
