"""The multi-host path on one machine: 2 processes x 2 CPU devices against 1 process on 1 device, resume across a
2-process restart, and a dead process stopping the job."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    FLOAT64,
    FLOAT64_ENV,
    TINY,
    assert_same_first_meta_gradient,
    assert_same_float64,
    env,
    metatrain,
    saved_float64_state,
)

from metatrain.launch import local

pytestmark = pytest.mark.slow
MULTI = [*TINY, "mesh.fsdp=2", "data.shards=2"]


@contextlib.contextmanager
def two_processes(command: list[str], extra_env: dict | None = None):
    """`python COMMAND` as processes 0 and 1 of one job (2 CPU devices each), stderr captured as text; whichever is
    still running on the way out is killed."""
    port = local.free_port()
    procs = [subprocess.Popen([sys.executable, *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=env(2, METATRAIN_COORDINATOR=f"127.0.0.1:{port}", METATRAIN_NUM_PROCESSES="2",
                                      METATRAIN_PROCESS_ID=str(i), **(extra_env or {})))
             for i in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


LATE_PEER = """
import os, sys, time
from metatrain import cli, trainer

compile_ = trainer.Trainer._compile


def slower(self, program):  # process 1 compiles 40 s longer, as on a loaded machine
    out = compile_(self, program)
    time.sleep(40 if os.environ["METATRAIN_PROCESS_ID"] == "1" else 0)
    return out


trainer.Trainer._compile = slower
sys.exit(cli.main(sys.argv[1:]))
"""


def test_two_processes_match_one_and_resume(tmp_path, monkeypatch):
    """Float64 runs (the same numbers up to the order of float64 reductions, on any machine): a 2-process job whose
    process 1 compiles 40 s longer (`LATE_PEER`), continued by a second 2-process job from the first one's
    checkpoint, against the same run on one device. Orbax's first sync after compiling is a Gloo collective, whose
    setup gives up after 30 s: the Trainer's barrier after compiling lets the late peer join (without it the job
    fails: "Gloo context initialization failed", then hangs until the shutdown barrier times out)."""
    multi, single = tmp_path / "multi", tmp_path / "single"
    run = [*MULTI, *FLOAT64, f"workdir={multi}"]
    # the same run, uninterrupted, on one device: the same logical data shards, one mesh axis. It runs beside the
    # 2-process job, in the 40 s the late peer leaves both cores idle.
    reference = metatrain("train", *MULTI, *FLOAT64, "mesh.fsdp=1", f"workdir={single}", "steps=4",
                          "checkpoint_every=2", extra_env=FLOAT64_ENV, background=True)
    try:
        with two_processes(["-c", LATE_PEER, "train", *run, "steps=2"], FLOAT64_ENV) as procs:
            errs = [p.communicate(timeout=300)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], errs[0][-3000:] + errs[1][-3000:]
        reference_err = reference.communicate(timeout=300)[1]
    finally:
        if reference.poll() is None:
            reference.kill()
    assert reference.returncode == 0, reference_err[-3000:]
    # a new 2-process job continues from the checkpoint the first one wrote
    monkeypatch.setenv("JAX_ENABLE_X64", "1")
    assert local.launch(["train", *run, "steps=4", "--resume"], processes=2, devices=2) == 0
    assert_same_first_meta_gradient(single, multi)
    for step in (2, 4):
        a, b = saved_float64_state(single, step), saved_float64_state(multi, step)
        for key in ("meta", "inner", "base"):
            assert_same_float64(a[key], b[key], f"step {step}, {key}")


def test_a_dead_process_stops_the_others(tmp_path):
    """Process 1 is SIGKILLed mid-run; process 0 must exit with an error, not hang. Which program the job runs does
    not matter here: the cheapest to compile (learned per-parameter rates, no baseline; the compilation cache is off
    in multi-process CPU jobs, so both processes compile it)."""
    workdir = tmp_path / "run"
    metrics, deadline = workdir / "metrics.jsonl", time.time() + 300
    cheap = ["task=learned_lr", "baseline=none"]
    with two_processes(["-m", "metatrain.cli", "train", *MULTI, *cheap, "mesh.fsdp=1", f"workdir={workdir}",
                        "steps=100000", "checkpoint_every=0", "--heartbeat-timeout", "10"]) as procs:
        while not (metrics.exists() and metrics.stat().st_size > 0):  # training has started
            assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-3000:]
            assert time.time() < deadline, "no step within 300 s"
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.time()
        procs[0].wait(timeout=120)  # heartbeat timeout 10 s, plus slack for a loaded machine
        waited = time.time() - killed_at
        err = procs[0].stderr.read()
        assert procs[0].returncode != 0
        assert "another task died" in err or "unhealthy" in err, err[-3000:]
        assert waited < 120


def test_a_signal_to_one_process_stops_every_process_after_the_same_step(tmp_path):
    """SIGTERM to one process of a job (a scheduler evicting one worker): it stopped alone after its step, its
    checkpoint save a collective the others never joined: process 0 hung, process 1 died of "checkpoint ? could not
    be written ... Gloo AllGather failed" (and was told to make room on the disk), nothing saved. JAX's preemption
    service now agrees on the step: both save it and stop, 143. Ctrl-C to one process goes the same way (130 there)."""
    workdir = tmp_path / "run"
    metrics, deadline = workdir / "metrics.jsonl", time.time() + 300
    cheap = ["task=learned_lr", "baseline=none"]  # the cheapest program to compile (see the test below)
    with two_processes(["-m", "metatrain.cli", "train", *MULTI, *cheap, "mesh.fsdp=1", f"workdir={workdir}",
                        "steps=100000", "checkpoint_every=0"]) as procs:
        while not (metrics.exists() and metrics.stat().st_size > 0):  # training has started
            assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-3000:]
            assert time.time() < deadline, "no step within 300 s"
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=120)[1] for p in procs]
    stops = [[line for line in err.splitlines() if "stopped by SIGTERM" in line] for err in errs]
    assert [p.returncode for p in procs] == [143, 143], errs[0][-3000:] + errs[1][-3000:]
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
    step = int(stops[0][0].split(" at step ")[1].split(";")[0])
    assert stops[0][0] == (f"metatrain train: stopped by SIGTERM at step {step}; checkpoint {step} saved, run again "
                           "with --resume to continue")
    assert sorted(os.listdir(workdir / "checkpoints")) == [str(step)]


SIGNAL_AFTER_JOINING = """
import os, signal, sys, time
from metatrain import distributed

