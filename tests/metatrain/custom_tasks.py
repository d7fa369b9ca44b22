"""Tasks the tests run by import path (`task=custom_tasks:Name`, also in subprocesses: helpers.env puts this
folder on PYTHONPATH)."""

import jax.numpy as jnp

from metatrain.tasks import LossWeighting


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
