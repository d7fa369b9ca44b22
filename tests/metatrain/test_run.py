"""`metatrain.run.Run`: a finished run opened from its work dir, checked against the shared run's checkpoint read
directly with Orbax."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest
from helpers import leaves, saved_state

from metatrain import cli
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
    for get in (run.part, run.restored):  # an entry the checkpoint lacks: named with those it has (not a KeyError)
        with pytest.raises(DataError, match=r"has no 'meta_model' entry \(it has \['base', 'inner', 'meta'"):
            get("meta_model")


def test_opening_what_is_not_a_run_is_one_line(shared_run, tmp_path):
    with pytest.raises(DataError, match="no such directory"):
        Run.open(str(tmp_path / "missing"))
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(DataError, match="notes.txt: a file, not a directory; give a metatrain work dir"):
        Run.open(str(tmp_path / "notes.txt"))
    with pytest.raises(DataError, match="has no checkpoint"):
        Run.open(str(tmp_path))
    hf_model = "holds a Hugging Face model (config.json and safetensors weights); give it as hf:{} to `metatrain " \
               "generate`"
    for name, names, says in (  # as `export --format hf` (or `export`) writes them, and a sharded model
            ("hf", ["config.json", "model.safetensors"], hf_model.format(tmp_path / "hf")),
            ("sharded", ["config.json", "model.safetensors.index.json"], hf_model.format(tmp_path / "sharded")),
            ("adapters", ["adapter_config.json", "adapter_model.safetensors"], "holds LoRA adapters"),
            ("export", ["export.json"], "holds a model exported by `metatrain export` (export.json), not a run")):
        folder = tmp_path / name
        folder.mkdir()
        for name in names:
            (folder / name).write_text("{}")
        with pytest.raises(DataError, match="is not a metatrain run: it ") as e:
            Run.open(str(folder))
        assert says in str(e.value)
    copy = tmp_path / "copy"
    shutil.copytree(shared_run["workdir"], copy)
    os.remove(copy / "config.yaml")
    with pytest.raises(DataError, match="no config.yaml"):
        Run.open(str(copy))


def test_a_config_yaml_changed_after_the_run_is_one_line_before_anything_is_read(shared_run, tmp_path, capsys,
                                                                                monkeypatch):
    """A config.yaml edited after training (here d_model 16 -> 32) no longer builds the checkpoint's model: each
    command that reads the run says so in one line (it was Orbax's shape error from deep inside a restore, or, for
    `export`, an export dir whose export.json described another model than its parameters)."""
    from helpers import cli_run, one_line_error

    copy = tmp_path / "run"
    shutil.copytree(shared_run["workdir"], copy)
    text = (copy / "config.yaml").read_text()
    assert "  d_model: 16\n" in text
    (copy / "config.yaml").write_text(text.replace("  d_model: 16\n", "  d_model: 32\n", 1))
    monkeypatch.chdir(tmp_path)
    for argv in (["eval", "run"], ["export", "run", "--out", "exported"], ["scores", "run", "--out", "s.jsonl"],
                 ["generate", "run", "--prompt", "a", "--max-new-tokens", "1"]):
        code, _, err = cli_run(capsys, *argv)
        assert code == 2, err[-3000:]
        one_line_error(err, "checkpoint 4 does not match the run's config.yaml", "in the checkpoint, (",
                       "Put back the one the run wrote")
    assert sorted(os.listdir(tmp_path)) == ["run"]  # nothing written
    with pytest.raises(DataError, match="meta: .* has shape .*16.* in the checkpoint, .*32.* in config.yaml"):
        Run.open(str(copy)).part("meta")


def test_a_float64_run_is_refused_where_jax_would_read_it_as_float32(shared_run, tmp_path, capsys, monkeypatch):
    """A float64 run read where JAX's 64-bit mode is off (these test processes): Orbax restored its arrays as
    float32 and `eval`, `scores`, `filter` and `generate` computed in float32 without a word (only `export` refused).
    Each now says so in one line before anything is read or written. The run here is the shared run with its
    config.yaml saying float64: the check reads the config, not the arrays."""
    from helpers import cli_run, one_line_error

    copy = tmp_path / "run"
    shutil.copytree(shared_run["workdir"], copy)
    text = (copy / "config.yaml").read_text()
    assert "  param_dtype: float32\n" in text
    (copy / "config.yaml").write_text(text.replace("  param_dtype: float32\n", "  param_dtype: float64\n", 1))
    exported = tmp_path / "exported"  # an export dir of a float64 model, as `export` writes it under JAX_ENABLE_X64=1
    exported.mkdir()
    model = Run.open(str(shared_run["workdir"])).model
    info = {"kind": "meta-train", "what": "inner", "model": {**dataclasses.asdict(model), "param_dtype": "float64"}}
    (exported / "export.json").write_text(json.dumps(info))
    with pytest.raises(ConfigError, match="would be read and computed in float32"):
        Run.open(str(copy))
    assert Run.kind_of(str(copy)) == "meta-train"  # what `train` tells a run's kind by, whatever its dtypes
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "x = 1\n"}) + "\n")
    monkeypatch.chdir(tmp_path)
    for argv, where in ((["eval", "run"], "run"), (["scores", "run", "--out", "s.jsonl"], "run"),
                        (["filter", "run", "--data", "jsonl:docs.jsonl", "--drop", "0.5", "--out", "kept"], "run"),
                        (["generate", "run", "--prompt", "a", "--max-new-tokens", "1"], "run"),
                        (["generate", "exported", "--prompt", "a", "--max-new-tokens", "1"], "exported")):
        code, out, err = cli_run(capsys, *argv)
        assert code == 2, err[-3000:]
        one_line_error(err, f"{tmp_path / where}: model.param_dtype=float64 needs JAX's 64-bit mode, which is off: "
                            f"run with JAX_ENABLE_X64=1", "it would be read and computed in float32")
        assert "validation" not in out and "loss" not in out
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "exported", "run"]  # nothing written
    # float64 compute over float32 parameters: computed in float32 too; `export` (no compute) opens it
    (copy / "config.yaml").write_text(text.replace("  compute_dtype: ''\n", "  compute_dtype: float64\n", 1))
    with pytest.raises(ConfigError, match=r"run: model.compute_dtype=float64 needs JAX's 64-bit mode"):
        Run.open(str(copy))
    assert Run.open(str(copy), float32_means=None).cfg.model.compute_dtype == "float64"


@pytest.mark.slow
def test_a_pretrain_run_is_its_model(tmp_path, capsys):
    from helpers import train

    train(tmp_path / "base", "steps=1", "data.corrupt_fraction=0", command="pretrain")
    run = Run.open(str(tmp_path / "base"))
    assert run.kind == "pretrain" and set(run.saved) >= {"params"}
    with pytest.raises(ConfigError, match="pretrain run"):
        run.meta_training()
    assert cli.main(["compile", "--config", str(tmp_path / "base")]) == 2  # compile compiles meta-training's step
    assert "a `metatrain pretrain` run; compile compiles meta-training's outer step" in capsys.readouterr().err
    params = run.restored("params")
    batch = {"tokens": np.ones((2, 9), np.int32), "segment_ids": np.ones((2, 9), np.int32),
             "positions": np.tile(np.arange(9, dtype=np.int32), (2, 1))}
    losses = np.asarray(run.task.example_losses(params, batch))
    assert losses.shape == (2,) and np.isfinite(losses).all() and (losses > 0).all()
    # `metatrain eval` measures its one model: the token-weighted mean of each document's loss, evaluated alone here
    docs, seq = ["x = 1\n", "import os\n"], run.cfg.data.seq_len
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert cli.main(["eval", str(tmp_path / "base"), "--data", f"jsonl:{tmp_path / 'docs.jsonl'}"]) == 0
    printed = capsys.readouterr().out.splitlines()[-1].split()
    total = count = 0
    for doc in docs:
        ids = run.tokenizer().encode(doc)
        row = np.zeros((1, seq + 1), np.int32)
        row[0, :len(ids)] = ids
        alone = {"tokens": row, "segment_ids": (np.arange(seq + 1) < len(ids)).astype(np.int32)[None],
                 "positions": np.arange(seq + 1, dtype=np.int32)[None]}
        total += float(run.task.example_losses(params, alone)[0]) * (len(ids) - 1)
        count += len(ids) - 1
    assert printed[:2] == ["model", "loss"] and float(printed[2]) == pytest.approx(total / count, abs=1e-4)
