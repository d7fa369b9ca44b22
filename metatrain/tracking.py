"""Where a run's metrics go: `metrics.jsonl` and TensorBoard event files in the log dir, optionally Weights &
Biases.

W&B (`log.wandb=true`, `pip install wandb`) resumes the same W&B run after a restart: its run id is kept
in the work dir (`wandb_id`, in the bucket for a gs:// work dir). With a remote work dir the log dir is
local (see `metatrain.workdir`); `sync()` copies metrics.jsonl, the TensorBoard events and the plot into
the work dir, and the Trainer calls it at every checkpoint and at the end.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import secrets
import sys

from metatrain import config as config_lib
from metatrain import paths
from metatrain import workdir as workdir_lib
from metatrain.config import Config
from metatrain.errors import ConfigError

# what tensorboardX imports, where installed, for what a run never asks of it: torch, only to accept its tensors (a
# run logs Python floats; 2.6 s of start-up on a 2-core CPU), and the clients that write event files to gs:// (0.2 s:
# the tpu extra installs it) and s3:// (the log dir is always local, see `metatrain.workdir`)
NOT_IMPORTED = ("torch", "google.cloud.storage", "boto3")


def summary_writer(directory: str):
    """tensorboardX's `SummaryWriter` for `directory`, imported without the modules of `NOT_IMPORTED`: a module that is
    imported already stays as it is, and each imports normally afterwards."""
    blocked = [name for name in NOT_IMPORTED if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # `import NAME` raises ImportError while tensorboardX is imported
    try:
        from tensorboardX import SummaryWriter
    finally:
        for name in blocked:
            del sys.modules[name]
    # a NaN metric is written as it is; the run says which steps were not finite, tensorboardX would warn per scalar
    logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
    return _refusals_kept(SummaryWriter(directory))


def _refusals_kept(writer):
    """`writer` with the first OSError of its events file (a full disk: a write, a flush or the close) kept in
    `writer.refused`, and nothing written after it. tensorboardX raised it in its own thread, at close and again in
    its exit hook, a traceback each; `MetricsLog` raises it once, naming the folder."""
    writer.refused = None
    # (tensorboardX 2.x's events writer, used by the writer's thread, its flush and its close; another layout is left
    # as it is: its errors then come out as tensorboardX raises them)
    events = getattr(getattr(getattr(writer, "file_writer", None), "event_writer", None), "_ev_writer", None)
    if events is None:
        return writer

    def kept(method):
        def call(*args, **kwargs):
            if writer.refused is None:
                try:
                    return method(*args, **kwargs)
                except OSError as e:
                    writer.refused = e

        return call

    for name in ("write_event", "flush", "close"):
        setattr(events, name, kept(getattr(events, name)))
    return writer


def require_wandb(cfg: Config) -> None:
    """Refuse `log.wandb=true` without the wandb package before anything is compiled."""
    if cfg.log.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("log.wandb: the wandb package is not installed: pip install wandb (or the project's "
                          "wandb extra), or set log.wandb=false")


def wandb_run(cfg: Config, log_dir: str):
    """A W&B run that a restarted run resumes: the id is created once and kept in the work dir."""
    import wandb

    id_path = os.path.join(cfg.workdir, "wandb_id")
    run_id = (config_lib.read_text(id_path) or "").strip()
    if not run_id:
        run_id = secrets.token_hex(4)
        config_lib.write_text(id_path, run_id)
    name = cfg.log.wandb_name or cfg.workdir.rstrip("/").rsplit("/", 1)[-1]
    return wandb.init(project=cfg.log.wandb_project, entity=cfg.log.wandb_entity or None, name=name, id=run_id,
                      resume="allow", dir=log_dir, config=config_lib.flatten(cfg))


class MetricsLog:
    """Metrics as JSON lines and TensorBoard scalars (and W&B when asked), written by process 0 only."""

    def __init__(self, cfg: Config, start_step: int = 0):
        """`start_step`: the step the run starts from; rows of later steps that metrics.jsonl already holds (a run
        stopped after its last checkpoint, then resumed from it) are dropped, as is a line cut off mid-write."""
        self.workdir = cfg.workdir
        self.dir = workdir_lib.log_dir(cfg.workdir)
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, "metrics.jsonl")
        _keep_rows_up_to(path, start_step)
        self.jsonl = open(path, "a")
        self.tb_dir = os.path.join(self.dir, "tensorboard")
        self.tb = summary_writer(self.tb_dir)
        self.wandb = wandb_run(cfg, self.dir) if cfg.log.wandb else None

    def write(self, metrics: dict) -> None:
        """One row of metrics; a write the disk refuses (a full disk) is an OSError naming the file or folder."""
        with paths.naming(self.jsonl.name):
            self.jsonl.write(json.dumps(metrics) + "\n")
            self.jsonl.flush()
        step = metrics["step"]
        for k, v in metrics.items():
            if k != "step" and isinstance(v, (int, float)):
                self.tb.add_scalar(k, v, step)
        self.tb.flush()
        self._raise_refused()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=step)

    def _raise_refused(self) -> None:
        if self.tb.refused is not None:
            with paths.naming(self.tb_dir):
                raise self.tb.refused

    def sync(self) -> None:
        """Copy the log dir's files into a remote work dir (nothing to do for a local one)."""
        copy_logs(self.dir, self.workdir)

    def close(self) -> None:
        """Closes the files (each, whatever the other did), then raises the first write the disk refused."""
        try:
            with paths.naming(self.jsonl.name):
                self.jsonl.close()  # (closed also where its last flush fails)
        finally:
            self.tb.close()
        self._raise_refused()
        if self.wandb is not None:
            self.wandb.finish()
        self.sync()


def _keep_rows_up_to(path: str, step: int) -> None:
    """Rewrite a metrics.jsonl without its rows past `step` and without a last line that was cut off."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    with paths.staged_file(path) as tmp, open(tmp, "w") as f:
        f.writelines(kept)


def copy_logs(log_dir: str, workdir: str) -> None:
    """metrics.jsonl, tensorboard/ and the plots of a local log dir, copied into a remote work dir."""
    if not workdir_lib.is_remote(workdir):
        return
    from etils import epath

    dest = epath.Path(workdir)
    for root, dirs, files in os.walk(log_dir):
        dirs[:] = [d for d in dirs if d != "wandb"]  # W&B's own files: it uploads them itself
        for name in files:
            if name == ".lock":
                continue
            src = os.path.join(root, name)
            target = dest / os.path.relpath(src, log_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(open(src, "rb").read())
