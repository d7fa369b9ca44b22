"""MAML (Finn et al., 2017): η is the inner model's initialisation, θ0 = η at every outer step.
Under LoRA η is the adapters' initialisation (the base weights stay frozen)."""

from __future__ import annotations

import jax

from metatrain.tasks.base import Pytree, Task


class MAML(Task):
    name = "maml"
    resets_inner = True

    def init_meta(self, key: jax.Array) -> Pytree:
        return self.init_params(key)

    def init_inner(self, key: jax.Array, meta: Pytree) -> tuple[Pytree, Pytree]:
        return self.inner_start(meta, None)

    def inner_start(self, meta: Pytree, inner) -> tuple[Pytree, Pytree]:
        return meta, self.inner_opt.init(meta)
