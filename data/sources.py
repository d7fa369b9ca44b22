"""Document sources: random-access texts with ids, for Grain and for `metatrain scores` / `eval`.

`open_source(spec, cfg)` maps a `data.source` / `data.outer_source` string to a source:

    builtin          the built-in corpus (the standard library's .py files)
    tfds:NAME        a TFDS dataset (`tfds.data_source`; `metatrain data build` makes one from text files)
    jsonl:PATH       JSON lines, one document per line (PATH may be a glob); text in `data.text_field`
    parquet:PATH     Parquet files (PATH may be a glob); text in the column `data.text_field`
    dir:PATH         a directory of text files, one document per file (walked recursively, sorted)
    hf-disk:PATH     a Hugging Face `datasets` dataset saved with `save_to_disk` (read from its Arrow files)

Every source has `len`, `source[i]` and `source.doc_id(i)`: the user's id (`data.id_field` when the records have
it; else the line / row number, or the file's path relative to the dir), so learned weights map back to
documents. `source[i]` is text, or for JSON lines and tables of conversations (`data.format`, see `formats`) a
message list or a prompt and completion. Problems (a missing path, no documents, a missing field, a record that
is not a document) are one-line `DataError`s naming the source and the record.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from typing import Any, Protocol

import numpy as np

from metatrain.data.corpus import FileDocuments, builtin_corpus_files, refuse_non_utf8
from metatrain.data.formats import PAIR, Fields
from metatrain.errors import ConfigError, DataError
from metatrain.paths import read_json

KINDS = ("builtin", "tfds:", "jsonl:", "parquet:", "dir:", "hf-disk:")


class Source(Protocol):
    """What every source gives (see the module docstring)."""

    fields: Fields

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Any: ...

    def doc_id(self, i: int) -> Any: ...

    def where(self, i: int) -> str: ...


class Plain:
    """A source of plain text (files, TFDS): its documents are text; `where(i)` names document i."""

    fields = Fields("text")

    def where(self, i: int) -> str:
        files = getattr(self, "files", None)
        return files[int(i)] if files is not None else f"document {self.doc_id(i)}"


class Indexed(Plain):
    """Document i is its index; the base of the sources without ids of their own."""

    def doc_id(self, i: int):
        return int(i)


class Builtin(FileDocuments, Indexed):
    pass


PATH_SOURCES = ("jsonl:", "parquet:", "dir:", "hf-disk:")  # the kinds of source that name a path after them


def missing_path(spec: str) -> str | None:
    """Why `spec` cannot be read where it is a kind that names a path (`jsonl:`, ...) without one (as an empty shell
    variable after the kind leaves it), else None: the end of an error line."""
    kind, colon, rest = spec.strip().partition(":")
    if kind + colon in PATH_SOURCES and not rest.strip():
        return f"'{kind}:' names no path; write {kind}:PATH"
    return None


def _files(kind: str, pattern: str) -> list[str]:
    if why := missing_path(f"{kind}:{pattern}"):
        raise DataError(f"data source {why}")
    pattern = os.path.expanduser(pattern)
    files = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        what = "matches no file" if any(c in pattern for c in "*?[") else "is not a file"
        raise DataError(f"data source {kind}:{pattern}: {pattern!r} {what}")
    for path in files:
        refuse_non_utf8(path, f"data source {kind}:{pattern}")
    return files


class JsonLines:
    """JSON lines, read on demand: one pass at open validates every record and keeps byte offsets and ids."""

    def __init__(self, pattern: str, fields: Fields, id_field: str):
        self.files, self.fields = _files("jsonl", pattern), fields
        file_index, offsets, lines, ids = [], [], [], []
        for k, path in enumerate(self.files):
            with open(path, "rb") as f:
                line_no, offset = 0, 0
                for raw in f:
                    line_no += 1
                    start, offset = offset, offset + len(raw)
                    if not raw.strip():
                        continue
                    record, where = json_record(raw, path, line_no), f"{path}:{line_no}"
                    self.fields = fields = fields.detect(record, where)
                    fields.value(record, where)
                    given = record.get(id_field)
                    ids.append(given if given is not None else
                               (line_no if len(self.files) == 1 else f"{os.path.basename(path)}:{line_no}"))
                    file_index.append(k)
                    offsets.append(start)
                    lines.append(line_no)
        if not offsets:
            raise DataError(f"data source jsonl:{pattern}: no documents (the file(s) hold no JSON lines)")
        self.file_index, self.offsets, self.lines, self.ids = (np.asarray(file_index), np.asarray(offsets, np.int64),
                                                               np.asarray(lines), ids)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int):
        path = self.files[int(self.file_index[i])]
        with open(path, "rb") as f:
            f.seek(int(self.offsets[i]))
            return self.fields.value(json.loads(f.readline()), self.where(i))

    def doc_id(self, i: int):
        return self.ids[int(i)]

    def where(self, i: int) -> str:
        """The file and line of document i, for messages."""
        return f"{self.files[int(self.file_index[i])]}:{int(self.lines[i])}"


def json_record(raw: bytes, path: str, line_no: int) -> dict:
    """One JSONL line as a dict; anything else is one line naming the file and line."""
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}:{line_no}: not a JSON line ({str(e).splitlines()[0]})") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{line_no}: a JSON {type(record).__name__}, not an object with a text field")
    return record


class Table:
    """Arrow tables (Parquet files or a saved `datasets` dataset): a document's column(s) and an optional id column.
    Text is a string column; messages, prompts and completions are read as Python values."""

    def __init__(self, name: str, table, fields: Fields, id_field: str):
        if table.num_rows == 0:
            raise DataError(f"data source {name}: no documents (0 rows)")
        self.name = name
        self.fields = fields = table_fields(table.schema, fields, f"data source {name}")
        for column in fields.columns():
            values = table.column(column)
            if values.null_count:
                row = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
                raise DataError(f"data source {name}: row {row}: column {column!r} is null"
                                + (", not text" if fields.format == "text" else ""))
        self.columns = {c: table.column(c) for c in fields.columns()}
        self.ids = table.column(id_field).to_pylist() if id_field in table.column_names else None

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int):
        record = {c: values[int(i)].as_py() for c, values in self.columns.items()}
        return record[self.fields.text_field] if self.fields.format == "text" else self.fields.value(record,
                                                                                                    self.where(i))

    def doc_id(self, i: int):
        return self.ids[int(i)] if self.ids is not None else int(i)

    def where(self, i: int) -> str:
        return f"data source {self.name}: row {int(i)}"


def table_fields(schema, fields: Fields, where: str) -> Fields:
    """The document fields of Arrow data with `schema` (a table, or a Parquet file read by row groups): its format
    found as a JSON record's, its document columns there, a text column holding strings. `where` (the source, or
    the file) starts each error."""
    fields = fields.detect({c: _placeholder(schema.field(c).type) for c in schema.names}, where)
    hint = {"text": "name the text column with data.text_field (--text-field in scores, eval, filter and "
            "data stats)", "chat": "name the chat column with "
            "data.messages_field", "prompt_completion": "data.format=prompt_completion needs both columns, "
            "'prompt' and 'completion'"}[fields.format]
    for column in fields.columns():
        if column not in schema.names:
            raise DataError(f"{where}: no column {column!r} (columns: {schema.names[:8]}); {hint}")
    if fields.format == "text":
        kind = schema.field(fields.text_field).type
        if not _is_text(kind):
            raise DataError(f"{where}: column {fields.text_field!r} is {kind}, not text")
    return fields


def _is_text(arrow_type) -> bool:
    """Whether a column of this type holds strings: plain, large or view, or dictionary-encoded (a pandas
    Categorical written to Parquet)."""
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):
        return _is_text(arrow_type.value_type)
    view = getattr(pa.types, "is_string_view", lambda t: False)  # pyarrow >= 16
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or view(arrow_type)


def _placeholder(arrow_type):
    """A stand-in value of a column's type, so that a table's format is found as a JSON record's is."""
    import pyarrow as pa

    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return []
    return "" if _is_text(arrow_type) else None


