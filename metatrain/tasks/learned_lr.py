"""Learned per-parameter learning rates (Bengio 2000; Maclaurin et al. 2015).

η holds one log-scale per parameter: the inner Adam step of each parameter is multiplied by
exp(η), so η = 0 is plain Adam at `inner_lr`. Under LoRA the rates are the adapters'. The inner state
carries over between outer steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from metatrain.tasks.base import Pytree, Task


class LearnedLR(Task):
    name = "learned_lr"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inner_opt = optax.scale_by_adam(eps_root=1e-8)  # direction only; the step size is η's

    def init_meta(self, key: jax.Array) -> Pytree:
        return jax.tree.map(jnp.zeros_like, self.init_params(key))

    def update(self, grads, theta, opt_state, meta):
        direction, opt_state = self.inner_opt.update(grads, opt_state, theta)
        theta = jax.tree.map(lambda p, d, s: p - self.inner_lr * jnp.exp(s) * d, theta, direction, meta)
        return theta, opt_state
