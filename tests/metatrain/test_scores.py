"""`metatrain scores` and `metatrain eval` on the shared tiny run, checked against the task evaluated here on
each document alone; the end-of-run list of the lowest- and highest-weighted held-out documents."""

import json
import os
import re

import numpy as np
import pytest
from helpers import StoppedScoring, cli_run, one_line_error, saved_state

from metatrain import cli
from metatrain import config as config_lib
from metatrain.data.tokenizer import load_tokenizer
from metatrain.tasks import make_task

DOCS = {"a": "x = 1\n", "b": "import os\n", "c": "( def ) =", "empty": ""}  # each shorter than a row


def _setup(shared_run, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in DOCS.items()))
    workdir = str(shared_run["workdir"])
    cfg = config_lib.load(os.path.join(workdir, "config.yaml"), pretrained=False)
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.vocab_size)
    task = make_task(cfg.task, model=cfg.model.replace(vocab_size=tok.vocab_size), inner_lr=cfg.inner_lr)
    return path, workdir, cfg, tok, task, saved_state(workdir, 4)


def _alone(tok, text, seq_len):
    """One document as a batch of one row (it fits: every document here is shorter than seq_len + 1 tokens)."""
    ids = tok.encode(text)
    assert len(ids) <= seq_len + 1
    row = np.zeros((1, seq_len + 1), np.int32)
    row[0, :len(ids)] = ids
    seg = (np.arange(seq_len + 1) < len(ids)).astype(np.int32)[None]
    return {"tokens": row, "segment_ids": seg, "positions": np.arange(seq_len + 1, dtype=np.int32)[None]}, len(ids) - 1


def test_scores_match_each_document_scored_alone(shared_run, tmp_path, capsys):
    path, workdir, cfg, tok, task, state = _setup(shared_run, tmp_path)
    out = tmp_path / "scores.jsonl"
    assert cli.main(["scores", workdir, "--data", f"jsonl:{path}", "--out", str(out)]) == 0
    assert f"wrote {out}: score and weight of 4 documents" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(DOCS)
    assert rows[-1]["score"] is None and rows[-1]["weight"] is None  # nothing to score in an empty document
    expected = np.asarray([float(task.scores(state["meta"], _alone(tok, DOCS[k], cfg.data.seq_len)[0])[0])
                           for k in "abc"])
    got = np.asarray([r["score"] for r in rows[:3]])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    b = cfg.data.batch  # the weight among b - 1 examples of the mean exp-score: b·e^s / (e^s + (b-1)·mean e^s)
    weights = b * np.exp(expected) / (np.exp(expected) + (b - 1) * np.exp(expected).mean())
    np.testing.assert_allclose([r["weight"] for r in rows[:3]], weights, rtol=1e-5)


def test_eval_matches_the_models_evaluated_here(shared_run, tmp_path, capsys):
    path, workdir, cfg, tok, task, state = _setup(shared_run, tmp_path)
    assert cli.main(["eval", workdir, "--data", f"jsonl:{path}"]) == 0
    lines = {line.split(" loss ")[0].strip(): line for line in capsys.readouterr().out.splitlines()
             if " loss " in line}
    for name, theta in (("inner model (fine-tuned)", state["inner"][0]), ("uniform baseline",
                                                                          state["base"]["inner"][0])):
        losses, counts = [], []
        for k in "abc":
            batch, n = _alone(tok, DOCS[k], cfg.data.seq_len)
            losses.append(float(task.example_losses(theta, batch)[0]))
            counts.append(n)
        loss = float(np.dot(losses, counts) / np.sum(counts))
        printed = lines[name].split(" loss ")[1].split()
        assert float(printed[0]) == pytest.approx(loss, abs=1e-4)
        assert float(printed[2].replace(",", "")) == pytest.approx(np.exp(loss), rel=1e-3)
    assert cli.main(["eval", workdir]) == 0  # the run's validation documents by default
    assert "on the run's validation documents" in capsys.readouterr().out


