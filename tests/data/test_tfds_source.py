"""Local text → TFDS ArrayRecord dataset → read back through tfds.data_source in a fresh process."""

import json
import subprocess
import sys
import tempfile

import pytest
from helpers import one_line_error

from metatrain import cli
from metatrain.data import tfds_source


def _corpus(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    for i in range(12):
        (src / f"doc{i:02d}.txt").write_text(f"document {i}: " + "some words here " * (20 + i))
    (src / "latin1.txt").write_bytes("caf\xe9 au lait ".encode("latin-1") * 5)
    return src


def test_build_and_read_back_in_subprocess(tmp_path, capsys):
    src, data_dir = _corpus(tmp_path), tmp_path / "tfds"
    assert cli.main(["data", "build", str(src), "--name", "local_docs", "--data-dir", str(data_dir)]) == 0
    out = capsys.readouterr().out
    assert "from 13 file(s)" in out and "5 undecodable byte(s) replaced" in out
    assert [p.name for p in data_dir.iterdir()] == ["local_docs"]  # no empty downloads/extracted beside it
    code = (
        "import json, grain; from metatrain.data.tfds_source import text_source\n"
        f"s = text_source('local_docs', 'train', {str(data_dir)!r})\n"
        "docs = sorted(grain.MapDataset.source(s))\n"
        "print(json.dumps({'n': len(s), 'first': docs[0][:12]}))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"n": 13, "first": "caf\ufffd au lait"}


def test_a_build_leaves_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
    """TFDS looks on its GCS bucket for the info of a dataset it does not know yet, in a temporary folder it never
    removes: a dataset built from local files is never there."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    tfds_source.build_text_dataset([str(_corpus(tmp_path))], "temp_docs", str(tmp_path / "tfds"))
    assert list(temp.iterdir()) == []


def test_an_unprepared_dataset_leaves_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
    """A registered dataset that is not prepared here: TFDS looks for its info on GCS (offline here) in a temporary
    folder it never removes; the one-line error leaves nothing behind."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    with pytest.raises(ValueError, match="not prepared"):
        tfds_source.text_source("lm1b", "train", str(tmp_path / "tfds"))
    assert list(temp.iterdir()) == [] and tempfile.gettempdir() == str(temp)


@pytest.mark.slow
def test_pipeline_reads_the_built_dataset(tmp_path, capsys, monkeypatch):
    from metatrain.data import pipeline

    src, data_dir = _corpus(tmp_path), tmp_path / "tfds"
    tfds_source.build_text_dataset([str(src)], "pipe_docs", str(data_dir))
    assert cli.main(["data", "stats", "--source", "tfds:pipe_docs", "--data-dir", str(data_dir),
                     "--vocab-size", "1024"]) == 0
    assert "documents: 13 of 13" in capsys.readouterr().out
    assert cli.main(["data", "bench", "--source", "tfds:pipe_docs", "--data-dir", str(data_dir), "--seq-len", "32",
                     "--batch", "4", "--seconds", "0.5", "--vocab-size", "1024"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("tokens/s")
    windows, streams = [], pipeline.Streams.__init__
    monkeypatch.setattr(pipeline.Streams, "__init__", lambda self, cfg, *a: windows.append(cfg.shuffle_window) or
                        streams(self, cfg, *a))
    for flags in ([], ["--shuffle-window", "8"]):
        assert cli.main(["data", "bench", "--source", "tfds:pipe_docs", "--data-dir", str(data_dir), "--seq-len",
                         "32", "--batch", "4", "--seconds", "0.1", "--vocab-size", "1024", *flags]) == 0
    assert windows == [pipeline.DataConfig.shuffle_window, 8]


def test_failed_build_leaves_nothing_readable(tmp_path, monkeypatch):
    """Nor anything else in the user's data dir (TFDS's downloads/ stayed there)."""
    src, data_dir = _corpus(tmp_path), tmp_path / "tfds"
    data_dir.mkdir()
    calls = {"n": 0}
    real = tfds_source.read_text

    def flaky(path, stats=None):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk went away")
        return real(path, stats)

    monkeypatch.setattr(tfds_source, "read_text", flaky)
    with pytest.raises(OSError, match="disk went away"):
        tfds_source.build_text_dataset([str(src)], "broken_docs", str(data_dir))
    assert list(data_dir.iterdir()) == []
    with pytest.raises(ValueError, match="not prepared"):
        tfds_source.text_source("broken_docs", "train", str(data_dir))


def test_empty_corpus_and_unprepared_names(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="corpus is empty"):
        tfds_source.build_text_dataset([str(tmp_path / "empty")], "empty_docs", str(tmp_path / "tfds"))
    with pytest.raises(ValueError, match="not prepared"):
        tfds_source.text_source("empty_docs", "train", str(tmp_path / "tfds"))
    assert cli.main(["data", "stats", "--source", "tfds:lm1b", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'lm1b'" in err and "tfds build lm1b" in err
    assert "another folder, name that folder (data.data_dir=DIR, or --data-dir DIR" in err  # built elsewhere
    assert cli.main(["data", "build", str(tmp_path / "nope"), "--name", "x"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    # a --data-dir that is (or is below) a file: a NotADirectoryError traceback from making the dataset's folder
    (tmp_path / "afile").write_text("x")
    for data_dir in (tmp_path / "afile", tmp_path / "afile" / "tfds"):
        assert cli.main(["data", "build", str(tmp_path / "empty"), "--name", "x", "--data-dir", str(data_dir)]) == 2
        assert capsys.readouterr().err == (f"metatrain data build: error: --data-dir {data_dir}: {tmp_path / 'afile'} "
                                           f"is a file; give a folder to build the dataset in\n")


def test_building_an_existing_name_is_refused_unless_overwritten(tmp_path, capsys):
    src, data_dir = _corpus(tmp_path), tmp_path / "tfds"
    assert cli.main(["data", "build", str(src), "--name", "twice", "--data-dir", str(data_dir)]) == 0
    other = tmp_path / "other"
    other.mkdir()
    for i in range(3):
        (other / f"new{i}.txt").write_text(f"new document {i} " * 10)
    capsys.readouterr()
    assert cli.main(["data", "build", str(other), "--name", "twice", "--data-dir", str(data_dir)]) == 2
    one_line_error(capsys.readouterr().err, "--name 'twice': a dataset of that name already exists", "--overwrite")
    assert len(tfds_source.text_source("twice", "train", str(data_dir))) == 13  # the old one, untouched
    assert cli.main(["data", "build", str(other), "--name", "twice", "--data-dir", str(data_dir), "--overwrite"]) == 0
    assert "from 3 file(s)" in capsys.readouterr().out
    assert len(tfds_source.text_source("twice", "train", str(data_dir))) == 3


def test_a_corpus_smaller_than_one_batch_is_said_with_the_figures(tmp_path, capsys):
    from metatrain.data.pipeline import DataConfig, Streams

    src, data_dir = _corpus(tmp_path), tmp_path / "tfds"
    tfds_source.build_text_dataset([str(src)], "few_docs", str(data_dir))
    capsys.readouterr()
    # 13 documents: 10 inner, 2 outer (every 10th), 1 held out; 2 rows of 65 tokens fit in each stream
    Streams(DataConfig(source="tfds:few_docs", data_dir=str(data_dir), vocab_size=1024, seq_len=64, batch=2), 0, 1)
    assert "warning" not in capsys.readouterr().err
    Streams(DataConfig(source="tfds:few_docs", data_dir=str(data_dir), vocab_size=1024, seq_len=64, batch=64), 0, 1)
    err = capsys.readouterr().err
    assert "warning: the inner stream's 10 document(s) per data shard hold 1,768 tokens, fewer than one batch " \
           "(64 rows x 65 = 4,160 tokens)" in err
    assert "the outer stream's 2 document(s)" in err and "the validation stream's 1 document(s)" in err
    assert "shuffle window" not in err  # 2048 rows x 65 tokens: about 75 reads of the 1,768
    # rows of 1,025 tokens: filling the window of 2048 rows reads the inner stream's documents 2048 x 1025 / 1768
    # times (it looked like a hang: `data bench` of a 30-document corpus had not started after 3 minutes)
    for window, says in ((2048, True), (1, False)):
        Streams(DataConfig(source="tfds:few_docs", data_dir=str(data_dir), vocab_size=1024, seq_len=1024, batch=2,
                           shuffle_window=window), 0, 1)
        err = capsys.readouterr().err
        assert ("hold 1,768 tokens, fewer than one batch (2 rows x 1025 = 2,050 tokens): every batch repeats them, "
                "and filling the shuffle window of 2048 rows reads them about 1,187 times before the first batch; "
                "add documents or lower data.batch / data.seq_len / data.shuffle_window" in err) == says, err


def test_a_build_the_disk_refuses_is_one_line_naming_the_dataset_and_leaves_nothing(tmp_path):
    """A file size limit stands in for the full disk (writes fail alike, without root): ArrayRecord's writer fails
    in words only (a RuntimeError: "write() failed: File too large; writing .../incomplete.XXX/..."), which was
    "writing a file failed", and the half-made dataset folder stayed."""
    import base64
    import os

    from helpers import metatrain

    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):  # 3 x 8 KB of random text: no compression brings it under 4 KiB
        (src / f"doc{i}.txt").write_text(base64.b64encode(os.urandom(6000)).decode())
    data_dir = tmp_path / "tfds"
    build = ["data", "build", str(src), "--name", "big_docs", "--data-dir", str(data_dir)]
    res = metatrain(*build, file_limit_kib=4)
    assert res.returncode == 2, res.stderr[-3000:]
    one_line_error(res.stderr.replace("\r", "\n"), f"metatrain data build: error: writing {data_dir}/big_docs failed "
                                                   f"(File too large); make room there and run again")
    assert not (data_dir / "big_docs").exists()
