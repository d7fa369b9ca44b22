"""`metatrain pretrain`, `inner.init_from` and `metatrain export` on a tiny model."""

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import TINY, leaves, one_line_error, saved_state

from metatrain import cli


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    return out.out


def _validation(out):
    """(start, end) from the closing `validation loss: a -> b` line."""
    line = next(l for l in reversed(out.splitlines()) if l.startswith("validation loss: "))
    start, end = line.split(": ")[1].split(" -> ")
    return float(start), float(end)


@pytest.mark.slow
def test_pretrain_then_meta_train_from_it_then_export(tmp_path, capsys):
    base = tmp_path / "base"
    out = _run(capsys, "pretrain", *TINY, f"workdir={base}", "steps=3", "data.corrupt_fraction=0")
    assert "pretraining for 3 steps" in out
    start, pretrained = _validation(out)
    assert pretrained < start
    # both kinds of task start their inner model where pretraining ended: the same held-out loss
    for task in ("loss_weighting", "maml"):
        out = _run(capsys, "train", *TINY, f"task={task}", f"workdir={tmp_path / task}", f"inner.init_from={base}",
                   "steps=1", "baseline=uniform")
        assert f"inner model from {base}" in out and _validation(out)[0] == pretrained
    # `metatrain eval` of a run with a pretrained start also evaluates the starting model
    out = _run(capsys, "eval", str(tmp_path / "loss_weighting"), "--max-docs", "20")
    losses = {line.split(" loss ")[0].strip(): float(line.split(" loss ")[1].split()[0])
              for line in out.splitlines() if line.startswith("  ")}
    assert set(losses) == {"inner model (fine-tuned)", "uniform baseline", "starting model"}
    # one outer step: both inner models moved from the start, the learned run with η's initial (nearly uniform)
    # weights, the baseline with exactly uniform ones
    inner, baseline, start = (losses[k] for k in ("inner model (fine-tuned)", "uniform baseline", "starting model"))
    assert inner != start and baseline != start and inner != baseline and abs(inner - baseline) < 0.05
    # an export of the pretrained model holds its parameters, and inner.init_from reads them back
    assert cli.main(["export", str(base), "--out", str(tmp_path / "base_export")]) == 0
    from metatrain.export import load_params

    params = saved_state(base, 3)["params"]
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    for x, y in zip(leaves(load_params(str(tmp_path / "base_export"), target)), leaves(params)):
        np.testing.assert_array_equal(x, y)
    # a different model is refused before anything compiles, naming the parameter that does not fit
    code = cli.main(["train", *TINY, f"workdir={tmp_path / 'other'}", "model.d_model=32", f"inner.init_from={base}"])
    one_line_error(capsys.readouterr().err, "inner.init_from:", "does not hold parameters of this run's model",
                   "has shape")
    assert code == 2
    assert cli.main(["train", *TINY, f"workdir={tmp_path / 'x'}", f"inner.init_from={tmp_path / 'missing'}"]) == 2
    one_line_error(capsys.readouterr().err, "inner.init_from:", "is not a directory")
    # `train` in the pretrain run's work dir (a typo for `pretrain`, or for inner.init_from) is refused before it
    # compiles, naming the command that continues it
    for resume in ([], ["--resume"]):
        assert cli.main(["train", *TINY, f"workdir={base}", "steps=5", *resume]) == 2
        one_line_error(capsys.readouterr().err, f"workdir: {base} holds a `metatrain pretrain` run; continue it with "
                       "`metatrain pretrain`", f"inner.init_from={base} starts a meta-training run from it")


def test_pretrain_in_a_meta_training_runs_workdir_is_refused(shared_run, capsys):
    workdir = shared_run["workdir"]
    assert cli.main(["pretrain", *TINY, f"workdir={workdir}", "steps=9", "--resume"]) == 2
    one_line_error(capsys.readouterr().err, f"workdir: {workdir} holds a `metatrain train` run; continue it with "
                   "`metatrain train`, or give `metatrain pretrain` a new workdir")


def test_export_writes_the_meta_parameters(shared_run, tmp_path, capsys):
    run, out = shared_run["workdir"], tmp_path / "export"
    assert cli.main(["export", str(run), "--out", str(out)]) == 0
    info = json.load(open(out / "export.json"))
    assert info["kind"] == "meta-train" and info["step"] == 4 and info["model"]["vocab_size"] == 300
    with ocp.StandardCheckpointer() as ckptr:
        exported = ckptr.restore(os.path.abspath(out / "params"))
    for x, y in zip(leaves(exported), leaves(saved_state(run, 4)["meta"])):
        np.testing.assert_array_equal(x, y)