def test_scores_that_are_not_finite_are_one_line_and_write_nothing(shared_run, tmp_path, capsys, monkeypatch):
    """A run whose meta-training diverged (meta_opt.lr=1e9: η's first update was finite, its scores -inf) gave a
    traceback in `scores` (the in-memory path) or a wrong reason ("no token to predict") in the streamed one. Its
    scores stand in here for such an η."""
    import jax.numpy as jnp

    from metatrain.tasks.loss_weighting import LossWeighting

    monkeypatch.setattr(LossWeighting, "scores", lambda self, meta, b: jnp.full(b["tokens"].shape[:1], -jnp.inf))
    path, workdir = _setup(shared_run, tmp_path)[:2]
    for argv, where in ((["scores", workdir, "--out", tmp_path / "a.jsonl"], "builtin document "),
                        (["scores", workdir, "--data", f"jsonl:{path}", "--out", tmp_path / "b.jsonl"], f"{path}:1"),
                        (["filter", workdir, "--data", f"jsonl:{path}", "--drop", "0.5", "--out", tmp_path / "c"],
                         f"{path}:1")):
        code, out, err = cli_run(capsys, *argv)
        assert code == 2
        one_line_error(err, where, "its score is -inf, not a finite number: the parameters that scored it diverged")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]


def test_the_run_lists_its_lowest_and_highest_weighted_documents(shared_run):
    out = shared_run["stdout"].splitlines()
    low, high = out.index("lowest-weighted held-out documents (id, weight, text):"), \
        out.index("highest-weighted held-out documents (id, weight, text):")
    k = high - low - 1  # 5, or half the held-out documents scored when they are fewer than 10
    end = out.index(next(line for line in out if line.startswith("evaluation: ")))
    assert 1 <= k <= 5 and end == high + 1 + k
    weights = [float(line.split()[1]) for line in out[low + 1:high] + out[high + 1:end]]
    assert weights[:k] == sorted(weights[:k]) and weights[k:] == sorted(weights[k:], reverse=True)
    assert max(weights[:k]) <= min(weights[k:])  # two disjoint lists
    assert all(len(line.split(None, 2)[2]) <= 80 for line in out[low + 1:end] if line.startswith("  "))


def test_scores_of_a_missing_workdir_is_one_line(tmp_path, capsys):
    assert cli.main(["scores", str(tmp_path / "nothing")]) == 2
    assert "no such directory" in capsys.readouterr().err



def test_streamed_scores_number_documents_as_their_source_does(shared_run, tmp_path):
    """`scores` streams JSONL and Parquet; a record without an id gets the id the data source gives it (the line
    number, file:line with several files; the row number over all Parquet files), in the source's order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from metatrain.data.sources import open_source

    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text('{"text": "x = 1"}\n\n{"text": "y = 2", "id": "mine"}\n')
    (tmp_path / "j" / "b.jsonl").write_text('{"text": "import os"}\n')
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"text": ["a = 1", "b = 2", "c = 3"]}), tmp_path / "p" / "a.parquet", row_group_size=2)
    pq.write_table(pa.table({"text": ["d = 4"]}), tmp_path / "p" / "b.parquet")
    for spec in (f"jsonl:{tmp_path}/j/*.jsonl", f"parquet:{tmp_path}/p/*.parquet"):
        out = tmp_path / f"s-{spec[:5]}.jsonl"
        assert cli.main(["scores", str(shared_run["workdir"]), "--data", spec, "--out", str(out)]) == 0
        source = open_source(spec)
        assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [
            source.doc_id(i) for i in range(len(source))]


def test_stopped_scores_go_on_from_the_documents_scored(shared_run, tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) after 30 of 80 documents are scored: OUT.scores.tmp is kept, said in a line, and nothing
    else; the same command then scores only the other 50 (after a kill's cut-off last line, cut off) and writes what
    a run never stopped writes, byte for byte. A changed input file starts again."""
    from metatrain import scores

    real, scored = scores.score_stream, []
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": f"x = {i} " * (1 + i % 9)}) + "\n" for i in range(80)))
    run, out, whole = str(shared_run["workdir"]), tmp_path / "new" / "s.jsonl", tmp_path / "whole.jsonl"
    argv = ["scores", run, "--data", f"jsonl:{path}", "--out"]
    monkeypatch.setattr(scores, "score_stream", StoppedScoring(real, scored, stop=30))
    assert cli.main([*argv, str(out)]) == 130
    err = capsys.readouterr().err
    assert f"the scores of the 30 documents scored so far are kept in {out}.scores.tmp" in err, err
    assert sorted(p.name for p in out.parent.iterdir()) == ["s.jsonl.scores.tmp"]
    with open(f"{out}.scores.tmp", "a") as f:
        f.write('["d30", 0.5')  # a kill in the middle of a line
    first, scored[:] = list(scored), []
    monkeypatch.setattr(scores, "score_stream", StoppedScoring(real, scored))
    assert cli.main([*argv, str(out)]) == 0
    assert len(scored) == 50 and not set(first) & set(scored) and "going on from the 30 documents" in \
        capsys.readouterr().err
    assert cli.main([*argv, str(whole)]) == 0
    assert out.read_bytes() == whole.read_bytes() and sorted(p.name for p in out.parent.iterdir()) == ["s.jsonl"]
    out.unlink()
    monkeypatch.setattr(scores, "score_stream", StoppedScoring(real, scored, stop=30))
    scored[:] = []
    assert cli.main([*argv, str(out)]) == 130
    path.write_text(path.read_text() + "\n")
    monkeypatch.setattr(scores, "score_stream", StoppedScoring(real, scored))
    scored[:] = []
    assert cli.main([*argv, str(out)]) == 0 and len(scored) == 80