def parquet(pattern: str, fields: Fields, id_field: str) -> Table:
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = _files("parquet", pattern)
    tables = []
    for path in files:
        try:
            schema = pq.read_schema(path)
            wanted = fields.columns() if fields.format else [fields.text_field, fields.messages_field, *PAIR]
            columns = [c for c in (*wanted, id_field) if c in schema.names] or None
            tables.append(pq.read_table(path, columns=columns))
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{path}: not a Parquet file ({str(e).splitlines()[0][:160]})") from None
    try:
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    except pa.ArrowInvalid as e:
        raise DataError(f"data source parquet:{pattern}: the files' columns differ ({str(e)[:160]})") from None
    return Table(f"parquet:{pattern}", table, fields, id_field)


def hf_disk(path: str, split: str, fields: Fields, id_field: str) -> Table:
    """A dataset written by `datasets`' `save_to_disk`: state.json names its Arrow stream files (a DatasetDict
    keeps one such dataset per split, chosen by `data.split`). Memory-mapped; no `datasets` needed."""
    import pyarrow as pa

    name = f"hf-disk:{path}"
    if not os.path.isdir(path):
        raise DataError(f"data source {name}: {path!r} is not a directory")
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = read_json(os.path.join(path, "dataset_dict.json"), "saved DatasetDict's dataset_dict.json").get(
            "splits", [])
        if split not in splits:
            raise DataError(f"data source {name}: no split {split!r} (it has {splits}); choose one with data.split")
        path = os.path.join(path, split)
    state = os.path.join(path, "state.json")
    if not os.path.isfile(state):
        raise DataError(f"data source {name}: no state.json in {path}; save the dataset with "
                        f"`dataset.save_to_disk(PATH)`")
    try:
        files = [os.path.join(path, d["filename"]) for d in read_json(state, "saved dataset's state.json").get(
            "_data_files", [])]
    except (KeyError, TypeError):
        raise DataError(f"{state}: its _data_files entries name no 'filename'; save the dataset again") from None
    tables = []
    for file in files:
        try:
            tables.append(pa.ipc.open_stream(pa.memory_map(file)).read_all())
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{file}: not an Arrow file of a saved dataset ({str(e).splitlines()[0][:160]})") from None
    if not tables:
        raise DataError(f"data source {name}: state.json lists no data files")
    return Table(name, pa.concat_tables(tables) if len(tables) > 1 else tables[0], fields, id_field)


