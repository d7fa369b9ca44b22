"""The curation experiment end to end at the micro scale, on a small slice of make-noisy's corpus."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from metatrain.curation_report import tokens_to_reach

LINE = re.compile(r"^arm (unfiltered|rater|random|ppl_low|ppl_mid|ppl_high|oracle) drop (\d\.\d\d) nll (\d+\.\d{4}) "
                  r"gross_gain (-?\d+\.\d{3}|nan) net_gain (-?\d+\.\d{3}|nan)$")


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
    assert arms == [("unfiltered", "0.00"), ("rater", "0.50"), ("random", "0.50"), ("ppl_low", "0.50"),
                    ("ppl_mid", "0.50"), ("ppl_high", "0.50"), ("oracle", arms[-1][1])]
    report = json.loads((tmp_path / "exp" / "report" / "report.json").read_text())
    unfiltered = report["arms"][0]
    assert unfiltered["gross_gain"] == 0 and len(unfiltered["nll_seeds"]) == 2
    oracle = report["arms"][-1]
    labels = [json.loads(line)["defect"] for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    assert oracle["kept"] == labels.count("none") and oracle["of"] == len(labels)
    assert set(report["defects"]["0.5"]) == set(labels)
    assert report["cost_tokens"]["rater"] > 0 and report["cost_tokens"]["ppl"] > report["budget_tokens"]
    assert (tmp_path / "exp" / "report" / "curves.png").stat().st_size > 0
    assert "Best ρ for the rater" in (tmp_path / "exp" / "report" / "report.md").read_text()
    assert "[14/14] arm oracle seed 1" in done.stderr  # progress: arms done of all
    # the same directory with other settings is refused in one line
    other = subprocess.run(command[:-2] + ["--seeds", "3", "--data", "data"], cwd=tmp_path, capture_output=True,
                           text=True)
    assert other.returncode == 2 and "seeds" in other.stderr.splitlines()[-1]


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
