"""Which program computes the meta-gradient: the one place that decides, from the method, T and the model's options.

A plan has three parts, named `step+loop[+seeded]` (e.g. `two_steps+peeled+seeded`):

- `step`, how one inner step is differentiated:
  - `two_steps`: both inner steps and the outer loss under one custom VJP (`two_steps.run`);
  - `stored`: each inner step's custom VJP, from the state it stored (`unroll.stored_step`);
  - `checkpointed`: `jax.checkpoint` of an autodiffed step (`unroll.checkpointed_step`).
- `loop`, how the T inner steps are laid out (`unroll.unrolled`):
  - `peeled`: the first step before a `lax.scan` of the rest;
  - `scan`: one `lax.scan` over all steps;
  - `unrolled`: the steps traced one after the other;
  - `sqrt` / `binomial`: checkpointed segments, re-run in the backward pass.
- `seeded`: the block stack's Hessian-vector product is accumulated in place into the incoming cotangent
  (`models.grad_seed`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from metatrain.models import ModelConfig, grad_seed

if TYPE_CHECKING:
    from metatrain.unroll import MetaGradMethod

STEPS = ("two_steps", "stored", "checkpointed")
LOOPS = ("peeled", "scan", "unrolled", "sqrt", "binomial")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The inner-loop program one run's outer step computes its meta-gradient with (see the module docstring)."""

    step: str
    loop: str
    seeded: bool

    @property
    def name(self) -> str:
        return "+".join([self.step, self.loop] + (["seeded"] if self.seeded else []))


def choose(method: MetaGradMethod, n_steps: int, model: ModelConfig | None = None) -> Plan:
    """The plan for a meta-gradient method, T inner steps and the inner model's config.

    Args:
      method: a `unroll.MetaGradMethod`.
      n_steps: T, the number of inner steps.
      model: the inner model's `ModelConfig` (its `remat` and `remat_policy`); None for a task with a model of its own.

    Returns:
      A `Plan`.
    """
    if method.kept_states == "every_step" or n_steps <= 2:
        if method.unroll:
            loop = "unrolled"
        else:
            loop = "peeled" if method.peel and n_steps >= 2 else "scan"
    else:
        loop = method.kept_states
    if (n_steps == 2 and loop == "peeled" and method.mode == "mixflow" and method.save_inner_grads
            and not method.state_dtype):
        step = "two_steps"
    elif method.mode == "mixflow" or method.state_dtype or method.offload_states:
        step = "stored"  # its custom VJP hands θ's cotangent to the HVP, and stores the state as asked
    else:
        step = "checkpointed"
    seeded = method.mode == "mixflow" and model is not None and grad_seed.seedable(model)
    return Plan(step, loop, seeded)
