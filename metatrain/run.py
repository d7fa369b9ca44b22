"""A run opened from its work dir: its config as it ran, its latest checkpoint, and what was trained, restored on
this process's first device. Every command that reads a finished (or interrupted) run opens it here: `scores`,
`eval`, `filter`, `generate`, `export` and the curation experiment.

    run = Run.open("runs/default")
    run.kind, run.step, run.cfg.task      # "meta-train" (or "pretrain"), the latest checkpoint's step, the task
    meta = run.part("meta")               # one entry of the saved state, on one device
    theta = run.part("inner")[0]          # (a population's members stacked on the leading axis)

Nothing is compiled or trained to open a run; the checkpoint's metadata is read at once, its arrays when a part is
asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import jax
import orbax.checkpoint as ocp

from metatrain import config as config_lib
from metatrain import models, paths
from metatrain import step as step_lib
from metatrain import workdir as workdir_lib
from metatrain.checkpoints import (
    drop_stray_read_errors,
    first_layout_difference,
    first_line,
    saved_tree,
    silence_failed_reads,
)
from metatrain.config import Config
from metatrain.data.tokenizer import HF_PREFIX, load_tokenizer
from metatrain.errors import ConfigError, DataError, MetatrainError
from metatrain.models import ModelConfig
from metatrain.tasks import Task, make_task

PRETRAIN, META_TRAIN = "pretrain", "meta-train"
# what reading a float64 run where JAX's 64-bit mode is off would do (JAX turns float64 arrays into float32)
READ_AS_FLOAT32 = "it would be read and computed in float32"


def on_one_device(shapes):
    """ShapeDtypeStructs of `shapes` (arrays, shapes or checkpoint metadata) on this process's first device."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)