def test_text_field_reads_the_documents_text_from_another_field(shared_run, tmp_path, capsys):
    """`--text-field` in scores, eval, filter and data stats: documents whose text is under "body" give what the
    same documents under the run's "text" give; without it the one-line error names the flag."""
    workdir = str(shared_run["workdir"])
    docs = [(f"d{i}", f"def f{i}(x):\n    return x * {i}\n") for i in range(12)]
    for field in ("text", "body"):
        (tmp_path / f"{field}.jsonl").write_text("".join(json.dumps({"id": k, field: v}) + "\n" for k, v in docs))
    body = ["--data", f"jsonl:{tmp_path / 'body.jsonl'}"]
    assert cli.main(["scores", workdir, *body, "--out", str(tmp_path / "no.jsonl")]) == 2
    one_line_error(capsys.readouterr().err, "no field 'text'", "--text-field")

    said = {}
    for field, flag in (("text", []), ("body", ["--text-field", "body"])):
        data = ["--data", f"jsonl:{tmp_path / f'{field}.jsonl'}"]
        assert cli.main(["scores", workdir, *data, "--out", str(tmp_path / f"s-{field}.jsonl"), *flag]) == 0
        assert cli.main(["eval", workdir, *data, *flag]) == 0
        out = tmp_path / f"kept-{field}"
        assert cli.main(["filter", workdir, *data, "--out", str(out), "--drop", "0.5", "--batch", "4", *flag]) == 0
        assert cli.main(["data", "stats", "--source", f"jsonl:{tmp_path / f'{field}.jsonl'}", *flag]) == 0
        said[field] = capsys.readouterr().out
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["text_field"] == field
        kept = [json.loads(line) for line in (out / "part-00000.jsonl").read_text().splitlines()]
        ids = [r["id"] for r in kept]
        assert ids == [k for k, _ in docs if k in ids]  # in the input's order
        assert kept == [{"id": k, field: dict(docs)[k]} for k in ids]  # written back as they were
        said[field] += json.dumps(ids)
    assert (tmp_path / "s-text.jsonl").read_text() == (tmp_path / "s-body.jsonl").read_text()
    text, body = said["text"], said["body"]
    assert "data.text_field=body" in body and "data.text_field" not in text  # how to train on the kept ones
    steady = lambda out, field: [re.sub(r"; [\d,.]+ documents/s", "", line).replace(" data.text_field=body", "")
                                 .replace(f"{field}.jsonl", "F.jsonl").replace(f"-{field}", "-F")
                                 for line in out.splitlines()]  # the file names aside; the filter's rate varies
    assert steady(text, "text") == steady(body, "body")
