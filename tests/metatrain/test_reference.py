"""The configuration reference lists every field of the run config, with a meaning, and docs/configuration.md is the
page made from today's dataclasses."""

from pathlib import Path

from metatrain import config, reference

ROOT = Path(__file__).resolve().parents[2]


def test_every_field_is_listed_with_a_meaning():
    listed = {key: meaning for key, _, _, meaning in reference.rows()}
    assert list(listed) == list(config.flatten(config.Config()))
    assert not [key for key, meaning in listed.items() if not meaning.strip()]
    page = reference.page()
    assert all(f"| `{key}` |" in page for key in listed)


def test_the_docs_page_is_current():
    """Regenerate it with `python -m metatrain.reference > docs/configuration.md`."""
    assert (ROOT / "docs" / "configuration.md").read_text() == reference.page()


def test_defaults_are_the_run_configs():
    """Nested defaults are those of `Config()` (its model is not `ModelConfig()`'s)."""
    defaults = dict((key, default) for key, _, default, _ in reference.rows())
    flat = config.flatten(config.Config())
    assert all(defaults[key] == repr(value) for key, value in flat.items())
