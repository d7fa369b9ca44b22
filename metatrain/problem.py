"""A concrete BLO problem: a task on a model, with batch shapes. Shared by check-grads and benchmarks."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp

from metatrain.mixflow import MODES
from metatrain.tasks import Task, make_task
from metatrain.unroll import Unroll
from models import ModelConfig


# model options a variant name may carry, e.g. `mixflow+remat+save+sqrt+blockwise+bf16`
MODEL_OPTIONS = {"blockwise": {"attention": "blockwise"}, "bf16": {"compute_dtype": "bfloat16"}}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to compute the meta-gradient: mode × block remat × saved inner gradients (× inner checkpoints),
    optionally on a changed model (`model_options`: keys of MODEL_OPTIONS, applied over the model given)."""

    mode: str
    remat: bool
    save: bool
    inner_checkpoint: str = "every_step"
    model_options: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        schedule = "" if self.inner_checkpoint == "every_step" else "+" + self.inner_checkpoint
        return (self.mode + ("+remat" if self.remat else "") + ("+save" if self.save else "") + schedule
                + "".join("+" + o for o in self.model_options))

    def model(self, model: ModelConfig) -> ModelConfig:
        """The model this variant runs: `model` with its block remat and model options."""
        changes = {k: v for o in self.model_options for k, v in MODEL_OPTIONS[o].items()}
        return model.replace(remat=self.remat, **changes)

    @property
    def unroll(self) -> Unroll:
        return Unroll(mode=self.mode, save_inner_grads=self.save, inner_checkpoint=self.inner_checkpoint)


def variants(modes=("default", "mixflow", "revfwd"), inner_checkpoint: str = "every_step") -> list[Variant]:
    return [Variant(m, r, s, inner_checkpoint) for m, r, s in itertools.product(modes, (False, True), (False, True))]


def parse_variant(name: str, inner_checkpoint: str = "every_step") -> Variant:
    """`MODE[+remat][+save][+sqrt|+binomial][+blockwise][+bf16]`; a schedule in the name wins over
    `inner_checkpoint`, model options apply over the model the variant is run on."""
    form = "MODE[+remat][+save][+sqrt|+binomial][+blockwise][+bf16], e.g. mixflow+remat+save+sqrt+blockwise"
    mode, *opts = name.strip().split("+")
    if mode not in MODES:
        raise ValueError(f"variant {name!r}: unknown mode {mode!r} ({' | '.join(MODES)}); use {form}")
    unknown = set(opts) - {"remat", "save", "sqrt", "binomial", *MODEL_OPTIONS}
    if unknown:
        raise ValueError(f"variant {name!r}: unknown option(s) {sorted(unknown)}; use {form}")
    schedules = [o for o in opts if o in ("sqrt", "binomial")]
    if len(schedules) > 1:
        raise ValueError(f"variant {name!r}: one inner-checkpoint schedule at most; use {form}")
    options = tuple(o for o in MODEL_OPTIONS if o in opts)
    return Variant(mode, "remat" in opts, "save" in opts, (schedules or [inner_checkpoint])[0], options)


@dataclasses.dataclass(frozen=True)
class Shapes:
    inner_steps: int = 2
    batch: int = 2
    seq_len: int = 8

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"--{f.name.replace('_', '-')} must be > 0, got {getattr(self, f.name)}")

    def batches(self, vocab: int, key: jax.Array | None = None):
        """Inner batches [T, batch, seq+1] and the outer batch [batch, seq+1]: random tokens,
        or `jax.ShapeDtypeStruct`s when no key is given (ahead-of-time compiles allocate nothing)."""
        inner_shape = (self.inner_steps, self.batch, self.seq_len + 1)
        outer_shape = (self.batch, self.seq_len + 1)
        if key is None:
            return ({"tokens": jax.ShapeDtypeStruct(inner_shape, jnp.int32)},
                    {"tokens": jax.ShapeDtypeStruct(outer_shape, jnp.int32)})
        k1, k2 = jax.random.split(key)
        return ({"tokens": jax.random.randint(k1, inner_shape, 0, vocab)},
                {"tokens": jax.random.randint(k2, outer_shape, 0, vocab)})


def build_task(task: str, model: ModelConfig, remat: bool, inner_lr: float = 1e-2) -> Task:
    """The task with block remat set on the inner model and on its meta model alike."""
    return make_task(task, model=model.replace(remat=remat), inner_lr=inner_lr,
                     meta_model=model.replace(remat=remat))


def abstract_state(task: Task):
    """(meta, inner) as ShapeDtypeStructs; inner is None for tasks that restart from η."""
    key = jax.random.key(0)
    meta = jax.eval_shape(task.init_meta, key)
    inner = None if task.resets_inner else jax.eval_shape(task.init_inner, key, meta)
    return meta, inner
