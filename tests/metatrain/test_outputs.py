"""Where commands write: an output path is checked before any work, and nothing a user wrote is ever replaced
(`paths.output`, `paths.output_dir`, `paths.output_file`). Each case is a probe that once ended in a traceback, a
hang, a wrong file or lost files."""

import json
import os
import shutil

import pytest
from helpers import cli_run as _main
from helpers import metatrain, one_line_error

from metatrain import cli


def test_export_never_replaces_a_users_files(shared_run, tmp_path, capsys):
    run = shared_run["workdir"]
    user = tmp_path / "userproj"
    (user / "params").mkdir(parents=True)
    (user / "params" / "hyper.yaml").write_text("mine")
    (user / "export.json").write_text('{"mine": true}')
    for extra in ((), ("--overwrite",)):
        code, _, err = _main(capsys, "export", run, "--out", user, *extra)
        assert code == 2
        one_line_error(err, f"export --out: {user}")
    assert (user / "params" / "hyper.yaml").read_text() == "mine" and json.loads((user / "export.json").read_text())
    # the run's own work dir (exporting there hid the run from `export`), a file
    code, _, err = _main(capsys, "export", run, "--out", run)
    one_line_error(err, "is the source itself")
    (tmp_path / "afile").write_text("x")
    for fmt in ("orbax", "hf"):
        code, _, err = _main(capsys, "export", run, "--out", tmp_path / "afile", "--format", fmt, "--what", "meta")
        assert code == 2
        one_line_error(err, "is a file")
        # below a file: a NotADirectoryError traceback
        code, _, err = _main(capsys, "export", run, "--out", tmp_path / "afile" / "x", "--format", fmt, "--what",
                             "meta")
        assert code == 2
        one_line_error(err, f"export --out: {tmp_path / 'afile'} is a file, so {tmp_path / 'afile' / 'x'} cannot be "
                            f"made; give another path")
    # an earlier export: refused, then replaced with --overwrite
    out = tmp_path / "exp"
    assert _main(capsys, "export", run, "--out", out)[0] == 0
    code, _, err = _main(capsys, "export", run, "--out", out)
    one_line_error(err, "already exists", "--overwrite")
    assert _main(capsys, "export", run, "--out", out, "--overwrite")[0] == 0
    assert json.loads((out / "export.json").read_text())["what"] == "meta"


