"""Documents streamed from JSONL or Parquet files, record by record, for corpus-scale passes (`metatrain filter`).

Nothing indexes the whole input: a JSONL input is split into contiguous byte ranges (a range owns the lines
that start inside it), a Parquet input into runs of row groups, and process k of P reads its share
(`Share`). Every record carries a key, (file number, byte offset of its line or row number in its file), that
is the same whichever process reads it, and its raw form (the line's bytes, or its row number), so kept records
are written back unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import numpy as np

from metatrain.data.formats import Fields
from metatrain.data.sources import _files, json_record, table_fields
from metatrain.errors import DataError

FORMATS = {"jsonl:": "jsonl", "parquet:": "parquet"}


@dataclasses.dataclass(frozen=True)
class Record:
    file: int  # the file's number among the input's (sorted) files
    offset: int  # JSONL: the line's byte offset; Parquet: the row's number in its file
    doc: object  # the document: text, a message list, or {"prompt", "completion"} (see formats)
    raw: bytes | None  # JSONL: the line as read (written back unchanged); Parquet: None
    id: object = None  # the id field's value, else the line number (JSONL; file:line with several files) or the
    # row number over all files (Parquet), as `data.source` numbers documents; None unless asked for
    where: str = ""  # the file and line or row, for messages


@dataclasses.dataclass(frozen=True)
class Share:
    """What one of `parts` processes reads: JSONL byte ranges [(file, start, end)] or Parquet row groups
    [(file, row group)], and how big its share is (bytes or rows: the progress bar's total)."""

    spans: tuple
    size: int


def input_format(spec: str) -> tuple[str, str]:
    """(`jsonl` | `parquet`, the path or glob) of a source spec; other kinds are refused."""
    for prefix, kind in FORMATS.items():
        if spec.startswith(prefix):
            return kind, spec[len(prefix):]
    raise DataError(f"--data {spec!r}: filtering writes documents back in their own format; give jsonl:PATH_OR_GLOB "
                    "or parquet:PATH_OR_GLOB")


def files(kind: str, pattern: str) -> list[str]:
    """The input's files, sorted; one holding no document at all is not refused here (see `check_not_empty`)."""
    return _files(kind, pattern)


def check_not_empty(kind: str, paths: list[str], spec: str) -> None:
    """Refuse an input without a single record, before anything is written."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        if all(pq.ParquetFile(p).metadata.num_rows == 0 for p in paths):
            raise DataError(f"--data {spec}: no documents (0 rows)")
        return
    for p in paths:
        with open(p, "rb") as f:
            if any(line.strip() for line in f):
                return
    raise DataError(f"--data {spec}: no documents (the file(s) hold no JSON lines)")


def share(kind: str, paths: list[str], part: int, parts: int) -> Share:
    """Process `part` of `parts`' share: contiguous byte ranges of the files' concatenation (JSONL), or a
    contiguous run of their row groups (Parquet)."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        groups = [(k, g, pq.ParquetFile(p).metadata.row_group(g).num_rows) for k, p in enumerate(paths)
                  for g in range(pq.ParquetFile(p).metadata.num_row_groups)]
        lo, hi = len(groups) * part // parts, len(groups) * (part + 1) // parts
        mine = groups[lo:hi]
        return Share(tuple((k, g) for k, g, _ in mine), sum(n for _, _, n in mine))
    sizes = [os.path.getsize(p) for p in paths]
    total = sum(sizes)
    lo, hi = total * part // parts, total * (part + 1) // parts
    spans, base = [], 0
    for k, size in enumerate(sizes):
        start, end = max(lo - base, 0), min(hi - base, size)
        if start < end:
            spans.append((k, start, end))
        base += size
    return Share(tuple(spans), hi - lo)


def read(kind: str, paths: list[str], mine: Share, fields: Fields, id_field: str | None = None
         ) -> Iterator[tuple[Record, int]]:
    """The share's records in input order, each with how far the reader got (bytes or rows, for progress); with
    `id_field` each record's id. `fields` without a format: the first record's (see `formats`)."""
    if kind == "parquet":
        yield from _parquet(paths, mine, fields, id_field)
    else:
        yield from _jsonl(paths, mine, fields, id_field)


