"""The configuration reference: every run-config key with its type, default and meaning, from the dataclasses.

A field's meaning is the comment on its line in the dataclass's source, or the comment lines right above it.
`python -m metatrain.reference` prints the page (docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import textwrap
import tokenize

from metatrain.config import Config

INTRO = """# Configuration reference

Every key of a run config (`metatrain train` / `pretrain`): give it as `key=value` on the command line, or in a
YAML preset (`configs/*.yaml`) or file. Made from the config dataclasses by `python -m metatrain.reference`; a test
checks that it lists every field and matches them. Whole numbers are 32-bit integers (at most 2147483647)
and the others finite: a value out of its range is refused in one line naming the key, before anything runs.
"""


def meanings(cls) -> dict[str, str]:
    """{field: meaning} from the comments in `cls`'s source."""
    source = textwrap.dedent(inspect.getsource(cls))
    out, above, line_of = {}, [], {}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    names = {f.name for f in dataclasses.fields(cls)}
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            owner = line_of.get(tok.start[0])
            if owner:  # a comment on a field's own line
                out[owner] = text
            else:
                above.append(text)
        elif tok.type == tokenize.NAME and tok.string in names and tok.start[1] == 4 and i + 1 < len(tokens) \
                and tokens[i + 1].string == ":":
            line_of[tok.start[0]] = tok.string
            if above:
                out[tok.string] = " ".join(above)
            above = []
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            if tok.start[0] not in line_of:
                above = []
    return out


def rows(default=None, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) for every leaf field of a config (default: `Config()`), in declaration order."""
    default = Config() if default is None else default
    out, meaning = [], meanings(type(default))
    for f in dataclasses.fields(default):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            out += rows(value, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, str(f.type), repr(value), meaning.get(f.name, "")))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def page() -> str:
    """The configuration reference as Markdown: one table per group."""
    groups: dict[str, list] = {}
    for key, kind, default, meaning in rows():
        groups.setdefault(key.rsplit(".", 1)[0] if "." in key else "", []).append((key, kind, default, meaning))
    text = [INTRO]
    for group, items in groups.items():
        text += [f"## {f'`{group}`' if group else 'Top level'}", "", "| key | type | default | meaning |",
                 "|---|---|---|---|"]
        text += [f"| `{k}` | `{_cell(t)}` | `{_cell(d)}` | {_cell(m)} |" for k, t, d, m in items]
        text.append("")
    return "\n".join(text)


if __name__ == "__main__":
    print(page(), end="")
