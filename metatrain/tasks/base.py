"""The bilevel-optimisation task interface (Algorithm 2 of the MixFlow-MG paper).

A task says five things; the framework does the rest (the inner `lax.scan`, per-step
checkpoints, the mixed-mode meta-gradient, sharding, the outer optimiser):

=====================================  ===============================================
method                                 Algorithm 2
=====================================  ===============================================
`init_meta(key) -> eta`                meta-parameters η (a pytree of floats)
`init_inner(key, eta) -> (theta, opt)` inner state (θ0, υ0) at the start of training
`inner_start(eta, inner) -> (theta,    the state an outer step starts from: the carried
opt)`                                  one by default (truncated BPTT); MAML: θ0 = η
`resets_inner` (class attribute)       True when every outer step restarts from η: then
                                       no inner state is carried (`inner` is None)
`inner_loss(theta, eta, batch)`        L(θ, η, x): a scalar
`update(grads, theta, opt, eta)`       Υ(∇L, θ, υ, η) -> (θ', υ')
`outer_loss(theta, eta, batch)`        V(θ_T, η, x_val): a scalar
=====================================  ===============================================

A batch is a dict with `tokens: int [batch, seq+1]` and optionally `segment_ids`, `positions`,
`loss_mask` (conversations: 1 on the tokens trained on; same shape) and per-example fields.
`self.example_losses(theta, batch)` gives the next-token loss per example. Every method must be a
pure function of its arguments (it is traced by JAX).

With LoRA (`inner.lora.rank > 0`) θ is the adapters alone; the base weights are a frozen argument of
the outer step that the framework binds to the task (`with_frozen`) before calling its methods, and
`self.inner_model(theta)` / `self.example_losses(theta, batch)` apply base + adapters. A task that
builds θ itself should start from `self.init_params(key)`, which gives the adapters under LoRA.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from metatrain import models
from metatrain.errors import ConfigError, TaskError
from metatrain.models import LoRAConfig, ModelConfig, split_adapters

if TYPE_CHECKING:
    from metatrain.tasks.weight_eval import EvalContext

Pytree = Any


class Task:
    """Base class for BLO tasks. Subclass it and override what your task changes.

    The defaults: inner model = `model`, inner optimiser = Adam (differentiable: `eps_root > 0`),
    inner loss = mean next-token loss, outer loss = mean next-token loss on the outer batch,
    inner state carried over between outer steps.
    """

    name = "task"
    # True: every outer step starts from η (MAML), so the Trainer keeps no inner state between steps and
    # `inner_start` gets `inner=None`. False: the inner state (θ, υ) is carried from step to step.
    resets_inner: bool = False
    # True for tasks whose η holds a model built from `meta_model` (loss weighting's scorer): only they take the
    # run's `meta_model.*` settings; for the others those settings are refused rather than ignored.
    uses_meta_model: bool = False
    # What `__init__` sets, with class-level defaults, so a task that brings its own model (and an `__init__` that
    # does not call this one) still has them: no transformer, no LoRA, no bound base weights.
    model: ModelConfig | None = None
    meta_model: ModelConfig | None = None
    lora: LoRAConfig | None = None
    frozen: Pytree = None

    def evaluation(self, run: EvalContext) -> Any | None:
        """Task-specific held-out metrics beside the validation loss: None (the default) for none.

        Args:
          run: a `tasks.weight_eval.EvalContext`: the run's config, data streams and shardings.

        Returns:
          None, or an object with `metrics(meta, step) -> dict` (`eval_*` metrics, every evaluation) and
          `summary(meta, last_metrics) -> dict` (entries of the run's summary, at its end).
        """
        return None

    def __init__(self, model: ModelConfig, inner_lr: float = 1e-3, meta_model: ModelConfig | None = None,
                 lora: LoRAConfig | None = None):
        self.model = model
        self.meta_model = meta_model or model
        self.inner_lr = inner_lr
        self.lora = lora if lora is not None and lora.rank > 0 else None
        self.graphdef, shapes = models.abstract_init(model, self.lora)
        if self.lora is not None and not jax.tree.leaves(split_adapters(shapes)[1]):
            raise ConfigError(f"inner.lora.targets: {self.lora.targets} adapts no weight of this model ('gate' exists "
                              "in SwiGLU MLPs only, model.mlp=swiglu); name at least one of q,k,v,o,up,down")
        self.inner_opt = optax.adam(inner_lr, eps_root=1e-8)
        self.frozen = None  # the LoRA base weights, bound inside the traced step by `with_frozen`

    # ---- the five pieces -------------------------------------------------------------------
    def init_meta(self, key: jax.Array) -> Pytree:
        """The meta-parameters η at the start of meta-training. Every task defines it.

        Args:
          key: a JAX random key.

        Returns:
          η, a pytree of floating-point arrays.
        """
        raise NotImplementedError(f"task {self.name!r} must define init_meta(key)")

    def init_inner(self, key: jax.Array, meta: Pytree) -> tuple[Pytree, Pytree]:
        """The inner state at the start of training: a fresh model and its Adam state by default.

        Args:
          key: a JAX random key.
          meta: η.

        Returns:
          (θ_0, υ_0): the inner parameters and the inner optimiser's state.
        """
        theta = self.init_params(key)
        return theta, self.inner_opt.init(theta)

    def inner_start(self, meta: Pytree, inner: tuple[Pytree, Pytree]) -> tuple[Pytree, Pytree]:
        """Where each outer step's inner loop starts: the carried state by default (truncated BPTT).

        Args:
          meta: η.
          inner: the carried (θ, υ), or None for tasks with `resets_inner = True`.

        Returns:
          (θ_0, υ_0) of this outer step.
        """
        return inner

    def inner_loss(self, theta: Pytree, meta: Pytree, batch: dict) -> jax.Array:
        """L(θ, η, x): the inner loss, the mean next-token loss by default.

        Args:
          theta: the inner parameters θ (the LoRA adapters under LoRA).
          meta: η; its floating-point leaves get mixed second derivatives.
          batch: a dict with `tokens: int [batch, seq+1]` and optionally `segment_ids`, `positions`.

        Returns:
          A scalar.
        """
        return batch_mean(self.example_losses(theta, batch), batch)

    def update(self, grads: Pytree, theta: Pytree, opt_state: Pytree, meta: Pytree) -> tuple[Pytree, Pytree]:
        """Υ: one inner optimiser step, Adam by default (`eps_root > 0`, so it is differentiable at zero gradients).

        Args:
          grads: ∇_θ L at (θ, η, x).
          theta: θ_i.
          opt_state: υ_i.
          meta: η.

        Returns:
          (θ_{i+1}, υ_{i+1}).
        """
        updates, opt_state = self.inner_opt.update(grads, opt_state, theta)
        return optax.apply_updates(theta, updates), opt_state

    def outer_loss(self, theta: Pytree, meta: Pytree, batch: dict) -> jax.Array:
        """V(θ_T, η, x_val): the outer loss, the mean next-token loss by default; also the run's validation loss.

        Args:
          theta: θ_T, the inner parameters after the T inner steps.
          meta: η.
          batch: an outer batch (as in `inner_loss`).

        Returns:
          A scalar.
        """
        return batch_mean(self.example_losses(theta, batch), batch)

    def place_pretrained(self, params: Pytree, meta: Pytree, inner
                         ) -> tuple[Pytree, tuple[Pytree, Pytree] | None]:
        """Put pretrained inner-model parameters in place (`inner.init_from`): tasks that restart from η
        (MAML) take them as η, the others as θ with a fresh inner optimiser state. Returns (meta, inner).
        Not called under LoRA: the pretrained weights are then the frozen base."""
        if self.resets_inner:
            return params, inner
        return meta, (params, self.inner_opt.init(params))

    def baseline_meta(self, meta: Pytree) -> Pytree:
        """η of the `baseline=uniform` run, trained on the same batches with η frozen: η itself by default."""
        return meta

    def baseline_task(self) -> Task:
        """The task whose inner loop the `baseline=uniform` run takes (with `baseline_meta`'s η): this one by
        default; a task may return a copy that skips work whose result that η fixes."""
        return self

    # ---- the inner model -------------------------------------------------------------------
    def init_params(self, key: jax.Array) -> Pytree:
        """Fresh inner-model parameters θ: the whole model, or under LoRA its adapters (B = 0: base behaviour)."""
        _, params = models.init(self.model, key, self.lora)
        return params if self.lora is None else split_adapters(params)[1]

    def init_frozen(self, key: jax.Array) -> Pytree | None:
        """The LoRA base weights (random from `key`, until `inner.init_from` replaces them); None without LoRA."""
        return None if self.lora is None else split_adapters(models.init(self.model, key, self.lora)[1])[0]

    def with_frozen(self, frozen: Pytree | None) -> Task:
        """A shallow copy of the task whose inner model applies θ on the base weights `frozen` (LoRA)."""
        bound = copy.copy(self)
        bound.frozen = frozen
        return bound

    def inner_model(self, theta: Pytree) -> nnx.Module:
        """The inner model with parameters θ (on the bound base weights under LoRA)."""
        if self.lora is None:
            return nnx.merge(self.graphdef, theta)
        if self.frozen is None:
            raise TaskError(f"task {self.name!r}: LoRA adapters need the base weights; call "
                            "task.with_frozen(state['frozen']) first")
        return nnx.merge(self.graphdef, self.frozen, theta)

    # ---- helpers ---------------------------------------------------------------------------
    def example_losses(self, theta: Pytree, batch: dict) -> jax.Array:
        """Next-token loss per example of the inner model with parameters `theta`.

        Args:
          theta: θ (the adapters under LoRA).
          batch: a dict with `tokens: int [batch, seq+1]` and optionally `segment_ids`, `positions`, `loss_mask`.

        Returns:
          float32 [batch]: each example's mean next-token loss over its valid positions (those `loss_mask` marks).
        """
        return self.inner_model(theta).example_losses(batch["tokens"], batch.get("segment_ids"),
                                                      batch.get("positions"), batch.get("loss_mask"))


def trained_examples(batch: dict) -> jax.Array:
    """Which examples of `batch` have a target their loss counts, [batch] bool: all of them but, with a loss mask, a
    packed row of a conversation's prompts only (its loss is 0 whatever the parameters)."""
    targets = models.loss_targets(batch.get("segment_ids"), batch.get("loss_mask"))
    return jnp.ones(batch["tokens"].shape[:1], bool) if targets is None else (targets > 0).any(-1)


def batch_mean(losses: jax.Array, batch: dict) -> jax.Array:
    """The mean of per-example losses over the examples that have a target to train on.

    Without a loss mask that is every example. With one (conversations), a packed row of prompts only has loss 0
    and is left out, where a plain `.mean()` would count it and pull the mean down.

    Args:
      losses: [batch] per-example losses, as `Task.example_losses` gives them.
      batch: the batch they are of (its `segment_ids` and `loss_mask`).

    Returns:
      A scalar: the mean over the examples with a target (0 where none has one).
    """
    if batch.get("loss_mask") is None:
        return losses.mean()
    trained = trained_examples(batch)
    return jnp.where(trained, losses, 0).sum() / jnp.maximum(trained.sum(), 1).astype(losses.dtype)


def _describe(tree) -> str:
    leaves = jax.tree.leaves(tree)
    return f"{len(leaves)} leaves" if len(leaves) > 3 else str([(x.shape, str(x.dtype)) for x in leaves])


def validate(task: Task, meta: Pytree, inner: tuple[Pytree, Pytree], batch: dict, frozen: Pytree = None) -> None:
    """Checks the task contract abstractly (`jax.eval_shape`: no compute) and raises `TaskError`. `frozen`: the
    LoRA base weights (or their shapes), bound to the task as the outer step binds them."""
    name = getattr(task, "name", type(task).__name__)

    def fail(msg):
        raise TaskError(f"task {name!r}: {msg}")

    for x in jax.tree.leaves(meta):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            fail(f"meta-parameters must be floating point (they are differentiated), found dtype {x.dtype} "
                 f"with shape {x.shape}; cast them with .astype(jnp.float32)")
    if not jax.tree.leaves(meta):
        fail("init_meta returned no arrays: there is nothing to meta-learn")

    def call(what, method, *args):
        try:
            return jax.eval_shape(lambda fr, *a: getattr(task.with_frozen(fr), method)(*a), frozen, *args)
        except TaskError:
            raise
        except Exception as e:  # noqa: BLE001 — re-raised with the task's name and the method
            fail(f"{what} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    if not isinstance(getattr(type(task), "resets_inner", None), bool):
        fail("resets_inner must be a class attribute True or False (True: every outer step restarts from η)")
    theta, opt_state = call("inner_start(meta, inner)", "inner_start", meta, None if task.resets_inner else inner)
    for what, args in (("inner_loss", (theta, meta, batch)), ("outer_loss", (theta, meta, batch))):
        out = call(f"{what}(theta, meta, batch)", what, *args)
        if not hasattr(out, "shape") or out.shape != () or not jnp.issubdtype(out.dtype, jnp.floating):
            fail(f"{what} must return a floating-point scalar, got {getattr(out, 'shape', type(out))} "
                 f"{getattr(out, 'dtype', '')}; reduce it, e.g. with .mean()")
    new_theta, new_opt = call("update(grads, theta, opt_state, meta)", "update", theta, theta, opt_state, meta)
    for what, old, new in (("theta", theta, new_theta), ("optimizer state", opt_state, new_opt)):
        if jax.tree.structure(old) != jax.tree.structure(new):
            fail(f"update must return {what} with the same structure as it was given")
        for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
            if a.shape != b.shape or a.dtype != b.dtype:
                fail(f"update changed {what} leaf from {a.shape} {a.dtype} to {b.shape} {b.dtype}; "
                     "it must keep shapes and dtypes (scan carries cannot change)")