caught = []
signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
distributed.initialize(preemption_notices=sys.argv[1] == "notices")
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("SIGTERM " + ("caught" if caught else "not caught"), "agreed stops" * distributed.agrees_on_stops(),
      file=sys.stderr)
"""


@pytest.mark.parametrize("notices, said", [("none", "caught "), ("notices", "not caught agreed stops")])
def test_joining_a_job_keeps_sigterm_with_the_program_unless_it_asks_for_preemption_notices(notices, said):
    """Joining a job gives SIGTERM to JAX's preemption notifier, which only records it: a two-process `filter` ran on
    to its end after SIGTERM. `filter` takes it back; the Trainer leaves it there and asks the notifier when to stop
    (`agrees_on_stops`), which it must not do where the notifier never hears SIGTERM."""
    with two_processes(["-c", SIGNAL_AFTER_JOINING, notices]) as procs:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert all(f"SIGTERM {said}" in err.splitlines() for err in errs), errs


@pytest.mark.parametrize("flags,says", [
    (["--processes", "0"], "argument --processes: must be >= 1, got 0"),
    (["--devices", "two"], "argument --devices: 'two' is not a whole number"),
    (["--port", "99999"], "argument --port: must be a TCP port, 1 to 65535 (0: a free one), got 99999"),
    (["--port", "-1"], "argument --port: must be a TCP port"),
    (["--grace", "-1"], "argument --grace: must be a number of seconds >= 0, got -1"),
    (["--grace", "nan"], "argument --grace: must be a number of seconds >= 0, got nan"),
])
def test_launch_flags_out_of_range_are_one_line(flags, says, capsys):
    """A port past 65535 was taken (and the job ran on another port than the one asked for); a negative grace too."""
    with pytest.raises(SystemExit) as e:
        local.main([*flags, "--", "train"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert e.value.code == 2 and last.startswith(f"python -m metatrain.launch.local: error: {says}"), err


@pytest.mark.parametrize("command, says", [
    (["train", "nosuchkey=1"], "nosuchkey: no such setting"),
    (["train", "task=nosuchmodule:Task"], "task: task 'nosuchmodule:Task': cannot import module 'nosuchmodule'"),
    # the job's devices: 3 processes x 2
    (["train", "mesh.fsdp=4"], "mesh: data=-1 x fsdp=4 does not divide the 6 devices"),
    (["train", "data.batch=16"], "data.batch: 16 does not divide over the 6 data x fsdp devices; use a multiple of 6"),
    (["train", "population.size=4", "population.axis=true"], "population.axis: the 6 devices do not split into 4")])
def test_a_bad_command_is_one_line_before_any_process_starts(command, says, capsys, monkeypatch):
    """Each process said the same error, then the launcher that one of them failed (three lines or more for one
    mistake, after every process had started and joined the job)."""
    monkeypatch.setattr(local.subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(SystemExit) as e:
        local.main(["--processes", "3", "--devices", "2", "--", *command])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2, err
    assert err[-1].startswith(f"python -m metatrain.launch.local: error: the metatrain command after --: {says}"), err


@pytest.mark.parametrize("sig, to", [(signal.SIGTERM, "launcher"), (signal.SIGHUP, "launcher"),
                                     (signal.SIGTERM, "process 1")])
def test_a_signal_to_the_launcher_stops_every_process_as_it_stops_one(tmp_path, sig, to):
    """SIGTERM (a scheduler, `timeout`, `docker stop`) or SIGHUP (its terminal closed) killed the launcher alone: its
    processes ran on, orphans, a run writing checkpoints nobody waited for. It is passed on to each (they stop as a
    command stops alone) and the launcher exits 128 + the signal once they have. A signal to one process alone (it
    exits 128 + the signal) goes the same way: it was taken for a failure ("exited with code 143") and the others
    were sent SIGTERM, then SIGKILL after --grace seconds, which could cut a run's save. The command here reads a
    large corpus; the signal is sent once both processes have it open (inside the command, their own handlers
    set)."""
    corpus = tmp_path / "corpus.jsonl"
    line = "".join(json.dumps({"text": f"document {i} " + "words " * 40}) + "\n" for i in range(10_000))
    corpus.write_text(line * 30)
    launcher = subprocess.Popen([sys.executable, "-m", "metatrain.launch.local", "--processes", "2", "--devices", "1",
                                 "--", "data", "stats", "--source", f"jsonl:{corpus}"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=env(1))

    def reading() -> list[int]:  # the processes with the corpus open
        pids = subprocess.run(["pgrep", "-f", str(corpus)], capture_output=True, text=True).stdout.split()
        return [pid for pid in map(int, pids) if pid != launcher.pid and _has_open(pid, str(corpus))]

    try:
        deadline = time.time() + 120
        while len(reading()) < 2:
            assert launcher.poll() is None, launcher.stderr.read()[-3000:]
            assert time.time() < deadline, "the two processes never opened the corpus"
            time.sleep(0.05)
        if to == "launcher":
            launcher.send_signal(sig)
        else:
            os.kill(next(pid for pid in reading() if b"METATRAIN_PROCESS_ID=1\0" in
                         Path(f"/proc/{pid}/environ").read_bytes()), sig)
        err = launcher.communicate(timeout=60)[1]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + sig, err[-3000:]
    said = (f"{sig.name}: passing it on to the processes" if to == "launcher" else
            f"process 1 was stopped by {sig.name}: passing it on to the other processes")
    assert f"launch.local: {said}" in err, err[-3000:]
    assert f"[process 1] metatrain data stats: stopped by {sig.name}" in err, err[-3000:]
    assert f"\nmetatrain data stats: stopped by {sig.name}" in err, err[-3000:]
    assert "exited with code" not in err, err[-3000:]
    left = subprocess.run(["pgrep", "-f", str(corpus)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left running: {left}"


def _has_open(pid: int, path: str) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:  # gone, or a descriptor closed meanwhile
        return False
