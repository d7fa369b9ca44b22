"""Learned per-example loss weighting (after Hu et al., 2023).

η are the parameters of a meta model with the inner model's architecture and a scalar head. Its
scores give weights α(η, x) = batch · softmax(scores) (mean 1, so the inner step size is kept), and
the inner loss is mean(α · NTP). The inner state carries over between outer steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import models
from metatrain.tasks.base import Pytree, Task


class LossWeighting(Task):
    name = "loss_weighting"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.meta_graphdef, _ = models.abstract_init(self.meta_model)

    def init_meta(self, key: jax.Array) -> Pytree:
        return models.init(self.meta_model, key)[1]

    def scores(self, meta: Pytree, batch: dict) -> jax.Array:
        """The meta model's score per example: [batch]. Higher means more weight."""
        tokens = batch["tokens"][:, :-1]
        seg = batch.get("segment_ids")
        pos = batch.get("positions")
        return nnx.merge(self.meta_graphdef, meta)(
            tokens, None if seg is None else seg[:, :-1], None if pos is None else pos[:, :-1])

    def weights(self, meta: Pytree, batch: dict) -> jax.Array:
        """α(η, x): [batch], positive, mean 1."""
        scores = self.scores(meta, batch)
        return scores.shape[0] * jax.nn.softmax(scores.astype(models.transformer.compute_dtype(scores.dtype)))

    def inner_loss(self, theta, meta, batch):
        losses = self.example_losses(theta, batch)
        return jnp.mean(self.weights(meta, batch).astype(losses.dtype) * losses)
