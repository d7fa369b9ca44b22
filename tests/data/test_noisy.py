"""`metatrain data make-noisy`: the defect kinds do what they say, the sets are disjoint and clean where they
should be, the output is a data source, and the same seed gives the same bytes."""

import json
import random
import re

import pytest

from metatrain import cli
from metatrain.data import noisy
from metatrain.data.sources import open_source

TEXT = ("def parse(line):\n    \"\"\"Split a line into its fields.\"\"\"\n    return [f.strip() for f in "
        "line.split(',') if f]\n\nclass Reader:\n    def __init__(self, path):\n        self.path = path\n") * 6


@pytest.mark.parametrize("kind", noisy.KINDS)
def test_each_defect_kind(kind):
    rng = random.Random(0)
    pool = "another clean piece of text with quite a few words in it " * 8
    out = noisy.defect(kind, TEXT, rng, pool=[pool])
    assert out != TEXT
    if kind == "mojibake":
        assert "\ufffd" in out or "â€" in out or "Ã" in out
    elif kind == "ocr":
        assert abs(len(out) - len(TEXT)) < 0.2 * len(TEXT) and sum(a != b for a, b in zip(out, TEXT)) > 20
    elif kind == "whitespace":
        assert re.search(r" {8,}|\t{3,}|\n{4,}", out)
    elif kind == "blob":
        assert "-----BEGIN KEY-----" in out and re.search(r"[A-Za-z0-9+/=]{60,}|[0-9a-f]{64}", out)
    elif kind == "caps":
        assert out == TEXT.upper()
    elif kind == "boilerplate":
        assert "cookies" in out and "All rights reserved" in out
    elif kind == "near_duplicate":  # another piece, a few of its words changed
        changed = sum(a != b for a, b in zip(out.split(" "), pool.split(" ")))
        assert len(out.split(" ")) == len(pool.split(" ")) and 0 < changed <= len(pool.split(" ")) // 20
    elif kind == "truncated":
        assert TEXT.startswith(out) and len(out) <= 0.15 * len(TEXT) + 1
    elif kind == "shuffled":
        assert sorted(out.split()) == sorted(TEXT.split())


def test_make_noisy_writes_three_labelled_sets(tmp_path, capsys):
    out = tmp_path / "noisy"
    assert cli.main(["data", "make-noisy", "--out", str(out), "--rate", "0.3", "--seed", "1"]) == 0
    said = capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    rows = {name: [json.loads(x) for x in (out / f"{name}.jsonl").read_text().splitlines()]
            for name in ("train", "trusted", "heldout")}
    labels = [r["defect"] for r in rows["train"]]
    bad = sum(label != "none" for label in labels)
    assert abs(bad / len(labels) - 0.3) < 0.001 and set(labels) == {"none", *noisy.KINDS}
    counts = [labels.count(k) for k in noisy.KINDS]
    assert max(counts) - min(counts) <= 1 and manifest["defects"] == dict(zip(noisy.KINDS, counts))
    assert all(r["defect"] == "none" for name in ("trusted", "heldout") for r in rows[name])
    ids = [r["id"] for name in rows for r in rows[name]]
    assert len(ids) == len(set(ids))
    clean = {r["text"] for r in rows["train"] if r["defect"] == "none"}
    assert not clean & {r["text"] for r in rows["heldout"]} and not clean & {r["text"] for r in rows["trusted"]}
    assert f"train.jsonl ({len(labels):,} documents, {bad:,} with a defect" in said
    assert len(open_source(f"jsonl:{out}/train.jsonl")) == len(labels)
    again = tmp_path / "again"
    assert cli.main(["data", "make-noisy", "--out", str(again), "--seed", "1"]) == 0
    assert (again / "train.jsonl").read_bytes() == (out / "train.jsonl").read_bytes()


def test_make_noisy_refuses_a_used_dir_and_a_bad_rate(tmp_path, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "mine.txt").write_text("keep me")
    assert cli.main(["data", "make-noisy", "--out", str(tmp_path / "used")]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "used" / "mine.txt").read_text() == "keep me"
    for rate in ("1", "-0.1", "x"):
        with pytest.raises(SystemExit):
            cli.main(["data", "make-noisy", "--out", str(tmp_path / "o"), "--rate", rate])
        assert not (tmp_path / "o").exists()
