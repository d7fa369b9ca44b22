"""mkdocs hooks: the package as installed (`metatrain.models` is `models/`, ...), laid out for mkdocstrings to read;
and the Command line page's sections, written from the command line's parser.

pyproject.toml maps `models/`, `data/`, `launch/` and `configs/` into the `metatrain` package; mkdocstrings reads
sources from disk, so it gets a tree of links with that layout, under the site's build folder.
"""

import os
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "api-sources"
CLI_MARKER = "<!-- metatrain-cli-reference -->"


def _lay_out() -> None:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = TREE / "metatrain"
    package.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / "metatrain").iterdir():
        _link(entry, package / entry.name)
    for name, folder in mapping.items():
        if name != "metatrain":
            _link(ROOT / folder, package / name.split(".", 1)[1])


def _link(target: Path, link: Path) -> None:
    if link.is_symlink() or link.exists():
        if link.is_symlink() and os.readlink(link) == str(target):
            return
        link.unlink()
    link.symlink_to(target)


# At import, when mkdocs loads its hooks: mkdocstrings checks its `paths` in its own on_config, which runs first.
_lay_out()


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    """cli.md's marker becomes every command's `--help` (`metatrain.cli.help_page`)."""
    if page.file.src_uri != "cli.md":
        return markdown
    from metatrain.cli import help_page

    assert CLI_MARKER in markdown, f"docs/cli.md lost its marker {CLI_MARKER}"
    return markdown.replace(CLI_MARKER, help_page.markdown())
