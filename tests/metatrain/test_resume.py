"""Runs continued and moved: exact resume after SIGKILL, 1 vs 8 devices, a checkpoint restored onto another mesh."""

import shutil
import signal
import time

import jax
import numpy as np
import pytest
from conftest import SHARED_RUN
from helpers import (
    FLOAT64,
    FLOAT64_ENV,
    TINY,
    assert_same_first_meta_gradient,
    assert_same_float64,
    checkpoints,
    leaves,
    metatrain,
    saved_float64_state,
    saved_state,
    train,
)

from metatrain import export
from metatrain.errors import ConfigError

pytestmark = pytest.mark.slow
NO_WANDB = "log.wandb=false"  # subprocess runs of the shared run's config log nowhere else


def test_exact_resume_after_sigkill_of_a_lora_population_run(tmp_path):
    """A LoRA run (θ = adapters on a frozen base, rebuilt at start-up rather than saved) of a population of two with
    staggered resets (lifetime 2: a member is reinitialised at every step) killed with SIGKILL resumes
    bit-identically to a run that was never stopped. Each on the two CPU devices `mesh.cpu_devices=2` splits the CPU
    into (the resume read its checkpoint before the split, which started JAX on one device)."""
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    lora = ("inner.lora.rank=4", "meta_model.n_layers=1",  # and a one-layer scorer
            "population.size=2", "population.lifetime=2", "mesh.cpu_devices=2")
    proc = metatrain("train", *TINY, *lora, "baseline=uniform", f"workdir={killed}", "steps=1000", "checkpoint_every=3",
                     background=True, devices=None)
    deadline = time.time() + 300
    while not checkpoints(killed):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    latest = checkpoints(killed)[-1]
    assert latest < 1000
    target = latest + 3
    out = train(killed, f"steps={target}", resume=True, devices=None)
    assert f"from step {latest}" in out and "2x1 (data x fsdp) cpu devices" in out
    res = metatrain("train", *TINY, *lora, "baseline=uniform", f"workdir={straight}", f"steps={target}",
                    "checkpoint_every=3", devices=None)
    assert res.returncode == 0, res.stderr[-3000:]
    for step in range(1, target):  # the staggered resets are logged: member 1 at odd steps, member 0 at even
        assert f"step {step + 1}: population member {step % 2} reinitialised" in res.stderr
    a, b = saved_state(killed, target), saved_state(straight, target)
    assert jax.tree.leaves(a["inner"])[0].shape[0] == 2  # two members' adapters
    assert "frozen" not in a and all("lora_" in jax.tree_util.keystr(p)
                                     for p, _ in jax.tree_util.tree_flatten_with_path(a["inner"][0])[0])
    for key in ("meta", "inner", "base"):
        for x, y in zip(leaves(a[key]), leaves(b[key])):
            np.testing.assert_array_equal(x, y)  # bit-identical


def test_eight_devices_agree_with_one_and_restore_onto_one(tmp_path):
    """A float64 run on 1 device against the same run on 8 devices (mesh 4x2; the CPU split by `mesh.cpu_devices`),
    and against a run whose step-2 checkpoint, written on 8 devices, is resumed on 1: the same numbers up to the
    order of float64 reductions (`assert_same_float64`), on any machine."""
    one, eight, moved = tmp_path / "one", tmp_path / "eight", tmp_path / "moved"
    run = [*SHARED_RUN, *FLOAT64, NO_WANDB]
    for workdir, devices, extra in ((one, 1, ()), (eight, None, ("mesh.fsdp=2", "mesh.cpu_devices=8"))):
        out = metatrain("train", *run, f"workdir={workdir}", *extra, devices=devices, extra_env=FLOAT64_ENV)
        assert out.returncode == 0, out.stderr[-3000:]
    assert "4x2 (data x fsdp) cpu devices" in out.stdout
    assert_same_first_meta_gradient(one, eight)
    reference = saved_float64_state(one, 4)
    for key in ("meta", "inner", "base"):
        assert_same_float64(reference[key], saved_float64_state(eight, 4)[key], f"8 devices, {key}")
    shutil.copytree(eight, moved)
    shutil.rmtree(moved / "checkpoints" / "4")
    res = metatrain("train", *TINY, *FLOAT64, f"workdir={moved}", "steps=4", "mesh.fsdp=1", NO_WANDB, "--resume",
                    extra_env=FLOAT64_ENV)  # the saved config says fsdp=2
    assert res.returncode == 0 and "from step 2" in res.stdout, res.stderr[-3000:]
    for key in ("meta", "inner", "base"):
        assert_same_float64(reference[key], saved_float64_state(moved, 4)[key], f"8 devices -> 1, {key}")
    # exported where JAX's 64-bit mode is off (this process), the float64 run is refused: the export held float32
    # parameters under an export.json saying float64
    with pytest.raises(ConfigError, match=r"model.param_dtype=float64 needs JAX's 64-bit mode, which is off: run with "
                                          r"JAX_ENABLE_X64=1 .* without it the export would hold float32 parameters"):
        export.export(str(one), str(tmp_path / "exported"))
    assert not (tmp_path / "exported").exists()

