"""Run a metatrain command as N processes on 127.0.0.1 with M simulated CPU devices each: the
multi-host code path (jax.distributed, per-process data shards, Orbax from every process) on one machine.

    python -m metatrain.launch.local --processes 2 --devices 4 -- train data.shards=2 workdir=runs/mh

Process 0's output passes through; the others' lines are prefixed `[process i]`. When a process
fails, the launcher stops the rest (SIGTERM, then SIGKILL after --grace seconds) and exits with the
failed process's code, so a crash never leaves the job hanging. SIGTERM, Ctrl-C or SIGHUP (a terminal
closed) to the launcher, or to one process (which then exits 128 + the signal), is passed on to every
process (a run saves its checkpoint and stops), then the launcher exits 128 + the signal; a second one
kills them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from metatrain import stops, streams
from metatrain.argtypes import number, positive_int
from metatrain.entry import hugepage_env
from metatrain.launch.command import check_command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relay(stream, prefix: str, out):
    """A process's lines to `out`, prefixed, until it closes them (a write that fails still drains them: a full pipe
    would block the process)."""
    for line in iter(stream.readline, b""):
        with contextlib.suppress(OSError, ValueError):
            out.write(prefix + line.decode(errors="replace"))
            out.flush()


def _stopped_by(code: int | None) -> int | None:
    """The stop signal a process's exit code says it was stopped by (it exits 128 + the signal), else None."""
    return code - 128 if code is not None and code - 128 in stops.ALL else None


def launch(command: list[str], processes: int, devices: int, port: int = 0, grace: float = 10.0) -> int:
    """Start the processes, wait for all; on the first failure stop the others. SIGTERM or Ctrl-C (SIGINT) is passed
    on to every process, whose command stops as it does alone (a run saves its checkpoint); the launcher waits for
    them and exits 128 + the signal. A second signal kills them. Returns the exit code."""
    port = port or free_port()
    procs, stop = [], []

    def on_signal(signum, _frame, by: str = ""):
        again = bool(stop)
        stop.append(signum)
        running = [p for p in procs if p.poll() is None]
        if running:
            name = signal.Signals(signum).name
            to = "the other processes" if by else "the processes"
            print(f"launch.local: {by or name}{' again: killing' if again else ': passing it on to'} {to}",
                  file=sys.stderr)
        for p in running:
            if again:
                p.kill()
            else:
                p.send_signal(signum)

    with stops.caught(on_signal):
        for i in range(processes):
            if stop:
                break
            env = dict(os.environ, JAX_PLATFORMS="cpu",
                       XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}",
                       METATRAIN_COORDINATOR=f"127.0.0.1:{port}", METATRAIN_NUM_PROCESSES=str(processes),
                       METATRAIN_PROCESS_ID=str(i))
            env = hugepage_env(env) or env  # as the `metatrain` program has it
            pipe = None if i == 0 else subprocess.PIPE
            # in a process group of their own: a terminal's Ctrl-C reaches the launcher alone, which passes it on
            # once (else each process had it twice)
            p = subprocess.Popen([sys.executable, "-m", "metatrain.cli", *command], env=env, stdout=pipe,
                                 stderr=None if i == 0 else subprocess.STDOUT, process_group=0)
            if i:
                threading.Thread(target=_relay, args=(p.stdout, f"[process {i}] ", sys.stderr), daemon=True).start()
            procs.append(p)
            if stop:  # a signal between its start and here
                p.send_signal(stop[0])
        failed = None
        while any(p.poll() is None for p in procs):
            if not stop:
                failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
                if failed is not None:
                    signum = _stopped_by(procs[failed].returncode)
                    if signum is None:
                        break
                    # a signal to that process alone (a scheduler's, a user's `kill`): the job stops as if the
                    # launcher had it (a failure's SIGTERM and SIGKILL could cut the others' saves)
                    on_signal(signum, None, by=f"process {failed} was stopped by {signal.Signals(signum).name}")
                    failed = None
            time.sleep(0.2)
        if stop:
            return 128 + stop[0]
        if failed is None:
            failed = next((i for i, p in enumerate(procs) if p.returncode), None)
            if failed is None:
                return 0
            signum = _stopped_by(procs[failed].returncode)
            if signum is not None:  # stopped by a signal to it alone, as the others were (or they had finished)
                print(f"launch.local: process {failed} was stopped by {signal.Signals(signum).name}", file=sys.stderr)
                return 128 + signum
        code = procs[failed].returncode
        print(f"launch.local: process {failed} exited with code {code}; stopping the other processes",
              file=sys.stderr)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + grace
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return code if code > 0 else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m metatrain.launch.local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=positive_int, default=2)
    parser.add_argument("--devices", type=positive_int, default=4,
                        help="simulated CPU devices per process")
    parser.add_argument("--port", type=number(int, 0, 65535, "a TCP port, 1 to 65535 (0: a free one)"), default=0,
                        help="coordinator port (default: a free one)")
    parser.add_argument("--grace", type=number(float, 0, float("inf"), "a number of seconds >= 0"), default=10.0,
                        help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then a metatrain command, e.g. train ...")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the metatrain command after --, e.g. -- train steps=10")
    problem = check_command(command, devices=args.processes * args.devices)  # said once here, not by each process
    if problem:
        parser.error(f"the metatrain command after --: {problem}")
    with streams.kept(["launch.local"]):  # its output may lose its reader (a terminal closed): the job goes on
        return launch(command, args.processes, args.devices, args.port, args.grace)


if __name__ == "__main__":
    sys.exit(main())
