"""Plain next-token training (no meta level) on the Trainer's stack: the same model, mesh and FSDP
shardings, data streams, logs, checkpoints and resume. Its work dir seeds meta-training through
`inner.init_from=WORKDIR`.

One step consumes what a meta-training step does: T inner batches (T Adam steps at `inner_lr`, the
inner optimiser) and reports the loss on the outer batch after them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from metatrain import models
from metatrain import step as step_lib
from metatrain.config import Config
from metatrain.errors import ConfigError
from metatrain.tasks.base import Task
from metatrain.trainer import Trainer


def init_state(task: Task, key: jax.Array) -> step_lib.State:
    _, params = models.init(task.model, key)
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt": task.inner_opt.init(params)}


def outer_step(task: Task, state: step_lib.State, batches: dict, outer_batch: dict) -> tuple[step_lib.State, dict]:
    def one(carry, batch):
        params, opt = carry
        loss, grads = jax.value_and_grad(task.inner_loss)(params, None, batch)
        params, opt = task.update(grads, params, opt, None)
        return (params, opt), (loss, optax.tree.norm(grads))

    (params, opt), (losses, norms) = jax.lax.scan(one, (state["params"], state["opt"]), batches)
    outer = task.outer_loss(params, None, outer_batch)
    ok = jnp.isfinite(losses).all() & jnp.isfinite(norms).all() & jnp.isfinite(outer) & step_lib.all_finite(params)
    new = {"step": state["step"] + 1, "params": step_lib.keep_if(ok, params, state["params"]),
           "opt": step_lib.keep_if(ok, opt, state["opt"])}
    return new, {"outer_loss": outer, "inner_loss": losses.mean(), "grad_norm": norms.mean(), "finite": ok}


def pretrain_program(cfg: Config, mesh: jax.sharding.Mesh) -> step_lib.Program:
    task = Task(cfg.model, inner_lr=cfg.inner_lr)
    return step_lib.Program(task=task, init=functools.partial(init_state, task),
                            step=functools.partial(outer_step, task), mesh=mesh, data=cfg.data)


class Pretrainer(Trainer):
    kind = "pretrain"

    def _program(self) -> step_lib.Program:
        if self.cfg.inner.lora.rank or self.cfg.meta_model.given:
            field = "inner.lora.rank" if self.cfg.inner.lora.rank else "meta_model"
            raise ConfigError(f"{field}: pretraining trains the whole model and has no meta model; LoRA and the "
                              "scorer are meta-training settings (metatrain train)")
        if self.cfg.inner.init_from:
            raise ConfigError("inner.init_from is for meta-training; pretrain continues a run by resuming its work "
                              "dir")
        return pretrain_program(self.cfg, self.mesh)

    def _evaluated(self, which: str = "inner", member: int = 0):
        return self.state["params"], None
