"""What a run's config tells the user before anything compiles."""

from metatrain import config


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
