"""Typed run configuration: dataclasses, YAML presets in `configs/`, dotted command-line overrides.

`load(preset, overrides)` is the one place a run's configuration is read and validated. Everything
goes through OmegaConf structured configs, so an unknown key or a wrong type is refused with the
field's name; cross-field checks follow in `validate`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.pipeline import DataConfig
from metatrain.mixflow import MODES
from models import ModelConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A bad configuration; the message is one line naming the field and a fix."""


@dataclasses.dataclass(frozen=True)
class MetaOptConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    clip_norm: float = 1.0
    eps: float = 1e-8  # Adam's denominator floor


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # -1: all devices not used by the other axis
    fsdp: int = 1


@dataclasses.dataclass(frozen=True)
class InnerConfig:
    init_from: str = ""  # a `metatrain pretrain` work dir or an export dir: the inner model starts there


@dataclasses.dataclass(frozen=True)
class Config:
    task: str = "loss_weighting"
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(
        d_model=64, n_heads=4, d_ff=256, n_layers=2, remat=True))
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    inner_lr: float = 1e-3
    inner: InnerConfig = dataclasses.field(default_factory=InnerConfig)
    mode: str = "mixflow"  # default | mixflow | revfwd | auto (compile each, keep the lowest peak memory)
    save_inner_grads: bool = True
    inner_checkpoint: str = "every_step"  # every_step | sqrt | binomial | auto: inner states kept for the backward pass
    meta_opt: MetaOptConfig = dataclasses.field(default_factory=MetaOptConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    steps: int = 300
    seed: int = 0
    workdir: str = "runs/default"
    baseline: str = "none"  # none | uniform: also train the inner model with uniform weights on the same data
    eval_batches: int = 8
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    max_bad_steps: int = 5  # stop after this many non-finite meta-gradients in a row


def _check(cond: bool, field: str, message: str):
    if not cond:
        raise ConfigError(f"{field}: {message}")


def validate(cfg: Config) -> Config:
    _check(cfg.mode in MODES + ("auto",), "mode", f"{cfg.mode!r} is not one of {MODES + ('auto',)}")
    from metatrain.unroll import INNER_CHECKPOINTS

    _check(cfg.inner_checkpoint in INNER_CHECKPOINTS + ("auto",), "inner_checkpoint",
           f"{cfg.inner_checkpoint!r} is not one of {INNER_CHECKPOINTS + ('auto',)}")
    _check(cfg.steps > 0, "steps", f"must be > 0, got {cfg.steps}")
    _check(cfg.inner_lr > 0, "inner_lr", f"must be > 0, got {cfg.inner_lr}")
    _check(cfg.meta_opt.schedule in ("constant", "cosine"), "meta_opt.schedule",
           f"{cfg.meta_opt.schedule!r} is not constant or cosine")
    _check(cfg.baseline in ("none", "uniform"), "baseline", f"{cfg.baseline!r} is not none or uniform")
    _check(cfg.eval_batches >= 1, "eval_batches", f"must be >= 1, got {cfg.eval_batches}")
    init_from = cfg.inner.init_from
    _check(not init_from or os.path.isdir(init_from), "inner.init_from",
           f"{init_from!r} is not a directory; give a `metatrain pretrain` work dir or a `metatrain export` dir")
    for name in ("data", "fsdp"):
        size = getattr(cfg.mesh, name)
        _check(size == -1 or size >= 1, f"mesh.{name}", f"must be -1 (fill) or >= 1, got {size}")
    from metatrain.tasks import TaskError, task_class

    try:
        task_class(cfg.task)
    except TaskError as e:
        raise ConfigError(f"task: {e}") from None
    return cfg


def load(preset: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults ← `configs/<preset>.yaml` (or a YAML path) ← `key=value` overrides; validated."""
    try:
        merged = OmegaConf.structured(Config)
        if preset:
            path = preset if preset.endswith((".yaml", ".yml")) else str(CONFIG_DIR / f"{preset}.yaml")
            text = read_text(path)
            if text is None:
                names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
                raise ConfigError(f"preset: no config {preset!r}; choose one of {names} or give a .yaml path")
            merged = OmegaConf.merge(merged, OmegaConf.create(text))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"override {bad[0]!r}: write overrides as key=value, e.g. steps=100")
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        cfg = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key or 'config'}: {str(e).splitlines()[0]}") from None
    except (TypeError, ValueError) as e:  # the dataclasses' own checks (e.g. ModelConfig.__post_init__)
        raise ConfigError(str(e).splitlines()[0]) from None
    return validate(cfg)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def is_remote(path: str) -> bool:
    """gs://... and other URL-style paths (read and written through etils.epath, as Orbax does)."""
    return "://" in path


def workdir_config_path(workdir: str) -> str:
    return os.path.join(workdir, "config.yaml")


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(workdir, "checkpoints") if is_remote(workdir) else os.path.abspath(
        os.path.join(workdir, "checkpoints"))


def log_dir(workdir: str) -> str:
    """Where metrics.jsonl, TensorBoard events and curves.png go: the work dir, or for a remote work dir
    (gs://...) a local `runs/<name>` on process 0's host (appending to object storage is not possible)."""
    return os.path.join("runs", workdir.rstrip("/").rsplit("/", 1)[-1]) if is_remote(workdir) else workdir


def latest_step(workdir: str) -> int | None:
    """The step of the newest finished checkpoint in the work dir (unfinished saves are `N.orbax-...-tmp`)."""
    from etils import epath

    ckpt = epath.Path(checkpoint_dir(workdir))
    steps = [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()] if ckpt.is_dir() else []
    return max(steps, default=None)


def has_checkpoint(workdir: str) -> bool:
    return latest_step(workdir) is not None


def read_text(path: str) -> str | None:
    from etils import epath

    p = epath.Path(path)
    return p.read_text() if p.exists() else None


def write_text(path: str, text: str) -> None:
    from etils import epath

    p = epath.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
