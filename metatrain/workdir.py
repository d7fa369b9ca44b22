"""A run's work dir: where its files go, one run at a time, and whether a run may continue in it.

Layout: `config.yaml` (the resolved config), `checkpoints/<step>/` (Orbax), `metrics.jsonl`,
`tensorboard/`, `curves.png`, `mode_auto.json`, `wandb_id`. A remote work dir (`gs://...`) keeps
config.yaml, checkpoints and the W&B id in the bucket; metrics, TensorBoard events and the plot are
written on process 0's host under `runs/<name>` and copied into the bucket at every checkpoint and at
the end, so a preempted VM loses at most what came after the last checkpoint.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from metatrain import config as config_lib
from metatrain.config import Config
from metatrain.errors import ConfigError, DataError, TrainingError
from metatrain.paths import is_remote

# Fields a resumed run may change: how long and how it runs, not what it computes or what its state holds.
RESUMABLE = ("steps", "workdir", "log_every", "checkpoint_every", "keep_checkpoints", "max_bad_steps",
             "eval_batches", "eval_every", "inner_lr",
             "inner.init_from", "data.data_dir", "meta_opt.lr", "meta_opt.clip_norm", "meta_opt.eps",
             "meta_opt.weight_decay", "meta_opt.offload_moments", "meta_opt.offload_params")
RESUMABLE_GROUPS = ("mesh.", "log.", "metagrad.")


def config_path(workdir: str) -> str:
    return os.path.join(workdir, "config.yaml")


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(workdir, "checkpoints") if is_remote(workdir) else os.path.abspath(
        os.path.join(workdir, "checkpoints"))


def log_dir(workdir: str) -> str:
    """Where metrics.jsonl, TensorBoard events and curves.png are written: the work dir, or for a remote work
    dir a local `runs/<name>` on process 0's host (appending to object storage is not possible)."""
    return os.path.join("runs", workdir.rstrip("/").rsplit("/", 1)[-1]) if is_remote(workdir) else workdir


def require_dir(workdir: str) -> None:
    """A one-line DataError where `workdir`, given as a run's work dir, is a file or not there (a remote one is not
    looked at)."""
    if not os.path.isdir(workdir) and not is_remote(workdir):
        what = "a file, not a directory" if os.path.exists(workdir) else "no such directory"
        raise DataError(f"{workdir}: {what}; give a metatrain work dir (a run's `workdir=`)")


def checkpoint_steps(workdir: str) -> list[int]:
    """Steps of the finished checkpoints, oldest first (unfinished saves are `N.orbax-checkpoint-tmp...`)."""
    from etils import epath

    ckpt = epath.Path(checkpoint_dir(workdir))
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.is_dir() else []


def latest_step(workdir: str) -> int | None:
    return max(checkpoint_steps(workdir), default=None)


def has_checkpoint(workdir: str) -> bool:
    return latest_step(workdir) is not None


def is_run(workdir: str) -> bool:
    return config_lib.read_text(config_path(workdir)) is not None or has_checkpoint(workdir)


class Lock:
    """An exclusive lock on a work dir (an OS file lock: released when the process ends, however it ends)."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.path = os.path.join(log_dir(workdir), ".lock")
        self._file = None
        self._made = []  # the folders acquire made, deepest first: a run that fails before writing removes them

    def acquire(self) -> Lock:
        folder, self._made = os.path.dirname(self.path), []
        while folder and not os.path.isdir(folder):  # `runs/a` of a first run: `runs` too
            self._made.append(folder)
            folder = os.path.dirname(folder)
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        except OSError as e:  # a folder the OS refuses (a read-only or special file system)
            raise TrainingError(f"workdir: {self.workdir} cannot be made ({e.strerror}: {e.filename}); give a folder "
                                f"you can write") from None
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise TrainingError(f"workdir: {self.workdir} is in use by another run ({holder}); wait for it to end or "
                                f"stop it, or give this run another workdir") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        f.flush()
        self._file = f
        return self

    def removed(self) -> bool:
        """Whether the lock file held was deleted since (with its work dir, as `rm -r` does): another run could take
        the work dir now, and what this one writes there goes with the deleted folder."""
        return self._file is not None and os.fstat(self._file.fileno()).st_nlink == 0

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
            folder = os.path.dirname(self.path)
            # nothing but the lock (and the folder still there): leave no empty work dir
            if self._made and os.path.isdir(folder) and os.listdir(folder) == [".lock"]:
                os.remove(self.path)
                for made in self._made:  # and no empty folder above it that this lock made
                    try:
                        os.rmdir(made)
                    except OSError:  # not empty (another run's), or gone
                        break

    def __enter__(self) -> Lock:
        return self.acquire()

    def __exit__(self, *_) -> None:
        self.release()


def first_difference(saved: Config, cfg: Config) -> str | None:
    """The first field, other than those a resumed run may change, where `cfg` differs from the saved run's."""
    a, b = config_lib.flatten(saved), config_lib.flatten(cfg)
    for key, value in a.items():
        if key in RESUMABLE or key.startswith(RESUMABLE_GROUPS):
            continue
        if b.get(key) != value:
            return f"{key}: {value!r} -> {b.get(key)!r}"
    return None


