"""MAML (Finn et al., 2017): η is the inner model's initialisation, θ0 = η at every outer step."""

from __future__ import annotations

import jax

from metatrain import models
from metatrain.tasks.base import Pytree, Task


class MAML(Task):
    name = "maml"
    resets_inner = True

    def init_meta(self, key: jax.Array) -> Pytree:
        return models.init(self.model, key)[1]

    def init_inner(self, key: jax.Array, meta: Pytree) -> tuple[Pytree, Pytree]:
        return self.inner_start(meta, None)

    def inner_start(self, meta: Pytree, inner) -> tuple[Pytree, Pytree]:
        return meta, self.inner_opt.init(meta)