def _what_else(workdir: str) -> str:
    """What a dir without checkpoints holds instead, in words that say what to give (the end of an error line)."""
    kind = paths.folder_kind(workdir)
    if kind == "hf":
        return (f"it holds a Hugging Face model (config.json and safetensors weights); give it as hf:{workdir} to "
                f"`metatrain generate` or inner.init_from")
    if kind == "export":
        return ("it holds a model exported by `metatrain export` (export.json), not a run; give the run it came from "
                "(`metatrain generate` and inner.init_from take the export itself)")
    if kind == "adapters":
        return ("it holds LoRA adapters (adapter_config.json); give the run they came from, or its merged model "
                "(metatrain export RUN --format hf --out DIR, then hf:DIR)")
    return f"it has no checkpoint (expected {workdir_lib.checkpoint_dir(workdir)}/<step>/)"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A work dir's latest checkpoint: its step, its state dir and the saved state's metadata tree."""

    step: int
    state_dir: str
    saved: dict

    @classmethod
    def latest(cls, workdir: str, say=lambda line: print(line, file=sys.stderr)) -> Checkpoint:
        """The newest finished checkpoint of `workdir` whose metadata reads (`say` names any newer unreadable one);
        a dir that is missing or has none is a one-line DataError."""
        workdir = paths.local(workdir)
        workdir_lib.require_dir(workdir)
        steps = workdir_lib.checkpoint_steps(workdir)
        if not steps:
            raise DataError(f"{workdir} is not a metatrain run: " + _what_else(workdir))
        damaged = []
        drop_stray_read_errors()
        for step in reversed(steps):
            state_dir = os.path.join(workdir_lib.checkpoint_dir(workdir), str(step), "state")
            try:
                saved = saved_tree(state_dir)
            except Exception as e:  # noqa: BLE001 — any unreadable checkpoint counts as damaged
                silence_failed_reads(os.path.dirname(state_dir))
                damaged.append(f"{step}: {e if isinstance(e, MetatrainError) else first_line(e)}")
                continue
            if damaged:
                say(f"{workdir}: reading checkpoint {step}, the newest intact one (damaged: {'; '.join(damaged)})")
            return cls(step, state_dir, saved)
        raise DataError(f"{workdir}: no intact checkpoint ({'; '.join(damaged)})")

    def part(self, key: str, target=None):
        """One top-level entry of the saved state, onto `target`'s shapes and shardings (default: the first
        device, as saved)."""
        if key not in self.saved:
            raise DataError(f"{self.state_dir} has no {key!r} entry (it has {sorted(self.saved)})")
        item = {key: on_one_device(self.saved[key]) if target is None else target}
        args = ocp.args.PyTreeRestore(item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                      partial_restore=True)
        return ocp.PyTreeCheckpointer().restore(self.state_dir, args=args)[key]


@dataclasses.dataclass(frozen=True)
class Run:
    """A run of `metatrain train` or `metatrain pretrain`: its work dir, its config as it ran (the data sources may be
    gone), and its latest checkpoint.

    Args:
      workdir: the work dir (absolute).
      cfg: the saved config (`config.yaml`).
      checkpoint: the latest checkpoint.
    """

    workdir: str
    cfg: Config
    checkpoint: Checkpoint

    @classmethod
    def open(cls, workdir: str, say=lambda line: print(line, file=sys.stderr),
             float32_means: str | None = READ_AS_FLOAT32) -> Run:
        """The run in `workdir` at its newest intact checkpoint (`say` names newer damaged ones); one that is missing,
        has no intact checkpoint or no config.yaml is a one-line DataError; a float64 run (parameters or compute)
        where JAX's 64-bit mode is off, a one-line ConfigError ending with `float32_means` (what reading it as float32
        would do; None: not checked, the caller checks what matters to it)."""
        workdir = paths.local(workdir)
        checkpoint = Checkpoint.latest(workdir, say)
        if config_lib.read_text(workdir_lib.config_path(workdir)) is None:
            raise DataError(f"{workdir} has checkpoints but no config.yaml: it was not written by `metatrain train` "
                            f"or `metatrain pretrain`")
        cfg = config_lib.load(workdir_lib.config_path(workdir), pretrained=False)
        if float32_means:
            models.require_float64(models.dtype_settings(cfg.model, prefix=f"{workdir}: model."), float32_means)
        return cls(workdir, cfg, checkpoint)

    @classmethod
    def kind_of(cls, workdir: str) -> str | None:
        """The kind of run in `workdir` (`pretrain` or `meta-train`) where a checkpoint tells it; None where none
        does (no checkpoint yet, none intact, no config.yaml: the command that opens the run says what is wrong)."""
        from metatrain.errors import MetatrainError

        if workdir_lib.latest_step(workdir) is None:
            return None
        try:
            return cls.open(workdir, say=lambda _: None, float32_means=None).kind  # whatever its dtypes
        except MetatrainError:
            return None

    @property
    def kind(self) -> str:
        """`pretrain` (its state is the model's `params`) or `meta-train`."""
        return PRETRAIN if "params" in self.checkpoint.saved else META_TRAIN

    @property
    def step(self) -> int:
        return self.checkpoint.step

    @property
    def saved(self) -> dict:
        """The saved state's metadata tree (its entries: `meta`, `inner`, `base`, ... or `params`)."""
        return self.checkpoint.saved

    def part(self, key: str, target=None):
        """One entry of the saved state on one device (or onto `target`'s shapes and shardings); one whose names or
        shapes are not what the run's config.yaml builds is a one-line DataError."""
        if key in self.saved:
            self._check_layout(key)
        return self.checkpoint.part(key, target)

    def _check_layout(self, key: str) -> None:
        try:
            expected = self.shapes.get(key)
        except MetatrainError:  # the task cannot be built here (a user's module gone): read the checkpoint as saved
            return
        difference = expected is not None and first_layout_difference(self.saved[key], expected, "config.yaml")
        if difference:
            raise DataError(f"{self.workdir}: checkpoint {self.step} does not match the run's config.yaml "
                            f"({key}: {difference}); was config.yaml changed "
                            f"after the run? Put back the one the run wrote")

    def reading(self, text_field: str | None) -> Run:
        """This run, reading documents from the field (JSONL) or column (Parquet, hf-disk) `text_field` in place of
        its config's `data.text_field` (None: that one); the other data settings stay the run's."""
        if text_field is None or text_field == self.cfg.data.text_field:
            return self
        data = dataclasses.replace(self.cfg.data, text_field=text_field)
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, data=data))

    def meta_training(self) -> Run:
        """This run, refused in one line unless it is a meta-training run (the commands that need a task's η)."""
        if self.kind != META_TRAIN:
            raise ConfigError(f"{self.workdir} is a pretrain run; give the work dir of a `metatrain train` run")
        return self

    @functools.cached_property
    def model(self) -> ModelConfig:
        """The model as it trained: its vocabulary is the tokenizer's, as the Trainer sets it. Where a Hugging Face
        tokenizer's dir is gone, the saved config's (a Hugging Face model's own, read from its config.json)."""
        try:
            tokenizer = self.tokenizer()
        except MetatrainError:
            if self.cfg.data.tokenizer.startswith(HF_PREFIX):
                return self.cfg.model
            raise
        return self.cfg.model.replace(vocab_size=tokenizer.vocab_size)

    @functools.cached_property
    def trained_cfg(self) -> Config:
        """The config with `model` as it trained (see `model`)."""
        return dataclasses.replace(self.cfg, model=self.model)

    @functools.cached_property
    def task(self) -> Task:
        """The run's task, as built for training (a pretrain run's: plain next-token training of its model)."""
        if self.kind == PRETRAIN:
            return Task(self.model, inner_lr=self.cfg.inner_lr)
        return make_task(self.cfg.task, **step_lib.task_arguments(self.trained_cfg))

    @functools.cached_property
    def shapes(self) -> dict:
        """The shapes (`jax.ShapeDtypeStruct`s) of the checkpointed state's entries as the run's program holds them:
        nnx states, where `saved` has their plain dicts (a pretrain run: its `params` only)."""
        if self.kind == PRETRAIN:
            return {"params": models.abstract_init(self.model)[1]}
        return step_lib.checkpointed(step_lib.meta_program(self.trained_cfg, mesh=None).state_shapes)

    def restored(self, key: str):
        """One entry of the saved state on one device, in the structure the run's program gives it (`shapes`): what
        the task's functions take (`run.task.scores(run.restored("meta"), batch)`)."""
        if key not in self.saved:  # the one-line error of `part`, before the shapes are built
            return self.part(key)
        return self.part(key, on_one_device(self.shapes[key]))

    def tokenizer(self):
        """The run's tokenizer (`data.tokenizer`, at `data.vocab_size`), loaded once."""
        return self._tokenizer

    @functools.cached_property
    def _tokenizer(self):
        return load_tokenizer(self.cfg.data.tokenizer, self.cfg.data.vocab_size)
