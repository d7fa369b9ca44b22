"""The TPU side without a TPU: the launcher's dry run (what it ships, queued resources, the restart branch), and
compiling the outer step for v5p with libtpu."""

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time

import pytest
from helpers import TINY, checkpoints, env

from metatrain import aot, cli
from metatrain.launch import local, tpu

FAKE_BIN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fakes", "bin")  # a stand-in `gcloud`

BASE = ["--name", "mt", "--zone", "us-east5-a", "--project", "p1", "--accelerator-type", "v5p-16",
        "--workdir", "gs://bkt/runs/mt", "--dry-run"]


def _commands(out):
    return [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ ")]


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A git checkout with one committed file, one committed and edited, one ignored and an untracked task module;
    the current directory is the checkout, as when a user runs the launcher from it."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)
    git("init", "-q")
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (repo / "edited.py").write_text("A = 1\n")
    (repo / ".gitignore").write_text("runs/\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    (repo / "edited.py").write_text("A = 2\n")
    (repo / "runs").mkdir()
    (repo / "runs" / "big.bin").write_bytes(b"0" * 100)
    (repo / "mytasks.py").write_text("from metatrain.tasks import MAML\n\nclass Mine(MAML):\n    pass\n")
    monkeypatch.chdir(repo)
    return repo


def test_dry_run_ships_the_working_tree_and_the_task_module(checkout, capsys):
    assert tpu.main([*BASE, "--code", str(checkout), "--create", "--spot", "--", "train", "task=mytasks:Mine",
                     "steps=2000"]) == 0
    out = capsys.readouterr().out
    shipped = next(line for line in out.splitlines() if line.startswith("shipping "))
    assert shipped == f"shipping 4 files of the working tree of {checkout}, 2 of them not committed: edited.py, " \
                      f"mytasks.py"  # runs/ is ignored by git: not shipped
    assert "shipping on the workers' PYTHONPATH: mytasks.py" in out
    run = _commands(out)
    assert [c[:5] for c in run] == [["gcloud", "compute", "tpus", "tpu-vm", "create"],
                                    ["gcloud", "compute", "tpus", "tpu-vm", "scp"],
                                    ["gcloud", "compute", "tpus", "tpu-vm", "ssh"],
                                    ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]]
    create, scp, install, train = run
    assert {"mt", "--accelerator-type=v5p-16", "--version=v2-alpha-tpuv5", "--zone=us-east5-a", "--project=p1",
            "--spot"} <= set(create)
    assert "--worker=all" in scp and "--worker=all" in install and "--worker=all" in train
    assert any("pip install -q -e '.[tpu]'" in a for a in install)
    command = next(a for a in train if a.startswith("--command="))
    assert "echo $$ > ~/metatrain/run.pid && export PYTHONPATH=~/metatrain/user:~/metatrain/code " \
           "METATRAIN_DISTRIBUTED=auto && exec metatrain train task=mytasks:Mine steps=2000 workdir=gs://bkt/runs/mt" \
           in command
    restart = [line for line in out.splitlines() if line.startswith("#   ")]
    assert "tpu-vm delete mt" in restart[0] and "tpu-vm create mt" in restart[1]
    assert "--resume" in restart[-1] and restart[-1].rstrip().endswith("--zone=us-east5-a --project=p1")


def test_the_archive_holds_what_the_dry_run_names(checkout, tmp_path):
    args = tpu.build_parser().parse_args([*BASE, "--code", str(checkout), "--include", str(checkout / "edited.py"),
                                          "--", "train", "task=mytasks:Mine"])
    args.command = args.command[1:]
    items, _ = tpu.shipment(args)
    with tarfile.open(tpu.pack(items, tmp_path / "a.tar.gz")) as tar:
        names = sorted(tar.getnames())
        edited = tar.extractfile("code/edited.py").read()
    assert names == ["code/.gitignore", "code/edited.py", "code/mytasks.py", "code/pyproject.toml",
                     "user/edited.py", "user/mytasks.py"]
    assert edited == b"A = 2\n"  # the working tree, not the last commit


def test_queued_resources(checkout, capsys):
    assert tpu.main([*BASE, "--code", str(checkout), "--create", "--queued", "--spot", "--", "train", "maml"]) == 0
    out = capsys.readouterr().out
    create = _commands(out)[0]
    assert create[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "mt"]
    assert {"--node-id=mt", "--accelerator-type=v5p-16", "--runtime-version=v2-alpha-tpuv5", "--spot",
            "--zone=us-east5-a", "--project=p1"} <= set(create)
    assert "until it prints ACTIVE: gcloud compute tpus queued-resources describe mt " \
           "'--format=value(state.state)'" in out
    assert "queued-resources delete mt --force --quiet" in out  # the restart branch


def test_launcher_needs_a_command(capsys):
    with pytest.raises(SystemExit):
        tpu.main(["--name", "mt", "--zone", "z", "--workdir", "w", "--dry-run"])
    assert "give the metatrain command" in capsys.readouterr().err


def test_a_negative_restart_count_is_refused(capsys):
    with pytest.raises(SystemExit):
        tpu.main(["--name", "x", "--zone", "z", "--workdir", "gs://b/r", "--max-restarts", "-1", "--", "train"])
    assert "argument --max-restarts: must be >= 0, got -1" in capsys.readouterr().err


def test_a_work_dir_the_launcher_would_wipe_is_refused(checkout, capsys):
    """A relative work dir lands in the code folder every (re)start replaces: after a preemption `--resume` would
    find no checkpoint and the run's steps would be lost."""
    with pytest.raises(SystemExit):
        tpu.main(["--name", "mt", "--zone", "z", "--workdir", "runs/mt", "--dry-run", "--", "train"])
    err = capsys.readouterr().err
    assert "--workdir runs/mt: a relative path is inside ~/metatrain/code" in err and "gs://BUCKET" in err
    assert tpu.main(["--name", "mt", "--zone", "z", "--workdir", "/mnt/shared/mt", "--code", str(checkout),
                     "--dry-run", "--", "train"]) == 0  # a shared mount may be right: said, not refused
    assert "is not a gs:// path: every worker must see the same folder" in capsys.readouterr().err


@pytest.mark.parametrize("accelerator, says", [
    ("v5p-7", "--accelerator-type v5p-7: no such slice; v5p types count TensorCores, two per chip (v5p-8: 4 chips)"),
    ("v4-0", "--accelerator-type v4-0: no such slice; v4 types count TensorCores"),
    ("v5litepod-0", "--accelerator-type v5litepod-0: no such slice; give its chips, e.g. v5litepod-8"),
])
def test_a_slice_that_cannot_exist_is_refused(accelerator, says, checkout, capsys):
    """v5p-7 was read as 3 chips, had no default shape, and the mesh check was skipped; gcloud refused it at create."""
    args = [accelerator if a == "v5p-16" else a for a in BASE]
    with pytest.raises(SystemExit) as e:
        tpu.main([*args, "--code", str(checkout), "--create", "--", "train"])
    out, err = capsys.readouterr()
    assert e.value.code == 2
    assert err.strip().splitlines()[-1].startswith(f"python -m metatrain.launch.tpu: error: {says}"), err
    assert not _commands(out)


@pytest.mark.parametrize("command, says", [
    (["train", "steps=abc"], "python -m metatrain.launch.tpu: error: the metatrain command after --: steps: 'abc' "
                             "is not a whole number"),
    (["train", "maml", "model.d_modle=64"], "python -m metatrain.launch.tpu: error: the metatrain command after --: "
                                            "model.d_modle: no such setting; did you mean model.d_model?"),
    (["pretrain", "nosuchpreset"], "python -m metatrain.launch.tpu: error: the metatrain command after --: preset: "
                                   "no config 'nosuchpreset'"),
    (["train", "task=mytask:Mine"], "python -m metatrain.launch.tpu: error: the metatrain command after --: task: "
                                    "task 'mytask:Mine': cannot import module 'mytask'"),
    (["train", "--bogus"], "metatrain train: error: unrecognized arguments: --bogus"),
    # BASE's v5p-16: 16 TensorCores, 8 chips, a device each
    (["train", "mesh.fsdp=3"], "python -m metatrain.launch.tpu: error: the metatrain command after --: mesh: data=-1 "
                               "x fsdp=3 does not divide the 8 devices"),
    (["train", "data.batch=12"], "python -m metatrain.launch.tpu: error: the metatrain command after --: data.batch: "
                                 "12 does not divide over the 8 data x fsdp devices"),
])
def test_a_bad_metatrain_command_is_refused_before_anything_runs(command, says, checkout, capsys):
    """Checked here, not on the workers after the slice is created and the code installed."""
    with pytest.raises(SystemExit) as e:
        tpu.main([*BASE, "--code", str(checkout), "--create", "--", *command])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and err.strip().splitlines()[-1].startswith(says), err
    assert "shipping" not in out and not _commands(out)


def test_the_files_a_command_names_are_the_workers(checkout, capsys):
    """Checkpoints to start from are paths on the workers: not looked for here. The user's task module is imported
    for the check from the current directory, and left out of this process's modules afterwards."""
    assert tpu.main([*BASE, "--code", str(checkout), "--", "train", "task=mytasks:Mine",
                     "inner.init_from=/data/pretrained"]) == 0
    assert "mytasks" not in sys.modules
    assert tpu.main([*BASE, "--code", str(checkout), "--", "train", "meta_model.init_from=/data/scorer"]) == 0
    assert "metatrain train task=mytasks:Mine inner.init_from=/data/pretrained" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.tpu_backend
def test_compile_on_v5p_2x2x1_fits_with_fsdp(tmp_path):
    """In a process of its own, as a user runs it on a machine without a TPU: libtpu prints nothing (it would ask
    the cloud metadata server what TPU this host has, and print the failure as errors)."""
    pytest.importorskip("libtpu", reason="needs the tpu extra (CI installs it): pip install -e '.[tpu]'")
    from metatrain import models

    out = tmp_path / "compile.json"
    # d_model 512: a quarter of it per chip is 128 columns, a whole TPU tile (narrower shards are padded to one)
    # (one inner step: what is checked does not depend on T, and libtpu compiles it in 7 CPU s instead of 13)
    flags = ["--model", "44m", "--n-layers", "1", "--d-ff", "512", "--vocab", "1024", "--seq-len", "64", "--batch", "4",
             "--inner-steps", "1"]
    clean = {k: v for k, v in env().items() if not k.startswith("TPU_")}
    res = subprocess.run([sys.executable, "-m", "metatrain.cli", "compile", "--topology", "v5p:2x2x1", *flags, "--json",
                          str(out)], env=clean, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    noise = [line for line in res.stderr.splitlines() if "WARNING" in line or line.startswith(("E0000", "==="))]
    assert not noise, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["devices"] == 4 and report["mesh"] == {"data": 1, "fsdp": 4} and report["fits"]
    # FSDP: each chip holds a quarter of η and the meta-optimizer state (3 float32 copies of the parameters), a
    # little more where the TPU pads the heads' 64-wide dimension to its 128-wide tiles; replicated: all of it
    state = 3 * 4 * models.param_count(models.preset("44m", n_layers=1, d_ff=512, vocab_size=1024))
    assert 0.25 * state < report["argument_bytes"] < 0.5 * state and 0 < report["peak_bytes"] < report["hbm_bytes"]
    assert "fits:" in res.stdout
    if report["temp_sum_bytes"] > report["peak_bytes"]:  # libtpu's temp counts more than is live at once
        assert f"+ temp, {report['temp_sum_bytes'] / 2**30:.3f} GiB, is above it)" in res.stdout, res.stdout


def test_compile_reports_what_does_not_fit(capsys, monkeypatch, tmp_path):
    """The report of a program over HBM: exact figures compiled past the limit with the refusal's estimate beside
    them, or, where that failed too, the refusal alone; exit 1 either way. (Compiling past the limit is tested on
    libtpu in tests/metatrain/bench/test_memory.py; a real over-HBM outer step takes minutes to compile.)"""
    from metatrain.bench import compile as compile_lib

    G, hbm = 2**30, 95.74 * 2**30
    refusal = "RESOURCE_EXHAUSTED: Ran out of memory on HBM, ... (96.82G) exceeds available HBM (95.74G)."
    over = {"mesh": {"data": 1, "fsdp": 1}, "devices": 1, "backend": "tpu", "hbm_bytes": hbm, "exact": True,
            "plan": "two_steps+peeled+seeded",
            "argument_bytes": 1 * G, "output_bytes": G, "alias_bytes": G, "temp_bytes": 96.8 * G,
            "temp_sum_bytes": 97.8 * G, "peak_bytes": 97.3 * G, "fits": False, "refused_bytes": 96.82 * G,
            "message": refusal}
    failed = {k: over[k] for k in ("mesh", "devices", "backend", "hbm_bytes", "plan", "refused_bytes", "message")} | {
        "exact": False, "fits": False, "peak_bytes": None}
    flags = ["compile", "--topology", "v5p:1x1x1", "--model", "44m", "--n-layers", "1", "--mode", "autodiff"]
    monkeypatch.setattr(aot, "libtpu_installed", lambda: True)  # the stand-in reports: no libtpu needed
    for report, lines in ((over, ["per-device memory: argument 1.000 GiB, output 1.000 GiB, alias 1.000 GiB, "
                                  "temp 96.800 GiB, peak 97.300 GiB", "does NOT fit: 97.30 of 95.74 GiB (102%)",
                                  "alias + temp, 97.800 GiB, is above it)",
                                  "(the TPU compiler refused it first, estimating 96.82 GiB: RESOURCE_EXHAUSTED"]),
                          (failed, ["does NOT fit: the TPU compiler refused it, estimating 96.82 GiB of 95.74 (",
                                    "compiling it past the limit failed too"])):
        monkeypatch.setattr(compile_lib, "compile_report", lambda cfg, topology, r=report: r)
        out = tmp_path / "r.json"
        assert cli.main([*flags, "--json", str(out)]) == 1
        printed = capsys.readouterr().out
        assert all(line in printed for line in lines), printed
        assert json.loads(out.read_text())["exact"] is report["exact"]


@pytest.mark.parametrize("fsdp, says", [
    ("0", "argument --fsdp: must be -1 (all the devices) or >= 1, got 0"),
    ("two", "argument --fsdp: 'two' is not a whole number"),
    # this process has one CPU device (tests/conftest.py)
    ("2", "--fsdp 2 does not divide the 1 device here; give one of 1, or -1 (all of them)"),
])
def test_a_bad_fsdp_size_is_named_by_its_flag(capsys, fsdp, says):
    """`compile --fsdp` sets mesh.fsdp: the error names the flag the user gave, not the config key."""
    with pytest.raises(SystemExit) if not says.startswith("--") else contextlib.nullcontext():
        assert cli.main(["compile", "--model", "tiny", "--fsdp", fsdp]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1] == f"metatrain compile: error: {says}", err


@pytest.mark.parametrize("topology, says", [
    ("v5p", "write it as GENERATION:AxBxC"),
    ("v9x:2x2x1", "unknown TPU generation 'v9x'"),
    ("v5p:0x1x1", "every size must be at least 1 chip"),
])
def test_a_bad_topology_is_a_one_line_error(capsys, topology, says):
    assert cli.main(["compile", "--topology", topology, "--model", "tiny"]) == 2
    out, err = capsys.readouterr()
    assert not out, out  # refused before the command's first line
    err = err.strip()
    assert err.startswith("metatrain compile: error: --topology") and says in err and "\n" not in err
    assert "pip install" not in err


@pytest.mark.tpu_backend
def test_describing_a_topology_leaves_no_tpu_host_in_the_environment(monkeypatch):
    """libtpu gets a TPU type and host name while it starts (no metadata-server errors); a process started after
    must not inherit them and take itself for a TPU VM."""
    pytest.importorskip("libtpu", reason="needs the tpu extra (CI installs it): pip install -e '.[tpu]'")
    from metatrain import aot

    for key in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(key, raising=False)
    devices, _ = aot.topology_devices("v5p:2x2x1")
    assert len(devices) == 4
    assert "TPU_ACCELERATOR_TYPE" not in os.environ and "TPU_WORKER_HOSTNAMES" not in os.environ
    child = subprocess.run([sys.executable, "-c", "from metatrain import distributed; print(distributed._detected())"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "None", child.stdout  # a metatrain run started now joins no cluster


@pytest.mark.parametrize("flags, says", [
    # an installed package (not a checkout) was shipped, and every worker's `pip install -e .` failed on it
    (["--code", "{pkg}"], "--code {pkg}: not a metatrain checkout (no pyproject.toml)"),
    # an empty value (an unset shell variable): --code '' shipped the current folder, --zone '' reached gcloud
    (["--name", ""], "argument --name: empty (as an unset shell variable leaves it); give one"),
    (["--zone", ""], "argument --zone: empty"),
    (["--code", ""], "argument --code: empty (as an unset shell variable leaves it); give one, or leave out --code"),
    (["--include", ""], "argument --include: empty"),
    (["--name", "My VM"], "--name 'My VM': a TPU VM's name is a lowercase letter"),
    (["--name", "mt-"], "--name 'mt-': a TPU VM's name"),
    (["--include", "nope.py"], "--include nope.py: no such file or folder"),  # was exit 1 and no usage prefix
])
def test_what_gcloud_or_the_workers_would_refuse_is_one_line_before_anything_runs(flags, says, checkout, tmp_path,
                                                                                  capsys):
    pkg = tmp_path / "site-packages" / "metatrain"
    (pkg / "launch").mkdir(parents=True)
    (pkg / "launch" / "tpu.py").write_text("")
    flags = [f.format(pkg=pkg) for f in flags]
    with pytest.raises(SystemExit) as e:
        tpu.main([*BASE, "--code", str(checkout), *flags, "--", "train"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.splitlines()[-1].startswith(
        f"python -m metatrain.launch.tpu: error: {says.format(pkg=pkg)}"), err


@pytest.mark.slow
def test_ctrl_c_stops_the_run_on_every_worker_after_it_saves(checkout, tmp_path):
    """A terminal's Ctrl-C (SIGINT to the launcher's process group) ended the launcher with a traceback and killed
    the ssh connections, leaving the run on the workers without its reader: it ran on, or died at its next write,
    unsaved. The launcher now keeps those connections (a process group of their own), passes SIGTERM on to the run
    on every worker, streams its stop line (each saves its step) and exits 130. The slice is a stand-in
    (tests/fakes/bin/gcloud): its one worker is a folder here."""
    workdir = tmp_path / "run"
    root = tmp_path / "tpu"
    e = env(1, FAKE_TPU_ROOT=str(root), FAKE_TPU_BIN=os.path.dirname(sys.executable),
            FAKE_TPU_PORT=str(local.free_port()), PATH=FAKE_BIN + os.pathsep + os.environ["PATH"])
    launcher = subprocess.Popen([sys.executable, "-m", "metatrain.launch.tpu", "--name", "mt", "--zone", "z",
                                 "--code", str(checkout), "--workdir", str(workdir), "--", "train", *TINY,
                                 "steps=100000", "checkpoint_every=0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=e, start_new_session=True)
    metrics, deadline = workdir / "metrics.jsonl", time.time() + 300
    try:
        while not (metrics.exists() and metrics.stat().st_size > 0):  # training has started on the worker
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.time() < deadline, "no step within 300 s"
            time.sleep(0.2)
        os.killpg(launcher.pid, signal.SIGINT)  # as a terminal sends Ctrl-C: to its foreground process group
        _, err = launcher.communicate(timeout=120)
    finally:
        left = subprocess.run(["pkill", "-KILL", "-f", f"workdir={workdir}"]).returncode == 0
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130 and not left, err[-3000:]
    step = checkpoints(workdir)[-1]
    assert f"metatrain train: stopped by SIGTERM at step {step}; checkpoint {step} saved" in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"launch.tpu: stopped by SIGINT; the same command with --resume continues "
                                            f"the run from its last checkpoint in {workdir}"), err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_signal_before_the_run_stops_the_gcloud_command_that_runs(checkout, tmp_path):
    """SIGTERM to the launcher while it creates the slice: the launcher died alone and gcloud went on; a terminal's
    Ctrl-C ended it with a traceback. The command that runs is stopped and the launcher says so, exit 143."""
    e = env(1, FAKE_TPU_ROOT=str(tmp_path / "tpu"), FAKE_TPU_BIN=os.path.dirname(sys.executable),
            FAKE_TPU_CREATE_SECONDS="600", PATH=FAKE_BIN + os.pathsep + os.environ["PATH"])
    launcher = subprocess.Popen([sys.executable, "-m", "metatrain.launch.tpu", "--name", "mt", "--zone", "z",
                                 "--code", str(checkout), "--workdir", "gs://b/r", "--create", "--", "train"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
    try:
        deadline = time.time() + 60
        while not (gcloud := _child_running(launcher.pid, "tpu-vm create")):  # its own, not another test's
            assert launcher.poll() is None and time.time() < deadline, launcher.communicate()[1][-3000:]
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == ("launch.tpu: stopped by SIGTERM while `gcloud compute tpus tpu-vm create "
                                            "...` ran"), err[-3000:]
    assert not os.path.exists(f"/proc/{gcloud}"), "the gcloud command runs on"


def _child_running(parent: int, command: str) -> int | None:
    """The process id of a child of `parent` whose command line holds `command`, if one runs."""
    for line in subprocess.run(["pgrep", "-P", str(parent), "-af", "gcloud"], capture_output=True,
                               text=True).stdout.splitlines():
        if command in line:
            return int(line.split()[0])
    return None


def test_a_queued_resource_is_waited_for_with_a_line_per_state(tmp_path, monkeypatch, capsys):
    """A queue can take hours: its describe command is printed once, then each new state in one line (it printed
    the command every 30 s and no state)."""
    monkeypatch.setenv("PATH", FAKE_BIN + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("FAKE_TPU_ROOT", str(tmp_path))
    monkeypatch.setenv("FAKE_TPU_QUEUED", "WAITING_FOR_RESOURCES,WAITING_FOR_RESOURCES,WAITING_FOR_RESOURCES,"
                                          "PROVISIONING,ACTIVE")
    args = tpu.build_parser().parse_args([*BASE[:-1], "--create", "--queued", "--spot", "--", "train"])
    sh, waits = tpu.Runner(args), []
    monkeypatch.setattr(sh, "sleep", waits.append)
    assert tpu.bring_up(args, sh) == 0
    out, err = capsys.readouterr()
    assert waits == [30] * 4 and (tmp_path / "queued-describes").read_text() == "5"
    assert [c[3:5] for c in _commands(out)] == [["queued-resources", "create"], ["queued-resources", "describe"]]
    lines = [re.sub(r"\(after \d+ s\)$", "(after N s)", line) for line in err.splitlines()]
    assert lines == ["launch.tpu: the queued resource mt is WAITING_FOR_RESOURCES",
                     "launch.tpu: the queued resource mt is PROVISIONING (after N s)",
                     "launch.tpu: the queued resource mt is ACTIVE (after N s)"]
