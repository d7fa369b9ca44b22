"""A concrete BLO problem: a task on a model, with batch shapes. Shared by check-grads and benchmarks."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp

from metatrain.tasks import Task, make_task
from metatrain.unroll import Unroll
from models import ModelConfig


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to compute the meta-gradient: mode × block remat × saved inner gradients (× inner checkpoints)."""

    mode: str
    remat: bool
    save: bool
    inner_checkpoint: str = "every_step"

    @property
    def name(self) -> str:
        schedule = "" if self.inner_checkpoint == "every_step" else "+" + self.inner_checkpoint
        return self.mode + ("+remat" if self.remat else "") + ("+save" if self.save else "") + schedule

    @property
    def unroll(self) -> Unroll:
        return Unroll(mode=self.mode, save_inner_grads=self.save, inner_checkpoint=self.inner_checkpoint)


def variants(modes=("default", "mixflow", "revfwd"), inner_checkpoint: str = "every_step") -> list[Variant]:
    return [Variant(m, r, s, inner_checkpoint) for m, r, s in itertools.product(modes, (False, True), (False, True))]


def parse_variant(name: str, inner_checkpoint: str = "every_step") -> Variant:
    """`MODE[+remat][+save][+sqrt|+binomial]`; the schedule in the name wins over `inner_checkpoint`."""
    mode, *opts = name.split("+")
    unknown = set(opts) - {"remat", "save", "sqrt", "binomial"}
    if unknown:
        raise ValueError(f"variant {name!r}: unknown option(s) {sorted(unknown)}; "
                         "use MODE[+remat][+save][+sqrt|+binomial]")
    schedule = next((o for o in opts if o in ("sqrt", "binomial")), inner_checkpoint)
    return Variant(mode, "remat" in opts, "save" in opts, schedule)


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