def after(items: Iterator[tuple[Record, int]], skip: int, last: tuple[int, int] | None, kept: str,
          on_skip=lambda where: None) -> Iterator[tuple[Record, int]]:
    """The records of `items` (`read`'s) after the first `skip`, whose scores an interrupted command kept (in
    `kept`, named in errors): read, not scored. The last skipped must be the kept scores' last document (`last`: its
    file and offset), else the input changed since, a DataError. `on_skip(progress)` every 4,096 skipped and at the
    last."""
    changed = f"the input is not what the scores kept in {kept} were made from (a file changed in place?)"
    n = 0
    for rec, where in items:
        n += 1
        if n < skip and n % 4096:
            continue
        if n <= skip:
            if n == skip and (rec.file, rec.offset) != last:
                raise DataError(f"{rec.where}: {changed}; run again to start over")
            on_skip(where)
            continue
        yield rec, where
    if n < skip:
        raise DataError(f"{changed}: it holds {n:,} documents, {skip:,} were scored; run again to start over")


def fingerprint(paths: list[str]) -> list[list]:
    """[real path, size, time of last change (ns)] of each file: what a kept pass over them is checked against."""
    return [[os.path.realpath(p), (st := os.stat(p)).st_size, st.st_mtime_ns] for p in paths]


def _jsonl(paths, mine: Share, fields: Fields, id_field: str | None):
    done = 0
    for k, start, end in mine.spans:
        path = paths[k]
        with open(path, "rb") as f:
            offset = start
            if start > 0:  # a line that starts before the range belongs to the range before
                f.seek(start - 1)
                if f.read(1) != b"\n":
                    offset = start + len(f.readline())
            f.seek(offset)
            line_no = _line_number(path, offset) if offset else 1
            while offset < end:
                raw = f.readline()
                if not raw:
                    break
                if raw.strip():
                    record, where = json_record(raw, path, line_no), f"{path}:{line_no}"
                    fields = fields.detect(record, where)
                    doc = fields.value(record, where)
                    doc_id = None
                    if id_field is not None:
                        doc_id = record.get(id_field)
                        if doc_id is None:
                            doc_id = line_no if len(paths) == 1 else f"{os.path.basename(path)}:{line_no}"
                    yield Record(k, offset, doc, raw, doc_id, where), done + min(offset + len(raw), end) - start
                offset += len(raw)
                line_no += 1
        done += end - start


def _line_number(path: str, offset: int) -> int:
    """The 1-based line number of the line starting at byte `offset` (for an error message)."""
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def _parquet(paths, mine: Share, fields: Fields, id_field: str | None):
    import pyarrow.parquet as pq

    done, opened = 0, {}
    before = np.cumsum([0] + [pq.ParquetFile(p).metadata.num_rows for p in paths])  # rows of the earlier files
    for k, g in mine.spans:
        pf = opened.get(k) or opened.setdefault(k, pq.ParquetFile(paths[k]))
        schema = pf.schema_arrow
        fields = table_fields(schema, fields, paths[k])
        columns = fields.columns()
        first = sum(pf.metadata.row_group(i).num_rows for i in range(g))
        with_ids = id_field is not None and id_field in schema.names
        group = pf.read_row_group(g, columns=columns + ([id_field] if with_ids else []))
        values = {c: group.column(c).to_pylist() for c in columns}
        ids = group.column(id_field).to_pylist() if with_ids else [None] * group.num_rows
        for i, doc_id in enumerate(ids):
            where = f"{paths[k]}: row {first + i}"
            record = {c: v[i] for c, v in values.items()}
            if fields.format == "text" and record[fields.text_field] is None:
                raise DataError(f"{where}: column {fields.text_field!r} is null, not text")
            doc = fields.value(record, where)
            if id_field is not None and doc_id is None:
                doc_id = int(before[k]) + first + i
            done += 1
            yield Record(k, first + i, doc, None, doc_id, where), done
