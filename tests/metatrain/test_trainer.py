"""The Trainer end to end on a tiny model: bad configs, exact resume after SIGKILL, 1 vs 8 devices, bad steps."""

import json
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY, assert_same_params, leaves, saved_state
from metatrain import cli
from metatrain.tasks import LossWeighting



def _train(workdir, *extra, devices=1, resume=False, background=False, command="train"):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    cmd = [sys.executable, "-m", "metatrain.cli", command, *TINY, f"workdir={workdir}", *extra]
    if resume:
        cmd.append("--resume")
    if background:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def _checkpoints(workdir):
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def test_exact_resume_after_sigkill(tmp_path):
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    proc = _train(killed, "steps=1000", "checkpoint_every=3", background=True)
    deadline = time.time() + 300
    while not _checkpoints(killed):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    latest = _checkpoints(killed)[-1]
    assert latest < 1000
    target = latest + 3
    out = _train(killed, f"steps={target}", resume=True)
    assert "resuming the run" in out
    _train(straight, f"steps={target}")
    a, b = saved_state(killed, target), saved_state(straight, target)
    for key in ("meta", "inner"):
        for x, y in zip(leaves(a[key]), leaves(b[key])):
            np.testing.assert_array_equal(x, y)  # bit-identical


def test_one_device_and_eight_devices_agree(tmp_path):
    one, eight = tmp_path / "one", tmp_path / "eight"
    _train(one, "steps=3", "checkpoint_every=0")
    out = _train(eight, "steps=3", "checkpoint_every=0", "mesh.fsdp=2", devices=8)
    assert "4x2 (data x fsdp) devices" in out
    a, b = saved_state(one, 3), saved_state(eight, 3)
    for key in ("meta", "inner"):
        assert_same_params(a[key], b[key])


def test_restore_onto_a_different_mesh(tmp_path):
    """A checkpoint written on 8 devices (mesh 4x2) resumes on 1 and lands where a 1-device run does."""
    moved, straight = tmp_path / "moved", tmp_path / "straight"
    _train(moved, "steps=2", "checkpoint_every=0", "mesh.fsdp=2", devices=8)
    _train(moved, "steps=4", "checkpoint_every=0", "mesh.fsdp=1", resume=True)  # the saved config says fsdp=2
    _train(straight, "steps=4", "checkpoint_every=0")
    a, b = saved_state(moved, 4), saved_state(straight, 4)
    for key in ("meta", "inner"):
        assert_same_params(a[key], b[key])


def _tensorboard_scalars(logdir):
    """{tag: [(step, value)]} read from the TFRecord-framed Event protos tensorboardX wrote."""
    import struct

    from tensorboardX.proto import event_pb2

    scalars = {}
    for name in os.listdir(logdir):
        data = open(os.path.join(logdir, name), "rb").read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
    return scalars


def test_main_job_lines(tmp_path):
    out = _train(tmp_path / "run", "steps=4", "baseline=uniform", "mode=auto", "inner_checkpoint=auto")
    choice = json.loads((tmp_path / "run" / "mode_auto.json").read_text())  # auto: the lowest peak wins
    peaks = {name: c["peak_bytes"] for name, c in choice["candidates"].items()}
    assert set(peaks) == {f"{m}+{s}" for m in ("default", "mixflow", "revfwd") for s in ("every_step", "sqrt")}
    assert peaks[f"{choice['mode']}+{choice['inner_checkpoint']}"] <= 1.01 * min(peaks.values())
    lines = out.strip().splitlines()
    assert lines[-1].startswith("validation loss: ") and " -> " in lines[-1]
    assert any(line.startswith("baseline validation loss: ") for line in lines)
    auc = float(next(line for line in lines if line.startswith("corrupted-example AUC: ")).split(": ")[1])
    assert 0.0 <= auc <= 1.0
    assert os.path.exists(tmp_path / "run" / "curves.png") and os.path.exists(tmp_path / "run" / "metrics.jsonl")
    scalars = _tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert [step for step, _ in scalars["outer_loss"]] == [1, 2, 3, 4]
    assert all(np.isfinite(v) for _, v in scalars["meta_grad_norm"])


class NaNOuterLoss(LossWeighting):
    def outer_loss(self, theta, meta, batch):
        return super().outer_loss(theta, meta, batch) * jnp.nan


def test_non_finite_meta_gradients_are_skipped_then_stop(tmp_path, capsys):
    workdir = tmp_path / "nan"
    code = cli.main(["train", *TINY, f"task={__name__}:NaNOuterLoss", f"workdir={workdir}", "steps=10",
                     "max_bad_steps=3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "3 non-finite gradients or losses in a row at step 3" in err and "last good checkpoint" in err


@pytest.mark.parametrize("override, message", [
    ("model.dmodel=3", "model.dmodel: Key 'dmodel' not in 'ModelConfig'"),
    ("steps=abc", "steps: Value 'abc' of type 'str' could not be converted to Integer"),
    ("mesh.data=3", "mesh: data=3 x fsdp=1 does not divide the 1 devices"),
    ("task=nowhere.module:Task", "task: task 'nowhere.module:Task': cannot import module"),
    ("mode=fast", "mode: 'fast' is not one of"),
    ("data.seq_len=0", "data.seq_len must be > 0"),
])
def test_bad_configs_are_one_line_errors(tmp_path, capsys, override, message):
    assert cli.main(["train", *TINY, f"workdir={tmp_path}", override]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_batch_must_divide_the_data_axis(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    res = subprocess.run([sys.executable, "-m", "metatrain.cli", "train", *TINY, f"workdir={tmp_path}",
                          "data.batch=6"], env=env, capture_output=True, text=True)
    assert res.returncode == 2
    assert "data.batch: 6 does not divide over the 4 data x fsdp devices" in res.stderr
    assert "Traceback" not in res.stderr


def test_resume_needs_a_checkpoint(tmp_path, capsys):
    assert cli.main(["train", *TINY, f"workdir={tmp_path}", "--resume"]) == 2
    assert "has no checkpoint to resume from" in capsys.readouterr().err
