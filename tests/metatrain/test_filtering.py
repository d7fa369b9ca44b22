"""`metatrain filter`: the two rules against their definitions, and curated data out of the shared tiny run
(JSONL and Parquet, records unchanged, the same kept set on two processes as on one, bad input refused)."""

import json
import math
import shutil
import sys

import numpy as np
import pytest
from helpers import StoppedScoring

from metatrain import cli, filtering
from metatrain.data.sources import open_source


# ---- the rules ---------------------------------------------------------------------------------
@pytest.mark.parametrize("batch,drop", [(10, 0.3), (16, 0.25), (7, 0.5), (256, 0.1)])
def test_p_accept_is_the_chance_of_being_in_a_batchs_top_k(batch, drop):
    """P_accept(p) = Σ_{s<K} C(B−1, s) (1−p)^s p^(B−1−s) at integer K (summed here term by term), interpolated
    at fractional K; its mean over p ~ U(0, 1) is K/B = 1−ρ exactly (each of the B places is equally likely)."""
    p = np.linspace(0, 1, 11)
    k = batch * (1 - drop)

    def direct(kk):
        return np.array([sum(math.comb(batch - 1, s) * (1 - q) ** s * q ** (batch - 1 - s) for s in range(kk))
                         for q in p])

    lo = math.floor(k)
    expected = direct(lo) + (k - lo) * (direct(lo + 1) - direct(lo))
    np.testing.assert_allclose(filtering.p_accept(p, batch, drop), expected, atol=1e-12)
    grid = (np.arange(200_000) + 0.5) / 200_000  # midpoint rule; P_accept is a polynomial in p
    assert abs(filtering.p_accept(grid, batch, drop).mean() - (1 - drop)) < 1e-6


def test_p_accept_keeps_one_minus_rho_of_100k_documents():
    """100k documents with scores from a skewed distribution (and ties), the CDF from all of them: the kept
    fraction is within 1% of 1−ρ (its standard deviation is sqrt(Var/n) ≈ 0.0015 at n = 1e5: 4σ inside), the
    higher-scored keep more, and the coins are a function of the seed and the document's key."""
    rng = np.random.default_rng(0)
    n = 100_000
    scores = np.round(rng.gamma(2.0, size=n), 2)  # rounded: many ties
    file, offset = np.zeros(n, np.int64), np.arange(n, dtype=np.int64) * 97
    sample = np.sort(scores)
    for drop in (0.1, 0.3, 0.5, 0.9):
        prob = filtering.p_accept(filtering.cdf_positions(scores, sample), 64, drop)
        keep = filtering.uniforms(0, file, offset) < prob
        assert abs(keep.mean() - (1 - drop)) <= 0.01 * (1 - drop), drop
        top = scores > np.quantile(scores, 0.9)
        assert keep[top].mean() > keep[~top].mean()
    u = filtering.uniforms(3, file, offset)
    assert np.array_equal(u, filtering.uniforms(3, file, offset)) and not np.array_equal(u, filtering.uniforms(
        4, file, offset))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01


