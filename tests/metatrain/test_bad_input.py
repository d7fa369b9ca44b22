"""Bad input found by probing the newer surfaces (LoRA, the scorer, data sources, overrides): each is one line naming
the field or file and what to do, exit 2, before anything compiles; none is silently ignored."""

import json
import os

import pytest
from helpers import TINY, one_line_error

from metatrain import cli


def _write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.mark.parametrize("extra, needles", [
    (["inner.lora.targets=,"], ["inner.lora.targets:", "cannot be read as a value"]),  # not YAML
    (["inner.lora.rank=4", "inner.lora.targets=gate"], ["inner.lora.targets: gate adapts no weight"]),  # GELU MLP
    (["task=maml", "meta_model.preset=44m"], ["meta_model:", "task 'maml' has no meta model"]),  # was ignored
    (["meta_model.n_heads=3"], ["meta_model.d_model=16 is not divisible by meta_model.n_heads=3"]),
])
def test_settings_that_cannot_apply_are_refused(extra, needles, tmp_path, capsys):
    code = cli.main(["train", *TINY, *extra, f"workdir={tmp_path / 'run'}"])
    assert code == 2
    one_line_error(capsys.readouterr().err, *needles)


def test_a_source_with_no_text_is_refused_before_training(tmp_path, capsys):
    """Empty documents once made packing spin on end-of-text tokens for more than 10 minutes."""
    source = _write_jsonl(tmp_path / "empty.jsonl", [""] * 40)
    code = cli.main(["train", *TINY, f"data.source=jsonl:{source}", f"workdir={tmp_path / 'run'}"])
    assert code == 2
    one_line_error(capsys.readouterr().err, "hold no text", "data.text_field")


def test_dangling_links_in_a_dir_source_are_skipped_and_counted(tmp_path, capsys):
    from metatrain.data.sources import open_source

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(5):
        os.symlink(tmp_path / f"gone{i}", docs / f"link{i}.txt")
    code = cli.main(["train", *TINY, f"data.source=dir:{docs}", f"workdir={tmp_path / 'run'}"])
    assert code == 2
    one_line_error(capsys.readouterr().err, "no readable files", "5 dangling links")
    for i in range(3):
        (docs / f"doc{i}.txt").write_text(f"document {i}")
    source = open_source(f"dir:{docs}")
    assert len(source) == 3 and sorted(source.doc_id(i) for i in range(3)) == ["doc0.txt", "doc1.txt", "doc2.txt"]
    assert "skipped 5 dangling links or unreadable files of 8" in capsys.readouterr().err
