"""`data.records`: going on past the documents an interrupted pass scored."""

import gzip

import pytest

from metatrain.data import records
from metatrain.errors import DataError


def _items():
    return iter([(records.Record(0, 10 * i, "text", b"", where=f"c.jsonl:{i + 1}"), 10 * (i + 1)) for i in range(5)])


def test_after_reads_past_the_scored_documents_and_checks_the_last_is_where_it_was():
    """The kept scores' last document (file, offset) must be the one read at its place; a corpus that holds fewer
    documents, or others there (a file rewritten to the same size and time), is a DataError, not wrong scores."""
    seen = []
    assert [r.offset for r, _ in records.after(_items(), 3, (0, 20), "K", seen.append)] == [30, 40] and seen == [30]
    assert [r.offset for r, _ in records.after(_items(), 0, None, "K")] == [0, 10, 20, 30, 40]
    with pytest.raises(DataError, match="c.jsonl:3: the input is not what the scores kept in K were made from"):
        list(records.after(_items(), 3, (0, 25), "K"))
    with pytest.raises(DataError, match="it holds 5 documents, 6 were scored"):
        list(records.after(_items(), 6, (0, 50), "K"))


def test_fingerprint_changes_with_the_size_or_the_time_of_a_file(tmp_path):
    import os

    path = tmp_path / "c.jsonl"
    path.write_text("{}\n")
    before = records.fingerprint([str(path)])
    assert before == [[str(path.resolve()), 3, os.stat(path).st_mtime_ns]]
    path.write_text("{}\n{}\n")
    assert records.fingerprint([str(path)]) != before


def test_a_compressed_input_is_refused_naming_the_command_that_decompresses_it(tmp_path):
    """`scores` and `filter` read their input here: a gzip file was 'not a JSON line (utf-8 codec can't decode byte
    0x8b)'."""
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n'))
    with pytest.raises(DataError, match=r"d\.jsonl\.gz' is gzip-compressed; decompress it first \(gunzip "):
        records.files("jsonl", str(tmp_path / "*.jsonl.gz"))