def run_config(preset: str | None, overrides: list[str], resume: bool, default_preset: str) -> tuple[Config, bool]:
    """The config of a `train` / `pretrain` command and whether it continues a run. A work dir that holds a
    checkpoint continues its run: the saved config with these overrides, refused when they change what the
    run computes (or `preset` names another one) or when its `steps` are already done."""
    cfg = config_lib.load(preset or default_preset, overrides)
    latest = latest_step(cfg.workdir)
    if resume and latest is None:
        raise ConfigError(f"--resume: {cfg.workdir} has no checkpoint to resume from")
    saved_path = config_path(cfg.workdir)
    if latest is None or config_lib.read_text(saved_path) is None:
        return cfg, latest is not None
    saved = config_lib.load(saved_path)
    requested = cfg
    cfg = config_lib.load(saved_path, overrides)
    difference = first_difference(saved, requested if preset else cfg)
    if difference:
        raise ConfigError(f"workdir: {cfg.workdir} holds a run of another configuration (first difference: "
                          f"{difference}); use a new workdir, or resume without changing it")
    if cfg.steps <= latest:
        raise ConfigError(f"steps: the run in {cfg.workdir} is already at step {latest} (steps={cfg.steps}); "
                          f"set steps above {latest} to train it further")
    return cfg, True


# ---- the LoRA base a run's adapters were trained on ------------------------------------------------------------------
def base_path(workdir: str) -> str:
    return os.path.join(workdir, "lora_base.json")


def base_identity(frozen, init_from: str) -> dict:
    """Where a LoRA run's frozen base came from and a fingerprint of its weights: the sum of |w| of each leaf, in
    float32 on the devices, to 6 significant digits (`check_base` compares them to 1e-5 relative: another mesh's
    reduction order moves them far less, other weights of the same shapes far more)."""
    import jax
    import jax.numpy as jnp

    sums = jax.jit(lambda t: [jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in jax.tree.leaves(t)])(frozen)
    return {"init_from": init_from or "random (the run's seed)", "abs_sums": [float(f"{float(s):.6g}") for s in sums]}


def check_base(workdir: str, identity: dict, record: bool = True) -> None:
    """Refuse to resume a LoRA run on base weights other than those its adapters were trained on (recorded in the
    work dir when the run first started); with `record`, record them when nothing is recorded yet."""
    saved = config_lib.read_text(base_path(workdir))
    if saved is None:
        if record:
            config_lib.write_text(base_path(workdir), json.dumps(identity, indent=1))
        return
    before = json.loads(saved)
    same = len(before["abs_sums"]) == len(identity["abs_sums"]) and all(
        abs(a - b) <= 1e-5 * max(abs(a), abs(b), 1e-30) for a, b in zip(before["abs_sums"], identity["abs_sums"]))
    if not same:
        raise ConfigError(f"inner.init_from: the run in {workdir} trained its LoRA adapters on the base weights of "
                          f"{before['init_from']}; {identity['init_from']} holds other weights. Resume with that base, "
                          f"or start a new workdir")
