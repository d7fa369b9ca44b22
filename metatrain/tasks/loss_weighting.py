"""Learned per-example loss weighting (after Hu et al., 2023).

η = (a meta language model with the inner model's architecture, a log-temperature τ). An example's
score is exp(τ) · (its mean next-token log-likelihood under the meta model), and the weights are
α(η, x) = batch · softmax(scores) (mean 1, so the inner step size is kept). The inner loss is
mean(α · NTP); the inner state carries over between outer steps. In a batch with a loss mask (conversations), an
example without a token to train on (a packed row of prompts only) has weight 0 and the softmax runs over the
others, n of them: α = n · softmax (mean 1 over them), and the inner loss is the mean over them. Its loss is 0
whatever its weight, and the likelihood readout (a mean over no token: 0) would rate it above every other.

Why a likelihood readout rather than a pooled scalar head: the meta-gradient tells the meta model to
make helpful examples more likely and harmful ones less, a dense per-token signal, and next-token
logits see token order from the first step (bigrams through the tied embedding), where a pooled
head must first grow attention features. In the main job (shuffled documents) this is the
difference between an AUC of ~0.6 and ~0.97 in 300 steps. With η at its random start the scores
are nearly equal, so training starts from almost uniform weights.

The meta model is `meta_model` (by default the inner model's architecture, never with LoRA adapters): a
small scorer for a big inner model, optionally pretrained (`meta_model.init_from`, see `place_scorer`).

With `meta_model.head=score` (and `meta_model.causal=false`: bidirectional attention) the score is instead
exp(τ) · a pooled scalar head, DataRater's rater; the head starts at zero, so the weights start uniform.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
from flax import nnx

from metatrain import models
from metatrain.tasks.base import Pytree, Task, batch_mean, trained_examples


class LossWeighting(Task):
    name = "loss_weighting"
    uses_meta_model = True
    uniform = False  # the baseline's copy (`baseline_task`): every weight 1, the meta model not run

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.meta_graphdef, _ = models.abstract_init(self.meta_model)

    def init_meta(self, key: jax.Array) -> Pytree:
        return {"lm": models.init(self.meta_model, key)[1], "log_temperature": jnp.zeros((), self.meta_model.dtype)}

    def scorer_body(self, lm: Pytree) -> Pytree:
        """The meta model's parameters a pretrained language model provides: all of them, or with a score head all
        but the head (`out`), which stays as initialised."""
        if self.meta_model.head == "lm":
            return lm
        return nnx.State({k: v for k, v in lm.raw_mapping.items() if k != "out"})

    def place_scorer(self, params: Pytree, meta: Pytree) -> Pytree:
        """η with pretrained meta-model parameters in place (`meta_model.init_from`; `scorer_body`'s part)."""
        if self.meta_model.head == "lm":
            return dict(meta, lm=params)
        return dict(meta, lm=nnx.State({**meta["lm"].raw_mapping, **params.raw_mapping}))

    def baseline_meta(self, meta: Pytree) -> Pytree:
        """exp(τ) underflows to 0: every score is 0 and every weight exactly 1, whatever the meta model."""
        return dict(meta, log_temperature=jnp.full_like(meta["log_temperature"], -1e4))

    def baseline_task(self) -> LossWeighting:
        """A copy whose weights are all 1 without running the meta model: what `baseline_meta`'s η gives (exactly,
        for a batch of a power of two), at no cost."""
        bound = copy.copy(self)
        bound.uniform = True
        return bound

    def scores(self, meta: Pytree, batch: dict) -> jax.Array:
        """exp(τ) · mean log-likelihood of each example under the meta model (with a score head: exp(τ) · its pooled
        scalar): [batch]. Higher → more weight."""
        model = nnx.merge(self.meta_graphdef, meta["lm"])
        inputs = (batch["tokens"], batch.get("segment_ids"), batch.get("positions"))
        if self.meta_model.head == "score":
            raw = model(*inputs)
            raw = raw.astype(jnp.promote_types(raw.dtype, jnp.float32))  # [batch], at least float32
            return jnp.exp(meta["log_temperature"]).astype(raw.dtype) * raw
        nll = model.example_losses(*inputs, batch.get("loss_mask"))  # [batch]
        return -jnp.exp(meta["log_temperature"]).astype(nll.dtype) * nll

    def weights(self, meta: Pytree, batch: dict) -> jax.Array:
        """α(η, x): [batch], positive, mean 1; with a loss mask, 0 for an example without a token to train on and mean
        1 over the others."""
        if self.uniform:
            return jnp.ones(batch["tokens"].shape[:1], self.meta_model.dtype)
        scores = self.scores(meta, batch)
        if batch.get("loss_mask") is None:
            return scores.shape[0] * jax.nn.softmax(scores)
        trained = trained_examples(batch)
        return trained.sum().astype(scores.dtype) * jax.nn.softmax(scores, where=trained)  # 0 outside, NaN-free

    def inner_loss(self, theta, meta, batch):
        losses = self.example_losses(theta, batch)
        return batch_mean(self.weights(meta, batch).astype(losses.dtype) * losses, batch)

    def evaluation(self, run):
        """The weights' held-out metrics: AUC for clean vs corrupted, weight statistics, extremes."""
        from metatrain.tasks.weight_eval import WeightEvaluation

        return WeightEvaluation(self, run)
