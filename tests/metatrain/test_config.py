"""What a run's config tells the user before anything compiles, and what it refuses."""

import os
import re

import pytest

from metatrain import config
from metatrain.errors import ConfigError


def test_many_blocks_as_straight_line_code_are_told_what_they_cost():
    """The main job's preset compiles its blocks as straight-line code (model.scan_layers=false, faster for its
    two); with more blocks that program grew until its compile took minutes and most of the memory (16 tiny blocks:
    78 s to start instead of 22 s as a loop; 200: 308 s and 24 GB), and nothing said why."""
    note = config.unrolled_note(config.load("default", ["model.n_layers=48"]))
    assert note.startswith("note: model.scan_layers=false compiles the model's 48 blocks as straight-line code")
    assert "model.scan_layers=true" in note
    assert config.unrolled_note(config.load("default", [])) is None  # the main job's two blocks
    assert config.unrolled_note(config.load("default", ["model.n_layers=48", "model.scan_layers=true"])) is None
    assert config.unrolled_note(config.load("maml", ["model.n_layers=48"])) is None  # presets that loop by default


def test_a_switch_takes_true_false_or_their_spellings_but_no_other_number(tmp_path):
    """OmegaConf reads any whole number as a bool (`model.remat=5`: true), which hides a key given a count by
    mistake; 0 and 1 and YAML's words for true and false stay as they were."""
    for value, read in [("1", True), ("0", False), ("yes", True), ("off", False), ("True", True)]:
        assert config.load("default", [f"model.remat={value}"]).model.remat is read
    preset = tmp_path / "mine.yaml"
    preset.write_text("model:\n  remat: 2\n")
    said = f"model.remat in {preset}: 2 is not true or false; write `remat: true` or `remat: false`"
    with pytest.raises(ConfigError, match=f"^{re.escape(said)}$"):
        config.load(str(preset))
    preset.write_text("model:\n  remat: 1\n")
    assert config.load(str(preset)).model.remat is True


def test_a_config_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """A run rewrites its config.yaml on every resume; killed while it did, the file was left cut short and the run
    could not resume. It is written beside and moved over at the end: stopped before that, the old one stays."""
    path = tmp_path / "run" / "config.yaml"
    config.write_text(str(path), "steps: 4\n")
    assert path.read_text() == "steps: 4\n"

    def killed(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        config.write_text(str(path), "steps: 8\n" * 1000)
    assert path.read_text() == "steps: 4\n" and os.listdir(path.parent) == ["config.yaml"]
