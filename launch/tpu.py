"""Run metatrain on a Cloud TPU VM slice: create it (optionally, directly or as a queued resource), ship the
code, install it with the `tpu` extra on every worker, run the same `metatrain` command on all workers (JAX
joins them), stream their logs, and when the slice is preempted recreate it and continue with `--resume`.

    python -m metatrain.launch.tpu --name mt --zone us-east5-a --accelerator-type v5p-16 --create --spot \\
        --workdir gs://BUCKET/runs/mt -- train task=mytasks:MyTask steps=2000

What is shipped is the working tree of the metatrain checkout (committed or not, without what git ignores; the
checkout this launcher is in, or `--code`: an installed package is refused, since each worker installs what it
gets from its pyproject.toml), plus your own task module: a `task=module:Class` whose module is a file or
package in the current directory is found and shipped, and `--include PATH` adds more. Both go on the workers'
PYTHONPATH, and the launcher prints what it ships. The metatrain command is checked here first (its flags, its
config's keys, types and values, and for a known --accelerator-type that its mesh and batch split over the
slice's chips), before anything is created or shipped. `--queued` creates the slice through
`gcloud compute tpus queued-resources` (the way Google recommends for large and Spot slices) and waits until it
is ACTIVE. `--dry-run` prints every command instead of running it. The work dir is a gs:// path (or an absolute
path on a file system every worker mounts; a relative one is refused), and data.data_dir may be one: checkpoints
survive the VM, which is what makes `--resume` after a preemption work. Ctrl-C, SIGTERM or SIGHUP to the launcher
while the run runs stops the run on every worker at one step, which each saves (a second one kills it); see
`Runner`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from metatrain import stops, streams
from metatrain.argtypes import nonnegative_int, refuse_empty
from metatrain.launch.command import check_command

REPO = Path(__file__).resolve().parent.parent
ARCHIVE = "metatrain-src.tar.gz"
PID_FILE = "run.pid"  # in --remote-dir on each worker: the running metatrain's pid
SKIP = {".git", ".venv", "venv", "runs", "__pycache__", ".pytest_cache", "build", "dist"}


def _gcloud_tpu(args, group: list[str], verb: str, *rest: str) -> list[str]:
    cmd = ["gcloud", "compute", "tpus", *group, verb, *rest, f"--zone={args.zone}"]
    return cmd + ([f"--project={args.project}"] if args.project else [])


def _vm(args, verb: str, *rest: str) -> list[str]:
    return _gcloud_tpu(args, ["tpu-vm"], verb, *rest)


def _queued(args, verb: str, *rest: str) -> list[str]:
    return _gcloud_tpu(args, ["queued-resources"], verb, *rest)


def create(args) -> list[str]:
    spot = (["--spot"] if args.spot else []) + (["--preemptible"] if args.preemptible and not args.queued else [])
    accelerator = f"--accelerator-type={args.accelerator_type}"
    if args.queued:
        return _queued(args, "create", args.name, f"--node-id={args.name}", accelerator,
                       f"--runtime-version={args.runtime_version}", *spot)
    return _vm(args, "create", args.name, accelerator, f"--version={args.runtime_version}", *spot)


def queued_state(args) -> list[str]:
    return _queued(args, "describe", args.name, "--format=value(state.state)")


def delete(args) -> list[str]:
    return _queued(args, "delete", args.name, "--force", "--quiet") if args.queued else _vm(args, "delete", args.name,
                                                                                             "--quiet")


def state(args) -> list[str]:
    return _vm(args, "describe", args.name, "--format=value(state)")


# ---- what is shipped ------------------------------------------------------------------------------
def working_tree(code: Path) -> tuple[list[str], list[str]]:
    """(files of the checkout's working tree as they are now, those of them not committed). In a git checkout:
    tracked and untracked files that git does not ignore; elsewhere every file but venvs, runs and caches."""
    def git(*a):
        return subprocess.run(["git", "-C", str(code), *a], capture_output=True, text=True, check=True).stdout

    try:
        files = [f for f in git("ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0") if f]
        changed = set(git("ls-files", "--others", "--exclude-standard", "-z").split("\0"))
        try:
            changed |= set(git("diff", "--name-only", "-z", "HEAD").split("\0"))  # staged or not
        except subprocess.CalledProcessError:  # no commit yet: nothing is committed
            changed = set(files)
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        files, changed = [], set()
        for d, dirs, names in os.walk(code):
            dirs[:] = [x for x in dirs if x not in SKIP]
            files += [os.path.relpath(os.path.join(d, f), code) for f in names]
    files = sorted(f for f in files if (code / f).is_file())
    return files, sorted(f for f in files if f in changed)


def task_module_paths(command: list[str], cwd: Path) -> list[Path]:
    """The file or package of a `task=module:Class` argument, when it is in `cwd` (the user's own task)."""
    found = []
    for arg in command:
        if arg.startswith("task=") and ":" in arg:
            top = arg[len("task="):].split(":")[0].split(".")[0]
            for candidate in (cwd / f"{top}.py", cwd / top):
                if candidate.exists():
                    found.append(candidate)
                    break
    return found


def shipment(args) -> tuple[list[tuple[Path, str]], list[str]]:
    """[(local path, path in the archive)] and the lines that say what is shipped."""
    files, uncommitted = working_tree(args.code)
    items = [(args.code / f, f"code/{f}") for f in files]
    extras = [Path(p).resolve() for p in args.include] + task_module_paths(args.command, Path.cwd())
    for extra in dict.fromkeys(extras):
        paths = [extra] if extra.is_file() else sorted(p for p in extra.rglob("*") if p.is_file()
                                                      and not SKIP & set(p.relative_to(extra.parent).parts))
        items += [(p, f"user/{p.relative_to(extra.parent)}") for p in paths]
    lines = [f"shipping {len(files)} files of the working tree of {args.code}"
             + (f", {len(uncommitted)} of them not committed: {', '.join(uncommitted)}" if uncommitted else "")]
    user = sorted({name.split("/")[1] for _, name in items if name.startswith("user/")})
    if user:
        lines.append(f"shipping on the workers' PYTHONPATH: {', '.join(user)}")
    return items, lines


def pack(items: list[tuple[Path, str]], out: Path) -> Path:
    with tarfile.open(out, "w:gz") as tar:
        for path, name in items:
            tar.add(path, arcname=name)
    return out


def copy(args, archive: str) -> list[str]:
    return _vm(args, "scp", archive, f"{args.name}:~/{ARCHIVE}", "--worker=all")


def ssh_all(args, remote: str) -> list[str]:
    return _vm(args, "ssh", args.name, "--worker=all", f"--command={remote}")


def install(args) -> list[str]:
    d = args.remote_dir
    return ssh_all(args, f"rm -rf {d} && mkdir -p {d} && tar -xzf ~/{ARCHIVE} -C {d} && cd {d}/code && "
                         f"python3 -m venv .venv && . .venv/bin/activate && pip install -q --upgrade pip && "
                         f"pip install -q -e '.[tpu]'")


def run(args, resume: bool) -> list[str]:
    d = args.remote_dir
    metatrain = ["metatrain", *args.command, f"workdir={args.workdir}"] + (["--resume"] if resume else [])
    # the shell's pid is the run's (exec), written where `signal_run` finds it
    return ssh_all(args, f"cd {d}/code && . .venv/bin/activate && echo $$ > {d}/{PID_FILE} && "
                         f"export PYTHONPATH={d}/user:{d}/code METATRAIN_DISTRIBUTED=auto && exec "
                         + shlex.join(metatrain))


def signal_run(args, signum: int) -> list[str]:
    """The command that sends `signum` to the run on every worker (the pid `run` wrote, if that process is still
    a metatrain one)."""
    f = f"{args.remote_dir}/{PID_FILE}"
    return ssh_all(args, f"pid=$(cat {f} 2>/dev/null) && grep -qa metatrain /proc/$pid/cmdline 2>/dev/null && "
                         f"kill -{signal.Signals(signum).name.removeprefix('SIG')} $pid; true")


class Stopped(Exception):
    """The launcher got a stop signal (Ctrl-C, SIGTERM, SIGHUP) while a gcloud command ran, or between two."""

    def __init__(self, signum: int, during: list[str] | None, the_run: bool = False):
        super().__init__()
        self.signum, self.during, self.the_run = signum, during, the_run


class Runner:
    """Runs the launcher's gcloud commands, each printed first (`--dry-run`: only printed).

    A stop signal to the launcher (Ctrl-C, SIGTERM, SIGHUP) stops the command that runs (`Stopped` is raised). The
    run's own command is different: it runs in a process group of its own, so that a terminal's Ctrl-C leaves its
    ssh connections up, and the first signal is passed on to the run on every worker (`signal_run`: SIGTERM, which
    each saves its checkpoint for and stops at the same step), whose lines keep streaming until it ends; a second
    one kills it there and here."""

    def __init__(self, args):
        self.args, self.dry_run, self.stops = args, args.dry_run, []

    def on_signal(self, signum, _frame):
        self.stops.append(signum)

    def __call__(self, cmd: list[str], capture: bool = False, the_run: bool = False,
                 echo: bool = True) -> tuple[int, str]:
        if echo:
            print("+ " + shlex.join(cmd), flush=True)
        if self.dry_run:
            return 0, ""
        if self.stops:
            raise Stopped(self.stops[0], None)
        # the run reads nothing: in a group of its own it may not read the terminal (it would be stopped)
        p = subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE if capture else None,
                             stdin=subprocess.DEVNULL if the_run else None, process_group=0 if the_run else None)
        acted = 0
        try:
            while p.poll() is None:
                if len(self.stops) > acted:
                    acted = len(self.stops)
                    if not the_run:
                        p.terminate()  # a terminal's Ctrl-C reached it too; a SIGTERM to the launcher alone did not
                        p.wait()
                        raise Stopped(self.stops[0], cmd)
                    self._stop_run(p, again=acted > 1)
                time.sleep(0.2)
        finally:
            if p.poll() is None:  # an error here: nothing runs on without the launcher
                p.kill()
        out = p.stdout.read() if capture else ""
        if the_run and self.stops:
            raise Stopped(self.stops[0], cmd, the_run=True)
        return p.returncode, (out or "").strip()

    def sleep(self, seconds: float) -> None:
        """`time.sleep`, cut short by a stop signal (`Stopped`)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stops:
                raise Stopped(self.stops[0], None)
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))

    def _stop_run(self, p: subprocess.Popen, again: bool) -> None:
        name = signal.Signals(self.stops[-1]).name
        if not again:
            print(f"launch.tpu: {name}: passing SIGTERM on to the run on every worker (each saves its checkpoint at "
                  f"the step it is at and stops); again to kill it", file=sys.stderr, flush=True)
            self._signal_run(signal.SIGTERM)
            return
        print(f"launch.tpu: {name} again: killing the run on every worker", file=sys.stderr, flush=True)
        self._signal_run(signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)

    def _signal_run(self, signum: int) -> None:
        cmd = signal_run(self.args, signum)
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if res.returncode:  # the run goes on there: say how to stop it
            said = " ".join((res.stderr or res.stdout).split())[-300:]
            print(f"launch.tpu: `{shlex.join(cmd)}` failed with code {res.returncode} ({said}); run it again to "
                  f"stop the run", file=sys.stderr, flush=True)


def bring_up(args, sh: Runner) -> int:
    """Create the slice (as a queued resource: and wait until it is ACTIVE)."""
    code, _ = sh(create(args))
    if code or not args.queued:
        return code
    if sh.dry_run:
        print(f"# then every 30 s until it prints ACTIVE: {shlex.join(queued_state(args))}")
        return 0
    # a queue can take hours (Spot): the state is asked every 30 s and said when it changes, not the command each time
    asked, said, start = queued_state(args), None, time.monotonic()
    print(f"+ {shlex.join(asked)}   # every 30 s until it prints ACTIVE", flush=True)
    while True:
        code, status = sh(asked, capture=True, echo=False)
        if code or status in ("FAILED", "SUSPENDED"):
            print(f"launch.tpu: the queued resource {args.name} is {status or 'unknown'}", file=sys.stderr)
            return code or 1
        if status != said:
            s = time.monotonic() - start
            waited = "" if said is None else f" (after {s:.0f} s)" if s < 120 else f" (after {s / 60:.0f} min)"
            print(f"launch.tpu: the queued resource {args.name} is {status}{waited}", file=sys.stderr, flush=True)
            said = status
        if status == "ACTIVE":
            return 0
        sh.sleep(30)


def launch(args) -> int:
    """Bring up, ship, install and run (see the module's docstring); returns the exit code: the run's, or 128 + the
    signal that stopped the launcher."""
    sh = Runner(args)
    try:
        with stops.caught(sh.on_signal):
            return _launch(args, sh)
    except Stopped as e:
        name = signal.Signals(e.signum).name
        if e.the_run:
            print(f"launch.tpu: stopped by {name}; the same command with --resume continues the run from its last "
                  f"checkpoint in {args.workdir}", file=sys.stderr)
        else:
            what = f" while `{shlex.join(e.during[:5])} ...` ran" if e.during else ""
            print(f"launch.tpu: stopped by {name}{what}", file=sys.stderr)
        return 128 + e.signum


def _launch(args, sh: Runner) -> int:
    items, lines = shipment(args)
    for line in lines:
        print(line, flush=True)
    if args.create:
        code = bring_up(args, sh)
        if code:
            return code
    with tempfile.TemporaryDirectory() as tmp:
        archive = str(pack(items, Path(tmp) / ARCHIVE)) if not args.dry_run else os.path.join(tmp, ARCHIVE)
        for cmd in (copy(args, archive), install(args)):
            code, _ = sh(cmd)
            if code:
                print(f"launch.tpu: `{shlex.join(cmd[:5])} ...` failed with code {code}", file=sys.stderr)
                return code
        code, _ = sh(run(args, resume=args.resume), the_run=True)
        if args.dry_run:
            print(f"# if the run fails and `{shlex.join(state(args))}` prints PREEMPTED or TERMINATED (up to "
                  f"--max-restarts {args.max_restarts} times):")
            for cmd in ([delete(args), create(args)] if args.create else []) + [copy(args, archive), install(args),
                                                                                  run(args, resume=True)]:
                print("#   " + shlex.join(cmd))
            return 0
        restarts = 0
        while code and restarts < args.max_restarts:
            _, vm_state = sh(state(args), capture=True)
            if vm_state not in ("PREEMPTED", "TERMINATED"):
                print(f"launch.tpu: the run failed with code {code} and the TPU VM is {vm_state or 'unknown'}: "
                      f"not a preemption, not restarting", file=sys.stderr)
                return code
            restarts += 1
            print(f"launch.tpu: the TPU VM was {vm_state}; restart {restarts} of {args.max_restarts} with --resume",
                  file=sys.stderr)
            if not args.create:
                print("launch.tpu: pass --create to let the launcher recreate a preempted VM", file=sys.stderr)
                return code
            sh(delete(args))
            if bring_up(args, sh):
                return code
            for cmd in (copy(args, archive), install(args)):
                sh(cmd)
            code, _ = sh(run(args, resume=True), the_run=True)
    return code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m metatrain.launch.tpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, help="TPU VM name (and queued-resource name with --queued)")
    p.add_argument("--zone", required=True)
    p.add_argument("--project", default=None)
    p.add_argument("--accelerator-type", default="v5p-8", help="e.g. v5p-8, v5p-32, v4-16")
    p.add_argument("--runtime-version", default="v2-alpha-tpuv5", help="TPU VM software version")
    p.add_argument("--create", action="store_true", help="create the VM first (and recreate it after preemption)")
    p.add_argument("--queued", action="store_true",
                   help="create it as a queued resource (gcloud compute tpus queued-resources) and wait for ACTIVE")
    spot = p.add_mutually_exclusive_group()
    spot.add_argument("--spot", action="store_true", help="a Spot VM (cheaper, preemptible)")
    spot.add_argument("--preemptible", action="store_true", help="a preemptible VM (not with --queued: use --spot)")
    p.add_argument("--code", type=Path, default=REPO,
                   help="the metatrain checkout whose working tree is shipped (default: the one this launcher is in)")
    p.add_argument("--include", action="append", default=[], metavar="PATH",
                   help="a file or folder to ship onto the workers' PYTHONPATH (repeatable), e.g. your task module")
    p.add_argument("--remote-dir", default="~/metatrain")
    p.add_argument("--workdir", required=True, help="the run's work dir, e.g. gs://BUCKET/runs/NAME")
    p.add_argument("--resume", action="store_true", help="the first run already resumes")
    p.add_argument("--max-restarts", type=nonnegative_int, default=3, help="re-runs with --resume after preemptions")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the metatrain command, e.g. train maml")
    refuse_empty(p)  # `--zone "$ZONE"` with ZONE unset: one line here, not gcloud's error after the upload
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command or args.command[0] not in ("train", "pretrain"):
        parser.error("give the metatrain command after --: train ... or pretrain ...")
    if args.queued and args.preemptible:
        parser.error("--queued takes --spot, not --preemptible")
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", args.name):  # Cloud TPU's rule for a VM's name
        parser.error(f"--name {args.name!r}: a TPU VM's name is a lowercase letter, then up to 62 lowercase letters, "
                     f"digits or hyphens, not ending with a hyphen")
    args.code = args.code.resolve()
    if not (args.code / "pyproject.toml").is_file():
        parser.error(f"--code {args.code}: not a metatrain checkout (no pyproject.toml), and each worker installs "
                     f"what is shipped from its pyproject.toml; clone the repository and give --code CHECKOUT, or "
                     f"run the launcher from a checkout's environment")
    for extra in args.include:
        if not Path(extra).exists():
            parser.error(f"--include {extra}: no such file or folder")
    from metatrain import aot

    found = aot.accelerator_chips(args.accelerator_type)  # a known type: its chips, one device each
    if found:  # v5p-7: 3 chips and a half
        name, count = args.accelerator_type.rsplit("-", 1)
        per_core = found[0] in aot.PER_CORE_TYPES
        if found[1] == 0 or per_core and int(count) % 2:
            how = f"{name} types count TensorCores, two per chip ({name}-8: 4 chips)" if per_core else "give its chips"
            parser.error(f"--accelerator-type {args.accelerator_type}: no such slice; {how}, e.g. {name}-8")
    problem = check_command(args.command, args.workdir, args.include, devices=found[1] if found and found[2] else None)
    if problem:
        parser.error(f"the metatrain command after --: {problem}")
    if "://" not in args.workdir:
        if not os.path.isabs(args.workdir):
            parser.error(f"--workdir {args.workdir}: a relative path is inside {args.remote_dir}/code on each worker, "
                         f"which the launcher replaces at every start, so a restart finds no checkpoint; give "
                         f"gs://BUCKET/runs/NAME, or an absolute path on a file system every worker mounts")
        print(f"launch.tpu: --workdir {args.workdir} is not a gs:// path: every worker must see the same folder (a "
              f"file system they all mount) and it must outlive a preempted VM for --resume", file=sys.stderr)
    with streams.kept(["launch.tpu"]):  # its output may lose its reader (a terminal closed): the job goes on
        return launch(args)


if __name__ == "__main__":
    sys.exit(main())