def test_topk_keeps_exactly_the_best_b_of_each_group():
    """Groups of G = B/(1−ρ) drawn at random within windows: every full group keeps exactly B, the B highest
    scored of it (NaN lowest); the last, partial group keeps its share; a different seed draws other groups."""
    rng = np.random.default_rng(1)
    batch, drop = 8, 0.2  # G = 10
    n = 10 * filtering.WINDOW_GROUPS * 2 + 37  # two whole windows and a partial one
    scores = rng.normal(size=n)
    scores[::50] = np.nan
    keep = filtering.topk_keep(scores, 0, batch, drop, seed=5, total=n)
    window = 10 * filtering.WINDOW_GROUPS
    for w0 in range(0, n, window):
        m = min(window, n - w0)
        order = w0 + np.random.default_rng([5, w0 // window]).permutation(m)
        groups = [order[g:g + 10] for g in range(0, m, 10)]
        assert sorted(np.concatenate(groups)) == list(range(w0, w0 + m))  # the groups partition the window
        for g in groups:
            k = batch if len(g) == 10 else round(len(g) * batch / 10)
            assert keep[g].sum() == k
            s = np.nan_to_num(scores[g], nan=-np.inf)
            assert s[keep[g]].min() >= s[~keep[g]].max() if k < len(g) else True
    assert keep.sum() == (n // 10) * batch + round(7 * batch / 10)
    assert not np.array_equal(keep, filtering.topk_keep(scores, 0, batch, drop, seed=6, total=n))


# ---- curated data out of a run ------------------------------------------------------------------
def _corpus(tmp_path, n_docs=240):
    """Short documents cut from the built-in corpus, each with an id and an extra field; one blank line."""
    src = open_source("builtin")
    lines = []
    for i in range(n_docs):
        text = src[i % len(src)][(i // len(src)) * 400:][:300 + (i * 37) % 500]
        lines.append(json.dumps({"id": f"doc-{i}", "text": text, "n": i}) + "\n")
    lines.insert(17, "\n")
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(lines))
    return path, lines


def _filter(*args) -> int:
    return cli.main(["filter", *map(str, args)])


def test_filter_writes_the_kept_records_unchanged_and_agrees_with_scores(shared_run, tmp_path, capsys):
    """topk on a JSONL corpus: the kept lines are input lines, unchanged and in order; exactly B of every full
    group; the kept set is the one `topk_keep` gives on `metatrain scores`' scores (the same rows in the same
    batches: the same numbers); the manifest counts documents and tokens; the output reads back as a source;
    the same seed writes the same bytes."""
    path, lines = _corpus(tmp_path)
    run = shared_run["workdir"]
    assert _filter(run, "--data", f"jsonl:{path}", "--out", tmp_path / "out", "--drop", 0.2, "--batch", 8,
                   "--score-batch", 8) == 0
    said = capsys.readouterr().out
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    kept = (tmp_path / "out" / "part-00000.jsonl").read_text().splitlines(keepends=True)
    docs = [line for line in lines if line.strip()]
    assert set(kept) <= set(docs) and kept == [line for line in docs if line in set(kept)]  # unchanged, in order
    assert len(kept) == manifest["documents"]["kept"] == (240 // 10) * 8 and manifest["documents"]["in"] == 240
    assert "kept 192 of 240 documents" in said and "data.source=jsonl:" in said
    assert manifest["rule"] == dict(manifest["rule"], method="topk", group=10, keep_per_group=8)
    assert 0 < manifest["tokens"]["kept"] < manifest["tokens"]["in"] and manifest["step"] == 4
    # the reference: the run's scores of the same documents, through the rule
    assert cli.main(["scores", str(run), "--data", f"jsonl:{path}", "--out", str(tmp_path / "s.jsonl")]) == 0
    scores = np.array([json.loads(x)["score"] for x in (tmp_path / "s.jsonl").read_text().splitlines()], float)
    reference = filtering.topk_keep(scores, 0, 8, 0.2, seed=0, total=len(scores))
    assert [json.loads(x)["id"] for x in kept] == [json.loads(d)["id"] for d, k in zip(docs, reference) if k]
    back = open_source(f"jsonl:{tmp_path / 'out'}/*.jsonl")
    assert len(back) == 192 and back.doc_id(0) == json.loads(kept[0])["id"]
    assert _filter(run, "--data", f"jsonl:{path}", "--out", tmp_path / "again", "--drop", 0.2, "--batch", 8,
                   "--score-batch", 8) == 0
    part = "part-00000.jsonl"
    assert (tmp_path / "again" / part).read_bytes() == (tmp_path / "out" / part).read_bytes()


def test_filter_p_accept_on_parquet_keeps_rows_of_the_same_schema(shared_run, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, lines = _corpus(tmp_path)
    rows = [json.loads(x) for x in lines if x.strip()]
    table = pa.table({"id": [r["id"] for r in rows], "text": [r["text"] for r in rows], "n": [r["n"] for r in rows]})
    (tmp_path / "pq").mkdir()
    pq.write_table(table.slice(0, 100), tmp_path / "pq" / "a.parquet", row_group_size=30)
    pq.write_table(table.slice(100), tmp_path / "pq" / "b.parquet", row_group_size=70)
    assert _filter(shared_run["workdir"], "--data", f"parquet:{tmp_path}/pq/*.parquet", "--out", tmp_path / "out",
                   "--drop", 0.5, "--method", "p_accept", "--batch", 16, "--seed", 3) == 0
    out = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert out.schema == table.schema and out.num_rows == manifest["documents"]["kept"]
    assert 60 < out.num_rows < 180  # about half of 240 (a binomial spread)
    n = out.column("n").to_pylist()
    assert n == sorted(n) and all(rows[i]["text"] == t for i, t in zip(n, out.column("text").to_pylist()))
    assert manifest["rule"]["cdf_documents"] == 240 and manifest["format"] == "parquet"
    assert len(open_source(f"parquet:{tmp_path}/out/*.parquet")) == out.num_rows


@pytest.mark.slow
def test_two_processes_keep_the_same_documents_as_one(shared_run, tmp_path):
    """`filter` as two processes (each scores and writes its byte range; the topk groups straddle the two) keeps
    the same documents, in the same order, as one process (topk: its groups cross the processes' shares; every
    process reads every share's scores, as p_accept's CDF does)."""
    path, _ = _corpus(tmp_path)
    from metatrain.launch import local

    args = ["filter", str(shared_run["workdir"]), "--data", f"jsonl:{path}", "--drop", "0.3", "--batch", "6"]
    for method in ("topk",):  # p_accept's decisions need no neighbours: each document's key and the global CDF
        assert cli.main([*args, "--method", method, "--out", str(tmp_path / f"one-{method}")]) == 0
        assert local.launch([*args, "--method", method, "--out", str(tmp_path / f"two-{method}")], processes=2,
                            devices=1) == 0
        a = (tmp_path / f"one-{method}" / "part-00000.jsonl").read_text()
        b = "".join((tmp_path / f"two-{method}" / f"part-0000{k}.jsonl").read_text() for k in (0, 1))
        assert a == b and a
        manifest = json.loads((tmp_path / f"two-{method}" / "manifest.json").read_text())
        assert manifest["processes"] == 2 and manifest["outputs"] == ["part-00000.jsonl", "part-00001.jsonl"]


def test_bad_input_is_one_line_and_writes_nothing(shared_run, tmp_path, capsys):
    path, _ = _corpus(tmp_path, n_docs=20)
    run = str(shared_run["workdir"])
    other = tmp_path / "maml_run"
    shutil.copytree(run, other)
    config = other / "config.yaml"
    config.write_text(config.read_text().replace("task: loss_weighting", "task: maml"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    exists = tmp_path / "exists"
    exists.mkdir()
    (exists / "mine.txt").write_text("mine")
    out = tmp_path / "out"
    cases = [([str(other), "--data", f"jsonl:{path}", "--out", str(out), "--drop", "0.3"],
              "filtering needs a loss-weighting run"),
             ([run, "--data", f"jsonl:{empty}", "--out", str(out), "--drop", "0.3"], "no documents"),
             ([run, "--data", f"jsonl:{path}", "--out", str(exists), "--drop", "0.3"],
              "already exists and is not empty; give a new directory"),
             ([run, "--data", "builtin", "--out", str(out), "--drop", "0.3"], "give jsonl:PATH_OR_GLOB"),
             # a scoring batch past the memory here: its host buffers got the process killed (out of memory) before
             ([run, "--data", f"jsonl:{path}", "--out", str(out), "--drop", "0.3", "--score-batch", "2147483647"],
              "scoring 2,147,483,647 rows at a time needs")]
    for args, message in cases:
        assert cli.main(["filter", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not out.exists() and [p.name for p in exists.iterdir()] == ["mine.txt"]
    for drop in ("0", "1", "1.5", "-0.1"):
        with pytest.raises(SystemExit) as e:
            cli.main(["filter", run, "--data", f"jsonl:{path}", "--out", str(out), "--drop", drop])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "must be in (0, 1)" in err and not out.exists()


WAITING_FILTER = """
import sys, time
from metatrain import cli, scores

real = scores.score_stream


def waiting(*args, **kwargs):  # OUT/.parts is made and nothing is scored yet: it waits there for the signal
    print("waiting to score", file=sys.stderr, flush=True)
    time.sleep(600)
    yield from real(*args, **kwargs)


scores.score_stream = waiting
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_cleans_up_and_a_stranded_staging_dir_is_started_again(shared_run, tmp_path, capsys):
    """SIGTERM (a scheduler, `timeout`) stops `filter` as Ctrl-C does: OUT goes, exit 143. A filter killed past any
    clean-up (SIGKILL) before it wrote what its scores are of leaves OUT holding only `.parts/`: the next run starts
    again there and finishes. The signal comes while the filter waits before its first document (a program that
    makes it wait there): sent when OUT/.parts appeared, it came after a filter of 4,000 documents had ended on a
    loaded machine."""
    import signal
    import subprocess
    import time

    from helpers import env

    path, _ = _corpus(tmp_path)
    out, err_path = tmp_path / "cur", tmp_path / "err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", WAITING_FILTER, "filter", shared_run["workdir"], "--data",
                                 f"jsonl:{path}", "--out", out, "--drop", "0.3"], env=env(),
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            deadline = time.time() + 300
            while "waiting to score" not in err_path.read_text():
                assert proc.poll() is None and time.time() < deadline, err_path.read_text()[-3000:]
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            proc.kill()
    err = err_path.read_text()
    assert proc.returncode == 143 and "metatrain filter: stopped by SIGTERM" in err, err[-3000:]
    assert "Traceback" not in err and not out.exists(), err[-3000:]  # nothing scored, nothing kept
    (out / ".parts").mkdir(parents=True)  # as SIGKILL leaves it
    (out / ".parts" / "scores-00000.bin").write_bytes(b"\0" * 24)
    assert _filter(shared_run["workdir"], "--data", f"jsonl:{path}", "--out", out, "--drop", "0.3") == 0
    assert "starting again" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "part-00000.jsonl"]


def test_a_stopped_filter_goes_on_from_the_documents_it_scored(shared_run, tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) after 100 of 240 documents are scored: OUT keeps only `.parts/`, said in a line; the same
    command then scores only the other 140 (after a kill's cut-off last record, cut off) and writes what a filter
    never stopped writes, byte for byte. A changed input file starts again; so does another --max-rows."""
    from metatrain import scores

    real, scored = scores.score_stream, []
    path, _ = _corpus(tmp_path)
    run, out, whole = shared_run["workdir"], tmp_path / "cur", tmp_path / "whole"
    args = ["--data", f"jsonl:{path}", "--drop", 0.3, "--batch", 8, "--score-batch", 8]
    monkeypatch.setattr(scores, "score_stream", StoppedScoring(real, scored, stop=100))
    assert _filter(run, *args, "--out", out) == 130
    err = capsys.readouterr().err
    assert f"the scores of the 100 documents scored so far are kept in {out}/.parts" in err, err
    assert [p.name for p in out.iterdir()] == [".parts"]
    with open(out / ".parts" / "scores-00000.bin", "ab") as f:
        f.write(b"\1" * 7)  # a kill in the middle of a record
    first, scored[:] = list(scored), []
    monkeypatch.setattr(scores, "score_stream", StoppedScoring(real, scored))
    assert _filter(run, *args, "--out", out) == 0
    assert "going on in" in capsys.readouterr().err and len(scored) == 140 and not set(first) & set(scored)
    assert _filter(run, *args, "--out", whole) == 0
    assert (out / "part-00000.jsonl").read_bytes() == (whole / "part-00000.jsonl").read_bytes()
    resumed, never = (json.loads((d / "manifest.json").read_text()) for d in (out, whole))
    assert resumed.pop("documents_scored_before") == 100 and never.pop("documents_scored_before") == 0
    drop_time = lambda m: {k: v for k, v in m.items() if k not in ("seconds", "documents_per_second")}
    assert drop_time(resumed) == drop_time(never)
    for change in (lambda: path.write_text(path.read_text() + "\n"), lambda: args.extend(["--max-rows", 2])):
        shutil.rmtree(out)
        monkeypatch.setattr(scores, "score_stream", StoppedScoring(real, scored, stop=100))
        scored[:] = []
        assert _filter(run, *args, "--out", out) == 130
        change()
        monkeypatch.setattr(scores, "score_stream", StoppedScoring(real, scored))
        scored[:] = []
        assert _filter(run, *args, "--out", out) == 0
        assert "starting again" in capsys.readouterr().err and len(scored) == 240


def test_a_stop_right_after_out_is_made_takes_it_away(shared_run, tmp_path, monkeypatch, capsys):
    """A signal between the making of OUT/.parts and the scoring (the barrier after it starts JAX's backends: the
    moment a scheduler's SIGTERM came in the test above, once) left OUT behind, and the next run was refused."""
    from metatrain import distributed

    def barrier(name, timeout=1800):
        if name == "filter:made":
            raise KeyboardInterrupt

    monkeypatch.setattr(distributed, "barrier", barrier)
    path, _ = _corpus(tmp_path, n_docs=8)
    out = tmp_path / "cur"
    assert _filter(shared_run["workdir"], "--data", f"jsonl:{path}", "--out", out, "--drop", "0.3") == 130
    assert "metatrain filter: stopped by SIGINT" in capsys.readouterr().err and not out.exists()


def test_an_unexpected_error_leaves_no_output(shared_run, tmp_path, monkeypatch):
    """Any error while filtering (here a bug's AttributeError in the scoring pass, as a library's failed clean-up
    after a signal raises) takes OUT away, as a bad record or Ctrl-C does; the error itself is not hidden."""
    from metatrain import filtering

    def broken(*args, **kwargs):
        raise AttributeError("'RngStream' object has no attribute 'key'")

    monkeypatch.setattr(filtering, "_score_pass", broken)
    path, _ = _corpus(tmp_path, n_docs=8)
    out = tmp_path / "cur"
    with pytest.raises(AttributeError):
        _filter(shared_run["workdir"], "--data", f"jsonl:{path}", "--out", out, "--drop", "0.3")
    assert not out.exists()


@pytest.mark.parametrize("kind,n_docs,file", [("jsonl", 300, ".parts/scores-00000.bin"),
                                              ("parquet", 60, "part-00000.parquet")])
def test_a_full_disk_is_one_line_naming_the_file_and_leaves_nothing(shared_run, tmp_path, kind, n_docs, file):
    """A file size limit stands in for the full disk (writes fail alike, without root): at 4 KiB, 300 documents'
    scores (24 bytes each) do not fit; 60 fit, and the parquet part of the 30 kept then does not. The scores file
    died in numpy's `tofile` ("OSError: 4096 requested and 341 written", a traceback) and Arrow's error named no
    file ("writing a file failed")."""

    import pyarrow as pa
    import pyarrow.parquet as pq
    from helpers import metatrain, one_line_error

    path, lines = _corpus(tmp_path, n_docs=n_docs)
    if kind == "parquet":
        rows = [json.loads(line) for line in lines if line.strip()]
        path = tmp_path / "corpus.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    out = tmp_path / "cur"
    res = metatrain("filter", shared_run["workdir"], "--data", f"{kind}:{path}", "--out", out, "--drop", "0.5",
                    file_limit_kib=4)
    assert res.returncode == 2, res.stderr[-3000:]
    one_line_error(res.stderr, f"metatrain filter: error: writing {out}/{file} failed (File too large); make room "
                               "there and run again")
    assert not out.exists()