class TextDir(FileDocuments, Plain):
    """One document per file under a directory (hidden files and folders skipped); the id is the relative path."""

    def __init__(self, root: str):
        if not os.path.isdir(root):
            raise DataError(f"data source dir:{root}: {root!r} is not a directory")
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = sorted(x for x in dirs if not x.startswith("."))
            files += [os.path.join(d, n) for n in sorted(names) if not n.startswith(".")]
        readable = [f for f in files if os.path.isfile(f) and os.access(f, os.R_OK)]  # not dangling links
        if not readable:
            raise DataError(f"data source dir:{root}: no files under {root!r}" if not files else
                            f"data source dir:{root}: no readable files under {root!r} ({len(files)} dangling links or "
                            "unreadable files)")
        if len(readable) < len(files):
            print(f"metatrain: warning: data source dir:{root}: skipped {len(files) - len(readable)} dangling links "
                  f"or unreadable files of {len(files)}", file=sys.stderr)
        super().__init__(readable)
        self.root = root

    def __getitem__(self, i: int) -> str:
        try:
            with open(self.files[i], encoding="utf-8") as f:
                return f.read()
        except UnicodeDecodeError:
            refuse_non_utf8(self.files[i], f"data source dir:{self.root}")
            raise DataError(f"{self.files[i]}: not UTF-8 text (data source dir:{self.root})") from None

    def doc_id(self, i: int):
        return os.path.relpath(self.files[int(i)], self.root)