def test_import_hf_checks_its_output_first(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    code, _, err = _main(capsys, "import", "hf", tmp_path / "no-model", "--out", tmp_path / "afile")
    assert code == 2
    one_line_error(err, "import hf --out", "is a file")
    code, _, err = _main(capsys, "import", "hf", tmp_path, "--out", tmp_path)
    one_line_error(err, "is the model dir itself")


def test_scores_and_plot_outputs(shared_run, tmp_path, capsys):
    run = shared_run["workdir"]
    code, _, err = _main(capsys, "scores", run, "--out", tmp_path)  # an existing dir: refused before scoring
    assert code == 2
    one_line_error(err, "scores --out", "is a directory")
    with pytest.raises(SystemExit):  # argparse: nothing to score
        cli.main(["scores", str(run), "--max-rows", "0"])
    assert "must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["eval", str(run), "--max-docs", "-1"])
    assert "must be >= 0" in capsys.readouterr().err
    # a missing folder is made; a directory given to plot gets curves.png
    assert _main(capsys, "plot", run, "--out", tmp_path / "new" / "x.png")[0] == 0
    assert (tmp_path / "new" / "x.png").stat().st_size > 0
    code, out, _ = _main(capsys, "plot", run, "--out", tmp_path / "new")
    assert code == 0 and out.strip() == f"wrote {tmp_path / 'new' / 'curves.png'}"
    assert (tmp_path / "new" / "curves.png").is_file() and not (tmp_path / "new.png").exists()


def test_a_json_path_is_checked_before_any_work(tmp_path, capsys):
    """Every command's --json: a bad path is one line before anything runs (it was a traceback once the benchmark
    had run, its figures lost); a missing folder is made."""
    (tmp_path / "afile").write_text("x")
    for argv in (["bench", "time", "--model", "tiny"], ["bench", "generate", "--model", "tiny"], ["compile"],
                 ["check-grads", "--task", "maml"]):
        for bad, says in ((tmp_path / "afile" / "sub" / "x.json", "is a file"), (tmp_path, "is a directory")):
            code, out, err = _main(capsys, *argv, "--json", bad)
            assert code == 2 and not out, out  # refused before the command's first line
            one_line_error(err, "--json", str(bad), says)
    out = tmp_path / "new" / "deeper" / "g.json"
    code, printed, _ = _main(capsys, "bench", "generate", "--model", "tiny", "--prompt-len", "1", "--new-tokens", "1",
                             "--json", out)
    assert code == 0 and f"wrote {out}" in printed and json.loads(out.read_text())["new_tokens"] == 1
    with pytest.raises(SystemExit):  # argparse
        cli.main(["bench", "time", "--warmup", "-1"])
    assert "--warmup: must be >= 0" in capsys.readouterr().err


def test_plot_reads_a_cut_off_and_a_resumed_metrics_file(shared_run, tmp_path, capsys):
    """A run killed mid-write leaves half a line; a run resumed from an earlier checkpoint writes its steps again."""
    from metatrain.plot import _rows

    run = tmp_path / "run"
    shutil.copytree(shared_run["workdir"], run, ignore=shutil.ignore_patterns("checkpoints", ".lock"))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    train = [json.loads(line) for line in lines if "meta_grad_norm" in line]
    again = [dict(r, outer_loss=r["outer_loss"] + 1) for r in train[2:]]  # steps 3.. again, after a resume
    text = "\n".join(lines + [json.dumps(r) for r in again]) + '\n{"step": 5, "outer_lo'
    (run / "metrics.jsonl").write_text(text)
    rows = _rows(str(run / "metrics.jsonl"))
    steps = [r["step"] for r in rows if "meta_grad_norm" in r]
    assert steps == sorted(set(steps)) == [r["step"] for r in train]
    assert [r["outer_loss"] for r in rows if "meta_grad_norm" in r][2:] == [r["outer_loss"] for r in again]
    assert "cut off" in capsys.readouterr().err
    assert _main(capsys, "plot", run)[0] == 0


# ---- one rule for outputs: scores, filter, data make-noisy / make-chat, experiment curation -----------------------
def _docs(path, n=40, bad_at=None):
    lines = [json.dumps({"id": f"d{i}", "text": f"document {i}: " + " ".join(f"w{j}" for j in range(i % 5, 40))})
             for i in range(n)]
    if bad_at is not None:
        lines[bad_at] = '{"id": "broken", "text": '
    path.write_text("\n".join(lines) + "\n")
    return path


def test_scores_never_writes_over_its_input_or_an_earlier_file(shared_run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    corpus = _docs(tmp_path / "corpus.jsonl")
    before = corpus.read_bytes()
    run = shared_run["workdir"]
    for out in ("corpus.jsonl", str(corpus)):  # relative or absolute: the user's corpus is refused before any read
        for extra in ((), ("--overwrite",)):
            code, _, err = _main(capsys, "scores", run, "--data", "jsonl:corpus.jsonl", "--out", out, *extra)
            assert code == 2
            one_line_error(err, "scores --out", "is one of the command's inputs")
    assert corpus.read_bytes() == before
    code, _, err = _main(capsys, "scores", run, "--data", "jsonl:corpus.jsonl", "--out", "afile/s.jsonl")
    assert code == 0  # a missing folder is made
    code, _, err = _main(capsys, "scores", run, "--data", "jsonl:corpus.jsonl", "--out", "afile/s.jsonl")
    one_line_error(err, "scores --out", "already exists", "--overwrite")
    assert _main(capsys, "scores", run, "--data", "jsonl:corpus.jsonl", "--out", "afile/s.jsonl", "--overwrite")[0] == 0
    assert len((tmp_path / "afile" / "s.jsonl").read_text().splitlines()) == 40
    code, _, err = _main(capsys, "scores", run, "--data", "jsonl:corpus.jsonl", "--out", "corpus.jsonl/s.jsonl")
    one_line_error(err, "scores --out", "is a file")


def test_scores_stopped_by_a_bad_record_or_a_signal_leaves_no_temporary_file(shared_run, tmp_path, capsys,
                                                                            monkeypatch):
    run = shared_run["workdir"]
    bad = _docs(tmp_path / "bad.jsonl", n=60, bad_at=45)
    code, _, err = _main(capsys, "scores", run, "--data", f"jsonl:{bad}", "--out", tmp_path / "new" / "s.jsonl")
    assert code == 2
    one_line_error(err, "bad.jsonl:46")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no s.jsonl.tmp, no folder made for it
    from metatrain import scores as scores_lib

    def interrupted(*a, **k):  # Ctrl-C (or SIGTERM, which the command line turns into the same) while scoring
        yield from ()
        raise KeyboardInterrupt

    monkeypatch.setattr(scores_lib, "score_stream", interrupted)
    code, _, err = _main(capsys, "scores", run, "--data", f"jsonl:{_docs(tmp_path / 'ok.jsonl')}", "--out",
                         tmp_path / "s.jsonl")
    assert code == 130 and "stopped by SIGINT" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "ok.jsonl"]


def test_make_noisy_and_make_chat_check_out_and_leave_nothing_when_stopped(tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("mine")
    for cmd in ("make-noisy", "make-chat"):
        code, _, err = _main(capsys, "data", cmd, "--out", tmp_path / "afile" / "sub")
        assert code == 2
        one_line_error(err, f"data {cmd} --out", "afile is a file")
        code, _, err = _main(capsys, "data", cmd, "--out", tmp_path / "afile")
        one_line_error(err, f"data {cmd} --out", "is a file; give a new directory")
    assert (tmp_path / "afile").read_text() == "mine"
    from metatrain.data import noisy

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(noisy.json, "dump", stop)  # the manifest, written last
    assert _main(capsys, "data", "make-noisy", "--out", tmp_path / "new" / "noisy")[0] == 130
    (tmp_path / "empty").mkdir()
    assert _main(capsys, "data", "make-noisy", "--out", tmp_path / "empty")[0] == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "empty"] and not any((tmp_path / "empty").iterdir())


def test_an_output_in_a_folder_that_cannot_be_written_is_one_line_before_any_work(shared_run, tmp_path, capsys,
                                                                                  monkeypatch):
    """A read-only folder (a mount, another user's dir) under OUT: a traceback once the work was done (scores: at
    the rename of its temporary file), or at the first makedirs. As root the kernel lets every folder be written,
    so os.access stands in there."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.access(locked, os.W_OK):  # root
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **k: False if str(p) == str(locked) else real(p, mode, **k))
    for argv, flag, out in ((["data", "make-noisy", "--out"], "data make-noisy --out", locked / "noisy"),
                            (["data", "make-chat", "--out"], "data make-chat --out", locked / "a" / "chat"),
                            (["scores", shared_run["workdir"], "--out"], "scores --out", locked / "s.jsonl"),
                            (["experiment", "curation", "--scale", "micro"], "experiment curation DIR", locked / "x")):
        code, printed, err = _main(capsys, *argv, out)
        assert code == 2 and "wrote" not in printed
        one_line_error(err, f"{flag}: {locked} is not writable, so {out} cannot be made; give another path")
    assert not any(locked.iterdir())


def test_a_folder_the_kernel_refuses_though_access_allows_is_one_line_before_any_work(capsys):
    """/proc and /sys: os.access lets root write there, creating a file does not (ENOENT, EACCES), and the --json of a
    compile was a traceback once the compile was done. As another user os.access already refuses them."""
    for argv, out, said in ((["compile", "--json"], "/proc/x.json", "--json: /proc is not writable"),
                            (["compile", "--json"], "/sys/kernel/a/x.json", "--json: /sys/kernel is not writable"),
                            (["data", "make-noisy", "--out"], "/proc/noisy", "data make-noisy --out: /proc is not "
                                                                             "writable")):
        code, printed, err = _main(capsys, *argv, out)
        assert code == 2 and not printed, printed
        one_line_error(err, said, f"so {out} cannot be")
    assert not os.path.exists("/sys/kernel/a")


def test_experiment_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    code, _, err = _main(capsys, "experiment", "curation", tmp_path / "afile", "--scale", "micro")
    assert code == 2
    one_line_error(err, "experiment curation DIR", "is a file")
    assert (tmp_path / "afile").read_text() == "mine"


def test_sigterm_stops_a_command_like_ctrl_c():
    """The command line turns SIGTERM into the interrupt its commands clean up after, exit 128 + 15."""
    import os
    import signal

    from metatrain.cli import build_parser

    def fake(args):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the command")

    parser = build_parser()
    real = parser.parse_known_args
    try:
        cli.build_parser = lambda: type("P", (), {"_actions": parser._actions, "parse_known_args": lambda self, argv: (
            _with_fn(real(argv)[0], fake), [])})()
        assert cli.main(["data", "make-noisy", "--out", "x"]) == 143
    finally:
        cli.build_parser = build_parser
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # given back


def _with_fn(args, fn):
    args.fn = fn
    return args


def test_export_that_cannot_write_is_one_line_and_leaves_nothing(shared_run, tmp_path):
    """A full disk while `export` wrote gave Orbax's traceback and left a half-written `params.orbax-checkpoint-tmp`
    in OUT. A file size limit stands in for the full disk (its writes fail alike, without root)."""
    out = tmp_path / "sub" / "export"
    res = metatrain("export", shared_run["workdir"], "--out", out, file_limit_kib=4)
    assert res.returncode == 2, res.stderr[-3000:]
    one_line_error(res.stderr, f"metatrain export: error: writing {out}/params.orbax-checkpoint-tmp/",
                   "failed (File too large); make room there and run again")
    assert "--resume" not in res.stderr  # export has none
    assert not (tmp_path / "sub").exists()
