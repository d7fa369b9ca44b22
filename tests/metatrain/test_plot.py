"""`metatrain plot`: the run report of one or several work dirs, and of runs without flags or a baseline."""

import json
import shutil

from metatrain import cli
from metatrain.plot import ema


def _png(path):
    return path.read_bytes()[:4] == b"\x89PNG"


def test_weights_that_are_not_finite_are_said_not_drawn(shared_run, tmp_path, capsys):
    """A run whose meta-training diverged has NaN weights: the report says so in the weights panel (matplotlib
    warned "All-NaN slice encountered" and drew nothing); some NaN weights leave the others drawn."""
    import warnings

    runs = []
    for name, nan_every in (("diverged", 1), ("partly", 2)):
        run = tmp_path / name
        shutil.copytree(shared_run["workdir"], run, ignore=shutil.ignore_patterns("checkpoints", "*.lock", ".lock"))
        weights = json.loads((run / "eval_weights.json").read_text())
        weights["weights"] = [float("nan") if i % nan_every == 0 else w for i, w in enumerate(weights["weights"])]
        (run / "eval_weights.json").write_text(json.dumps(weights))
        runs.append(str(run))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for argv in ([runs[0]], [runs[1]], runs):
            assert cli.main(["plot", *argv, "--out", str(tmp_path / "r.png")]) == 0
            assert _png(tmp_path / "r.png")


def test_two_workdirs_overlay(shared_run, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(shared_run["workdir"], other, ignore=shutil.ignore_patterns("checkpoints", "*.lock", ".lock"))
    assert cli.main(["plot", str(shared_run["workdir"]), str(other), "--out", str(tmp_path / "both.png")]) == 0
    assert _png(tmp_path / "both.png") and "both.png" in capsys.readouterr().out


def test_an_out_matplotlib_cannot_write_is_one_line_and_one_without_extension_is_named_as_written(shared_run, tmp_path,
                                                                                                 capsys):
    """`--out report.txt` ended in matplotlib's ValueError traceback; `--out report` printed "wrote report" where
    matplotlib wrote report.png."""
    run = str(shared_run["workdir"])
    assert cli.main(["plot", run, "--out", str(tmp_path / "report.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"metatrain plot: error: plot --out: {tmp_path / 'report.txt'} ends in .txt, which "
                          f"matplotlib does not write; give a .png path (or ") and "\n" not in err, err
    assert cli.main(["plot", run, "--out", str(tmp_path / "report")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'report.png'}\n" and _png(tmp_path / "report.png")


def test_a_file_or_a_missing_folder_given_as_a_run_is_named(shared_run, tmp_path, capsys):
    """`plot scores.jsonl` said that scores.jsonl ends in .jsonl, which matplotlib does not write: the first run is
    --out's default, and was checked as that before it was read as a run."""
    scores = tmp_path / "scores.jsonl"
    scores.write_text("{}\n")
    for args, says in (([scores], f"{scores}: a file, not a directory; give a metatrain work dir"),
                       ([shared_run["workdir"], tmp_path / "none"], f"{tmp_path / 'none'}: no such directory; give a "
                                                                     f"metatrain work dir")):
        assert cli.main(["plot", *map(str, args)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"metatrain plot: error: {says}") and "\n" not in err, err
    assert scores.read_text() == "{}\n"


def test_runs_without_flags_or_baseline_still_plot(shared_run, tmp_path):
    """Strip what a run without corruption flags and without a baseline lacks: the panels that apply remain."""
    run = tmp_path / "plain"
    run.mkdir()
    rows = [json.loads(x) for x in open(shared_run["workdir"] / "metrics.jsonl")]
    drop = ("baseline", "eval_auc", "eval_weight_c")
    rows = [{k: v for k, v in r.items() if not k.startswith(drop) and "baseline" not in k} for r in rows]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    weights = json.loads((shared_run["workdir"] / "eval_weights.json").read_text())
    (run / "eval_weights.json").write_text(json.dumps({**weights, "corrupted": None}))
    assert cli.main(["plot", str(run)]) == 0 and _png(run / "curves.png")
    (run / "eval_weights.json").unlink()  # a task without weights
    assert cli.main(["plot", str(run), "--out", str(run / "no_weights.png")]) == 0 and _png(run / "no_weights.png")


def test_ema_is_bias_corrected():
    assert ema([2.0, 2.0, 2.0]).tolist() == [2.0, 2.0, 2.0]
    smoothed = ema([0.0, 10.0], decay=0.5)
    assert smoothed[0] == 0.0 and abs(smoothed[1] - 10 * 0.5 / 0.75) < 1e-12


def test_a_series_of_one_point_is_drawn_as_a_dot(shared_run, tmp_path, monkeypatch):
    """A short run logs its training metrics at its last step only (log_every=10 by default): drawn as lines alone,
    its training losses, meta-gradient norm and population members were invisible, named only in the legends."""
    from metatrain import plot

    run = tmp_path / "short"
    run.mkdir()
    rows = [json.loads(x) for x in open(shared_run["workdir"] / "metrics.jsonl")]
    last = max(r["step"] for r in rows if "outer_loss" in r)
    rows = [r for r in rows if "eval_validation_loss" in r or r["step"] == last]  # one training row
    member = {"eval_validation_loss/member_0": 5.0, "eval_validation_loss/member_1": 5.1}
    rows = [{**r, **member} if "eval_validation_loss" in r and r["step"] == last else r for r in rows]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = []
    monkeypatch.setattr(plot.plt, "close", figures.append)
    plot.plot_runs([str(run)])
    drawn = [line for ax in figures[0].axes for line in ax.lines if line.get_alpha() != 0.2]  # the faint raw curves
    single = [line for line in drawn if len(line.get_xdata()) == 1]
    assert {line.get_label() for line in single} >= {"outer loss", "inner loss", "short", "members"}, single
    assert all(line.get_marker() not in ("None", "", None) for line in single), [
        line.get_label() for line in single if line.get_marker() in ("None", "", None)]
