"""Tasks the tests run by import path (`task=custom_tasks:Name`, also in subprocesses: helpers.env puts this
folder on PYTHONPATH)."""

import jax
import jax.numpy as jnp
import optax

from metatrain.tasks import LossWeighting, Task


class NaNAfterSix(LossWeighting):
    """Loss weighting whose inner loss turns NaN from outer step 7 on. η gets a `clock` that the outer loss
    pulls up with a gradient so large that, after clipping, it is the same every step: Adam then moves it by
    exactly meta_opt.lr (1e-3) per step, so before step s it reads (s - 1) x 1e-3."""

    def init_meta(self, key):
        return {**super().init_meta(key), "clock": jnp.zeros((), self.model.dtype)}

    def inner_loss(self, theta, meta, batch):
        return super().inner_loss(theta, meta, batch) * jnp.where(meta["clock"] > 5.5e-3, jnp.nan, 1.0)

    def outer_loss(self, theta, meta, batch):
        return super().outer_loss(theta, meta, batch) - 1e6 * meta["clock"]


class OwnModel(Task):
    """A task that brings its own model and an `__init__` that takes no model config (and does not call
    `Task.__init__`): logistic regression of the last token's parity on token-bucket frequencies. η = log of the
    inner loss's L2 coefficient."""

    buckets = 16

    def __init__(self):
        self.opt = optax.adam(0.05, eps_root=1e-8)

    def init_meta(self, key):
        return {"log_decay": jnp.full((), -2.0)}

    def init_inner(self, key, meta):
        theta = {"w": 0.1 * jax.random.normal(key, (self.buckets,)), "b": jnp.zeros(())}
        return theta, self.opt.init(theta)

    def _losses(self, theta, batch):
        tokens = batch["tokens"]
        x = jax.nn.one_hot(tokens[:, :-1] % self.buckets, self.buckets).mean(1)
        return optax.sigmoid_binary_cross_entropy(x @ theta["w"] + theta["b"], (tokens[:, -1] % 2).astype(x.dtype))

    def inner_loss(self, theta, meta, batch):
        return self._losses(theta, batch).mean() + jnp.exp(meta["log_decay"]) * jnp.sum(theta["w"] ** 2)

    def update(self, grads, theta, opt_state, meta):
        updates, opt_state = self.opt.update(grads, opt_state, theta)
        return optax.apply_updates(theta, updates), opt_state

    def outer_loss(self, theta, meta, batch):
        return self._losses(theta, batch).mean()

    def evaluation(self, run):
        """Its own held-out metric, through the Trainer's task-side hook."""
        return DecayMetric()


class DecayMetric:
    def metrics(self, meta, step):
        return {"eval_decay": float(jnp.exp(meta["log_decay"]))}

    def summary(self, meta, last):
        return {"decay": last["eval_decay"]}
