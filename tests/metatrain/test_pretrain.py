"""`metatrain pretrain`, `inner.init_from` and `metatrain export` on a tiny model."""

import json
import os

import numpy as np
import orbax.checkpoint as ocp

from metatrain import cli

from helpers import TINY, leaves, saved_state
from test_trainer import _train


def _validation(out):
    """(start, end) from the closing `validation loss: a -> b` line."""
    start, end = out.strip().splitlines()[-1].split(": ")[1].split(" -> ")
    return float(start), float(end)


def test_pretrain_then_meta_train_from_it(tmp_path):
    base = tmp_path / "base"
    out = _train(base, "steps=3", "data.corrupt_fraction=0", command="pretrain")
    assert "pretraining for 3 steps" in out
    start, pretrained = _validation(out)
    assert pretrained < start
    # both kinds of task start their inner model where pretraining ended: same held-out loss
    for task in ("loss_weighting", "maml"):
        out = _train(tmp_path / task, f"task={task}", f"inner.init_from={base}", "steps=1")
        assert f"inner model from {base}" in out
        assert _validation(out)[0] == pretrained
    exported = cli.main(["export", str(base), "--out", str(tmp_path / "base_export")])
    assert exported == 0
    out = _train(tmp_path / "from_export", f"inner.init_from={tmp_path / 'base_export'}", "steps=1")
    assert _validation(out)[0] == pretrained


def test_init_from_a_different_model_is_a_clear_error(tmp_path, capsys):
    base = tmp_path / "base"
    _train(base, "steps=1", command="pretrain")
    code = cli.main(["train", *TINY, f"workdir={tmp_path / 'run'}", "model.d_model=32", f"inner.init_from={base}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "does not hold parameters of this run's model" in err and "\n" not in err
    code = cli.main(["train", *TINY, f"workdir={tmp_path / 'run2'}", f"inner.init_from={tmp_path / 'missing'}"])
    assert code == 2 and "inner.init_from:" in capsys.readouterr().err


def test_export_writes_the_meta_parameters(tmp_path, capsys):
    run = tmp_path / "run"
    _train(run, "steps=2")
    assert cli.main(["export", str(run)]) == 0
    out = run / "export"
    info = json.load(open(out / "export.json"))
    assert info["kind"] == "meta-train" and info["step"] == 2 and info["model"]["vocab_size"] == 300
    with ocp.StandardCheckpointer() as ckptr:
        exported = ckptr.restore(os.path.abspath(out / "params"))
    for x, y in zip(leaves(exported), leaves(saved_state(run, 2)["meta"])):
        np.testing.assert_array_equal(x, y)
    assert cli.main(["export", str(tmp_path / "nothing")]) == 2
    assert "error:" in capsys.readouterr().err
