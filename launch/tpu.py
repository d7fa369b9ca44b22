"""Run metatrain on a Cloud TPU VM slice: create it (optionally), ship the code, install it with the
`tpu` extra on every worker, run the same `metatrain` command on all workers (JAX joins them), stream
their logs, and when the slice is preempted recreate it and continue with `--resume`.

    python -m launch.tpu --name mt --zone us-east5-a --accelerator-type v5p-16 --create --spot \\
        --workdir gs://BUCKET/runs/mt -- train maml steps=2000

`--dry-run` prints every command instead of running it. The work dir (and data.data_dir) may be
gs:// paths: checkpoints survive the VM, which is what makes `--resume` after a preemption work.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCHIVE = "metatrain-src.tar.gz"


def _gcloud_tpu(args, verb: str, *rest: str) -> list[str]:
    cmd = ["gcloud", "compute", "tpus", "tpu-vm", verb, *rest, f"--zone={args.zone}"]
    return cmd + ([f"--project={args.project}"] if args.project else [])


def create(args) -> list[str]:
    cmd = _gcloud_tpu(args, "create", args.name, f"--accelerator-type={args.accelerator_type}",
                      f"--version={args.runtime_version}")
    return cmd + (["--spot"] if args.spot else []) + (["--preemptible"] if args.preemptible else [])


def delete(args) -> list[str]:
    return _gcloud_tpu(args, "delete", args.name, "--quiet")


def state(args) -> list[str]:
    return _gcloud_tpu(args, "describe", args.name, "--format=value(state)")


def pack(args) -> list[str]:
    """The committed tree of the code dir (what `git archive` gives: no venvs, runs or caches)."""
    return ["git", "-C", str(args.code), "archive", "--format=tar.gz", f"--output=/tmp/{ARCHIVE}", "HEAD"]


def copy(args) -> list[str]:
    return _gcloud_tpu(args, "scp", f"/tmp/{ARCHIVE}", f"{args.name}:~/{ARCHIVE}", "--worker=all")


def ssh_all(args, remote: str) -> list[str]:
    return _gcloud_tpu(args, "ssh", args.name, "--worker=all", f"--command={remote}")


def install(args) -> list[str]:
    d = args.remote_dir
    return ssh_all(args, f"rm -rf {d} && mkdir -p {d} && tar -xzf ~/{ARCHIVE} -C {d} && cd {d} && "
                         f"python3 -m venv .venv && . .venv/bin/activate && pip install -q --upgrade pip && "
                         f"pip install -q -e '.[tpu]'")


def run(args, resume: bool) -> list[str]:
    metatrain = ["metatrain", *args.command, f"workdir={args.workdir}"] + (["--resume"] if resume else [])
    return ssh_all(args, f"cd {args.remote_dir} && . .venv/bin/activate && METATRAIN_DISTRIBUTED=auto "
                         + shlex.join(metatrain))


class Runner:
    def __init__(self, dry_run: bool):
        self.dry_run = dry_run

    def __call__(self, cmd: list[str], capture: bool = False) -> tuple[int, str]:
        print("+ " + shlex.join(cmd), flush=True)
        if self.dry_run:
            return 0, ""
        res = subprocess.run(cmd, text=True, capture_output=capture)  # without capture the logs stream
        return res.returncode, (res.stdout or "").strip()


def launch(args) -> int:
    sh = Runner(args.dry_run)
    if args.create:
        code, _ = sh(create(args))
        if code:
            return code
    for cmd in (pack(args), copy(args), install(args)):
        code, _ = sh(cmd)
        if code:
            print(f"launch.tpu: `{cmd[0]} ...` failed with code {code}", file=sys.stderr)
            return code
    code, _ = sh(run(args, resume=args.resume))
    if args.dry_run:
        print(f"# if the run fails and `{shlex.join(state(args))}` prints PREEMPTED or TERMINATED (up to "
              f"--max-restarts {args.max_restarts} times):")
        for cmd in ([delete(args), create(args)] if args.create else []) + [copy(args), install(args),
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
        for cmd in (delete(args), create(args), copy(args), install(args)):
            sh(cmd)
        code, _ = sh(run(args, resume=True))
    return code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.tpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, help="TPU VM name")
    p.add_argument("--zone", required=True)
    p.add_argument("--project", default=None)
    p.add_argument("--accelerator-type", default="v5p-8", help="e.g. v5p-8, v5p-32, v4-16")
    p.add_argument("--runtime-version", default="v2-alpha-tpuv5", help="TPU VM software version")
    p.add_argument("--create", action="store_true", help="create the VM first (and recreate it after preemption)")
    spot = p.add_mutually_exclusive_group()
    spot.add_argument("--spot", action="store_true", help="a Spot VM (cheaper, preemptible)")
    spot.add_argument("--preemptible", action="store_true")
    p.add_argument("--code", type=Path, default=REPO, help="the metatrain checkout to ship (its git HEAD)")
    p.add_argument("--remote-dir", default="~/metatrain")
    p.add_argument("--workdir", required=True, help="the run's work dir, e.g. gs://BUCKET/runs/NAME")
    p.add_argument("--resume", action="store_true", help="the first run already resumes")
    p.add_argument("--max-restarts", type=int, default=3, help="re-runs with --resume after preemptions")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the metatrain command, e.g. train maml")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command or args.command[0] not in ("train", "pretrain"):
        parser.error("give the metatrain command after --: train ... or pretrain ...")
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