class Tfds(Indexed):
    def __init__(self, source):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> str:
        return self.source[i]


def _tfds_name(spec: str) -> bool:
    """Whether a source without a kind reads as a TFDS name (`c4`, `c4/en`, `c4/en:3.0.1`, `mnist:3.*.*`) or a path
    (refused later, with a hint), rather than an unknown kind (`s3:bucket`, `gs://bucket/x`, `hf:org/name`)."""
    _, colon, version = spec.partition(":")
    return not colon or re.fullmatch(r"[\d*]+(\.[\d*]+)*", version) is not None


def open_source(spec: str, *, split: str = "train", data_dir: str | None = None, text_field: str = "text",
                id_field: str = "id", format: str = "", messages_field: str = "messages") -> Source:
    """The document source named by `spec`: a random-access sequence of documents with ids.

    Args:
      spec: `builtin`, `tfds:NAME`, `jsonl:PATH`, `parquet:PATH`, `dir:PATH` or `hf-disk:PATH` (PATH may be a glob
        for jsonl and parquet).
      split: the TFDS split, or a saved `DatasetDict`'s split.
      data_dir: the TFDS data dir.
      text_field: the field or column holding a document's text.
      id_field: the field or column holding its id (when absent: the line or row number).
      format: `text`, `chat` or `prompt_completion` (see `formats`); "" reads it off the first record.
      messages_field: the field or column holding a conversation's messages (chat).

    Returns:
      The source: `len(source)`, `source[i]` (the text, messages, or {"prompt", "completion"}), `source.doc_id(i)`,
        `source.where(i)` (the file and line or row, for messages) and `source.fields` (its format found).

    Raises:
      DataError: a missing path, no documents, a missing field or a bad record, in one line naming it.
    """
    fields = Fields(format, text_field, messages_field)
    kind, _, rest = spec.partition(":")
    if why := missing_path(spec):
        raise DataError(f"data source {why}")
    if kind == "jsonl":
        return JsonLines(rest, fields, id_field)
    if kind == "parquet":
        return parquet(rest, fields, id_field)
    if kind == "hf-disk":
        return hf_disk(os.path.expanduser(rest), split, fields, id_field)
    if format not in ("", "text"):
        raise ConfigError(f"data.format={format}: data source {spec!r} holds plain text; conversations come from "
                          "jsonl:, parquet: or hf-disk: records")
    if spec == "builtin":
        return Builtin(builtin_corpus_files())
    if kind == "dir":
        return TextDir(os.path.expanduser(rest))
    name = spec.removeprefix("tfds:")  # a TFDS name may carry a config and version: c4/en:3.0.1
    if os.path.exists(name) or name.startswith(("/", "./", "../", "~")):
        guess = "jsonl" if name.endswith(".jsonl") else "parquet" if name.endswith(".parquet") else (
            "dir" if os.path.isdir(name) else None)
        hint = f"write {guess}:{name}, or " if guess else "name its kind (jsonl:, parquet:, dir:, hf-disk:) or "
        raise DataError(f"data source {spec!r} is a path, not a dataset: {hint}make a TFDS dataset from it with "
                        f"`metatrain data build {name} --name NAME` and use tfds:NAME")
    if not spec.startswith("tfds:") and not _tfds_name(spec):
        hint = " (a remote file: copy it to this machine first)" if "://" in spec else ""
        raise ConfigError(f"data source {spec!r}: unknown kind {kind!r}{hint}; a source is builtin, tfds:NAME, "
                          f"jsonl:PATH_OR_GLOB, parquet:PATH_OR_GLOB, dir:PATH or hf-disk:PATH")
    from metatrain.data import tfds_source  # imports tensorflow_datasets, only when needed

    return Tfds(tfds_source.text_source(name, split, data_dir))
