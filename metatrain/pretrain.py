"""Plain next-token training (no meta level) on the Trainer's stack: the same model, mesh and FSDP
shardings, data streams, logs, checkpoints and resume. Its work dir seeds meta-training through
`inner.init_from=WORKDIR`.

One step consumes what a meta-training step does: T inner batches (T Adam steps at `inner_lr`, the
inner optimiser) and reports the loss on the outer batch after them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import models
from metatrain.tasks.base import Task
from metatrain.trainer import Trainer, keep_if


class Pretrainer(Trainer):
    kind = "pretrain"

    def _make_task(self, model):
        return Task(model, inner_lr=self.cfg.inner_lr)

    def _init_state(self, key):
        _, params = models.init(self.task.model, key)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt": self.task.inner_opt.init(params)}

    def _start_from(self, path: str):
        raise ValueError("inner.init_from is for meta-training; pretrain continues a run by resuming its work dir")

    def _outer_step(self, state, batches, outer_batch):
        def one(carry, batch):
            params, opt = carry
            loss, grads = jax.value_and_grad(self.task.inner_loss)(params, None, batch)
            params, opt = self.task.update(grads, params, opt, None)
            return (params, opt), (loss, optax.tree.norm(grads))

        (params, opt), (losses, norms) = jax.lax.scan(one, (state["params"], state["opt"]), batches)
        outer = self.task.outer_loss(params, None, outer_batch)
        ok = jnp.isfinite(losses).all() & jnp.isfinite(norms).all() & jnp.isfinite(outer)
        new = {"step": state["step"] + 1, "params": keep_if(ok, params, state["params"]),
               "opt": keep_if(ok, opt, state["opt"])}
        return new, {"outer_loss": outer, "inner_loss": losses.mean(), "grad_norm": norms.mean(), "finite": ok}

    def _theta(self, which: str = "inner"):
        return self.state["params"]
