"""`metatrain.run.Run`: a finished run opened from its work dir, checked against the shared run's checkpoint read
directly with Orbax."""

import os
import shutil

import jax
import numpy as np
import pytest
from helpers import leaves, saved_state

from metatrain.errors import ConfigError, DataError
from metatrain.run import Run


def test_a_run_hands_out_its_config_step_and_saved_state(shared_run, monkeypatch):
    workdir = shared_run["workdir"]
    monkeypatch.chdir(workdir.parent)
    run = Run.open("run")  # a relative path, as a user gives it
    assert run.workdir == str(workdir) and run.kind == "meta-train" and run.step == 4
    assert run.cfg.task == "loss_weighting" and run.meta_training() is run
    assert run.model.vocab_size == run.tokenizer().vocab_size  # the model the Trainer built, not the config's 1024
    saved = saved_state(workdir, 4)
    for key in ("meta", "inner", "base"):
        for got in (run.part(key), run.restored(key)):  # as saved, and in the program's structure
            for x, y in zip(leaves(got), leaves(saved[key]), strict=True):
                np.testing.assert_array_equal(x, y)
    meta = run.restored("meta")
    assert jax.tree.structure(meta) == jax.tree.structure(run.shapes["meta"])
    assert list(jax.tree.leaves(meta)[0].devices()) == [jax.local_devices()[0]]


def test_opening_what_is_not_a_run_is_one_line(shared_run, tmp_path):
    with pytest.raises(DataError, match="no such directory"):
        Run.open(str(tmp_path / "missing"))
    with pytest.raises(DataError, match="has no checkpoint"):
        Run.open(str(tmp_path))
    copy = tmp_path / "copy"
    shutil.copytree(shared_run["workdir"], copy)
    os.remove(copy / "config.yaml")
    with pytest.raises(DataError, match="no config.yaml"):
        Run.open(str(copy))


@pytest.mark.slow
def test_a_pretrain_run_is_its_model(tmp_path):
    from helpers import train

    train(tmp_path / "base", "steps=1", "data.corrupt_fraction=0", command="pretrain")
    run = Run.open(str(tmp_path / "base"))
    assert run.kind == "pretrain" and set(run.saved) >= {"params"}
    with pytest.raises(ConfigError, match="pretrain run"):
        run.meta_training()
    params = run.restored("params")
    batch = {"tokens": np.ones((2, 9), np.int32), "segment_ids": np.ones((2, 9), np.int32),
             "positions": np.tile(np.arange(9, dtype=np.int32), (2, 1))}
    losses = np.asarray(run.task.example_losses(params, batch))
    assert losses.shape == (2,) and np.isfinite(losses).all() and (losses > 0).all()
