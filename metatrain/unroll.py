"""The inner loop and the outer loss (Algorithm 2), differentiable with respect to η.

T inner steps run in a `lax.scan`. Each step is checkpointed (`jax.checkpoint`): its activations
are recomputed in the backward pass, so the outer backward pass holds only the per-step inner
state (θ_i, υ_i), plus, with `save_inner_grads`, the inner gradients ∇L_i (named `inner_grads` and
kept by the checkpoint policy), which saves one inner backward pass per step at meta-gradient time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from metatrain import mixflow
from metatrain.tasks import Task

INNER_GRADS = "inner_grads"


@dataclasses.dataclass(frozen=True)
class Unroll:
    """How the meta-gradient is computed. Block remat is a model option (`ModelConfig.remat`)."""

    mode: str = "mixflow"
    save_inner_grads: bool = True

    def __post_init__(self):
        if self.mode not in mixflow.MODES:
            raise ValueError(f"unknown meta-gradient mode {self.mode!r}; choose one of {mixflow.MODES}")


@dataclasses.dataclass
class OuterAux:
    inner: tuple[Any, Any]  # (θ_T, υ_T): the next outer step's start when the task carries state
    inner_losses: jax.Array  # [T]


jax.tree_util.register_dataclass(OuterAux, data_fields=["inner", "inner_losses"], meta_fields=[])


def outer_loss(task: Task, unroll: Unroll) -> Callable:
    """`f(meta, inner, batches, outer_batch) -> (V, OuterAux)`; batches have a leading [T] axis."""
    inner_value_and_grad = mixflow.value_and_grad(task.inner_loss, unroll.mode)

    def step(carry, batch, meta):
        theta, opt_state = carry
        loss, grads = inner_value_and_grad(theta, meta, batch)
        if unroll.save_inner_grads:
            grads = jax.tree.map(lambda g: checkpoint_name(g, INNER_GRADS), grads)
        return task.update(grads, theta, opt_state, meta), loss

    policy = (jax.checkpoint_policies.save_only_these_names(INNER_GRADS) if unroll.save_inner_grads
              else jax.checkpoint_policies.nothing_saveable)
    step = jax.checkpoint(step, policy=policy)

    def f(meta, inner, batches, outer_batch):
        start = task.inner_start(meta, inner)
        final, inner_losses = jax.lax.scan(lambda c, b: step(c, b, meta), start, batches)
        return task.outer_loss(final[0], meta, outer_batch), OuterAux(final, inner_losses)

    return f


def meta_value_and_grad(task: Task, unroll: Unroll) -> Callable:
    """`g(meta, inner, batches, outer_batch) -> ((V, OuterAux), dV/dmeta)`."""
    return jax.value_and_grad(outer_loss(task, unroll), has_aux=True)
