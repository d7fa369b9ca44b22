"""The inner loop and the outer loss (Algorithm 2), differentiable with respect to η.

T inner steps run in a `lax.scan`. Each step is checkpointed (`jax.checkpoint`): its activations
are recomputed in the backward pass, so the outer backward pass holds only the per-step inner
state (θ_i, υ_i), plus, with `save_inner_grads`, the inner gradients ∇L_i (named `inner_grads` and
kept by the checkpoint policy), which saves one inner backward pass per step at meta-gradient time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from metatrain import mixflow
from metatrain.errors import ConfigError
from metatrain.tasks import Task

INNER_GRADS = "inner_grads"
INNER_CHECKPOINTS = ("every_step", "sqrt", "binomial")


@dataclasses.dataclass(frozen=True)
class MetaGradMethod:
    """How the meta-gradient is computed: the differentiation mode, whether inner gradients are saved in
    the per-step checkpoint, and which inner states are kept. Block remat is a model option
    (`ModelConfig.remat`).

    `inner_checkpoint` says which inner states the forward pass keeps for the backward pass:
    `every_step` all T; `sqrt` the starts of ⌈T/k⌉ segments of k = ⌈√T⌉ steps, each segment re-run
    in the backward pass (T extra inner steps); `binomial` recursive halving down to parts of two
    steps, each level re-run (about T·(log2(T) - 1) extra inner steps), keeping O(log T) states at
    any time. Saved inner gradients are kept for the steps of the part being differentiated.
    """

    mode: str = "mixflow"
    save_inner_grads: bool = True
    inner_checkpoint: str = "every_step"

    def __post_init__(self):
        if self.mode not in mixflow.MODES:
            raise ConfigError(f"mode: unknown meta-gradient mode {self.mode!r}; choose one of {mixflow.MODES}")
        if self.inner_checkpoint not in INNER_CHECKPOINTS:
            raise ConfigError(f"inner_checkpoint: unknown schedule {self.inner_checkpoint!r}; "
                              f"choose one of {INNER_CHECKPOINTS}")


@dataclasses.dataclass
class OuterAux:
    inner: tuple[Any, Any]  # (θ_T, υ_T): the next outer step's start when the task carries state
    inner_losses: jax.Array  # [T]


jax.tree_util.register_dataclass(OuterAux, data_fields=["inner", "inner_losses"], meta_fields=[])


def outer_loss(task: Task, method: MetaGradMethod) -> Callable:
    """`f(meta, inner, batches, outer_batch) -> (V, OuterAux)`; batches have a leading [T] axis."""
    # the LoRA base weights (None without LoRA) go in as an argument that gets no cotangent
    inner_loss = lambda theta, meta, batch, frozen: task.with_frozen(frozen).inner_loss(theta, meta, batch)
    inner_value_and_grad = mixflow.value_and_grad(inner_loss, method.mode, frozen_argnums=(2,))

    def step(carry, batch, meta):
        theta, opt_state = carry
        loss, grads = inner_value_and_grad(theta, meta, batch, task.frozen)
        if method.save_inner_grads:
            grads = jax.tree.map(lambda g: checkpoint_name(g, INNER_GRADS), grads)
        return task.update(grads, theta, opt_state, meta), loss

    policy = (jax.checkpoint_policies.save_only_these_names(INNER_GRADS) if method.save_inner_grads
              else jax.checkpoint_policies.nothing_saveable)
    step = jax.checkpoint(step, policy=policy)

    def f(meta, inner, batches, outer_batch):
        start = task.inner_start(meta, inner)
        final, inner_losses = unrolled(lambda c, b: step(c, b, meta), start, batches, method.inner_checkpoint)
        return task.outer_loss(final[0], meta, outer_batch), OuterAux(final, inner_losses)

    return f


def segments(n_steps: int, schedule: str) -> list[int]:
    """Lengths of the segments whose start states the forward pass keeps (every_step: all steps are kept)."""
    if schedule == "every_step" or n_steps <= 2:
        return [1] * n_steps
    if schedule == "sqrt":
        k = math.ceil(math.sqrt(n_steps))
        return [k] * (n_steps // k) + ([n_steps % k] if n_steps % k else [])
    return [n_steps // 2, n_steps - n_steps // 2]  # binomial: the top halves


def unrolled(step: Callable, carry, batches, schedule: str = "every_step"):
    """`lax.scan(step, carry, batches)` with the inner-step checkpoint schedule (see `MetaGradMethod`)."""
    n = jax.tree.leaves(batches)[0].shape[0]
    if schedule == "every_step" or n <= 2:
        return jax.lax.scan(step, carry, batches)
    if schedule == "sqrt":
        segment = jax.checkpoint(lambda c, b: jax.lax.scan(step, c, b),
                                 policy=jax.checkpoint_policies.nothing_saveable)
        k = segments(n, schedule)[0]
        full = n // k  # segments of k steps, scanned; then the remainder as one more segment
        split = jax.tree.map(lambda x: x[:full * k].reshape((full, k) + x.shape[1:]), batches)
        carry, losses = jax.lax.scan(segment, carry, split)
        losses = losses.reshape((full * k,) + losses.shape[2:])
        if n % k:
            carry, rest = segment(carry, jax.tree.map(lambda x: x[full * k:], batches))
            losses = jnp.concatenate([losses, rest])
        return carry, losses

    def halves(c, b):  # binomial: each half checkpointed, recursively, down to parts of <= 2 steps
        m = jax.tree.leaves(b)[0].shape[0]
        if m <= 2:
            return jax.lax.scan(step, c, b)
        part = lambda lo, hi: jax.tree.map(lambda x: x[lo:hi], b)
        c, first = checkpointed(c, part(0, m // 2))
        c, second = checkpointed(c, part(m // 2, m))
        return c, jnp.concatenate([first, second])

    checkpointed = jax.checkpoint(halves, policy=jax.checkpoint_policies.nothing_saveable)
    return halves(carry, batches)


def meta_value_and_grad(task: Task, method: MetaGradMethod) -> Callable:
    """`g(meta, inner, batches, outer_batch) -> ((V, OuterAux), dV/dmeta)`."""
    return jax.value_and_grad(outer_loss(task, method), has_aux=True)
