"""Paths as users give them: relative to where the command runs, or under `~`. Every path a run config names is
made absolute once, where it is loaded, and the commands that take paths accept relative ones."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from helpers import leaves, saved_state

from metatrain import cli, config, models, paths
from metatrain.export import load_params


def test_a_run_config_names_every_path_absolutely(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for d in ("base", "home/scorer", "docs", "home/tok"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "home/scorer/export.json").write_text(json.dumps({"model": dataclasses.asdict(models.preset("tiny"))}))
    cfg = config.load("default", ["workdir=runs/x", "inner.init_from=base", "meta_model.init_from=~/scorer",
                                  "data.source=jsonl:docs/*.jsonl", "data.outer_source=dir:~/trusted",
                                  "data.tokenizer=hf:~/tok", "data.data_dir=tfds", "data.chat_template=t.jinja"],
                      pretrained=False)
    assert cfg.workdir == str(tmp_path / "runs" / "x")
    assert cfg.inner.init_from == str(tmp_path / "base")
    assert cfg.meta_model.init_from == str(tmp_path / "home" / "scorer")
    assert cfg.data.source == f"jsonl:{tmp_path}/docs/*.jsonl"
    assert cfg.data.outer_source == f"dir:{tmp_path}/home/trusted"
    assert cfg.data.tokenizer == f"hf:{tmp_path}/home/tok"
    assert cfg.data.chat_template == str(tmp_path / "t.jinja")  # generate --chat reads it from any folder
    assert cfg.data.data_dir == str(tmp_path / "tfds")
    # what is not a local path stays as it is
    cfg = config.load("default", ["inner.init_from=hf:base", "workdir=gs://bucket/run"], pretrained=False)
    assert cfg.inner.init_from == f"hf:{tmp_path}/base" and cfg.workdir == "gs://bucket/run"
    assert cfg.data.source == "builtin" and cfg.data.tokenizer == config.Config().data.tokenizer
    assert paths.local("") == "" and paths.local("  ") == "  " and paths.local(None) is None


def test_an_export_dir_given_relative_is_read(shared_run, tmp_path, monkeypatch):
    """The break users hit: `metatrain export RUN --out base` then `inner.init_from=base` read the relative export
    dir through Orbax's metadata(), which returned no tree for a relative path (AttributeError)."""
    monkeypatch.chdir(tmp_path)
    os.symlink(shared_run["workdir"], "run")
    assert cli.main(["export", "run", "--what", "inner", "--out", "base"]) == 0
    theta = saved_state(shared_run["workdir"], 4)["inner"][0]
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), theta)
    for x, y in zip(leaves(load_params("base", target)), leaves(theta)):
        np.testing.assert_array_equal(x, y)


def test_a_write_a_full_disk_refused_names_the_output_and_leaves_nothing(tmp_path):
    """A full disk fails `f.write` with an OSError that names no file; the command's one line names its output."""
    import errno

    out = tmp_path / "new" / "scores.jsonl"
    with pytest.raises(OSError) as raised, paths.staged_file(str(out)) as tmp:
        open(tmp, "w").close()
        raise OSError(errno.ENOSPC, "No space left on device")
    assert raised.value.filename == str(out) and raised.value.errno == errno.ENOSPC
    assert not (tmp_path / "new").exists()
    with pytest.raises(OSError) as raised, paths.filled_dir(str(tmp_path / "dir")):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert raised.value.filename == str(tmp_path / "dir") and not (tmp_path / "dir").exists()


@pytest.mark.parametrize("staged", [paths.staged_file, paths.filled_dir])
def test_a_stop_as_the_folders_are_made_leaves_none_of_them(tmp_path, monkeypatch, staged):
    """A signal right after the folders for an output are made (before the block that fills them) left them there."""
    real = os.makedirs

    def makedirs(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(paths.os, "makedirs", makedirs)
    target = tmp_path / "new" / "deeper" / ("out.jsonl" if staged is paths.staged_file else "out")
    with pytest.raises(KeyboardInterrupt), staged(str(target)):
        pass
    assert list(tmp_path.iterdir()) == []
