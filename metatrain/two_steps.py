"""Two inner steps and the outer loss with one hand-written backward pass (T=2, `mixflow`, saved inner gradients;
`plan.choose` says when).

Through autodiff each inner step's backward pass (`unroll.stored_step`) sees only its own cotangents. In the last
step's, the outer loss's gradient θ̄_2 must then outlive the Hessian-vector product: the inner Adam moments'
cotangents, which the first step's backward pass needs, are formed from it afterwards. So the HVP cannot accumulate
into θ̄_2's buffer in place (`models.grad_seed`): the accumulator is a copy, one float32 parameter-sized buffer at
the backward pass's peak. Here one custom VJP covers both steps and the outer loss, and the moments' cotangents are
formed after the last step's HVP from θ̄_2 *recomputed* (one more forward and backward pass of the outer loss), so
θ̄_2 dies into the accumulator. Without the in-place accumulation (a plan that is not `seeded`: no block remat)
there is nothing to gain by it, and θ̄_2 is kept instead.

The forward pass keeps the inputs (θ_0, υ_0), ∇L_0 and ∇L_1, and the outer loss's own residuals; θ_1 and υ_1 are
re-formed from them by the first step's update (an elementwise pass) wherever the backward pass needs them, rather
than kept. Only the arithmetic's order differs from autodiff's; check-grads compares the two.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from metatrain import mixflow
from metatrain.tasks import Task


def run(task: Task, inner_loss: Callable, seeded: bool = True) -> Callable:
    """`f(carry, batches, meta, frozen, outer_batch) -> (V, inner_losses [2], (θ_2, υ_2))`, carry = (θ_0, υ_0),
    batches with a leading [2] axis; `frozen` the LoRA base weights (None without LoRA; no cotangent), passed to
    `inner_loss(theta, meta, batch, frozen)` as in `unroll.stored_step`. `seeded`: the plan's (`plan.Plan`); only
    then is θ̄_2 recomputed after the last step's HVP."""
    outer = lambda theta, meta, batch, frozen: task.with_frozen(frozen).outer_loss(theta, meta, batch)
    plain = jax.value_and_grad(inner_loss)
    hvp = mixflow.backward(inner_loss, "mixflow", frozen_argnums=(2,))
    part = lambda batches, i: jax.tree.map(lambda x: x[i], batches)

    def inner(carry, batches, meta, frozen):
        (theta0, opt0), b0, b1 = carry, part(batches, 0), part(batches, 1)
        l0, g0 = plain(theta0, meta, b0, frozen)
        theta1, opt1 = task.update(g0, theta0, opt0, meta)
        l1, g1 = plain(theta1, meta, b1, frozen)
        return task.update(g1, theta1, opt1, meta), jnp.stack([l0, l1]), (g0, g1)

    @jax.custom_vjp
    def f(carry, batches, meta, frozen, outer_batch):
        final, losses, _ = inner(carry, batches, meta, frozen)
        return outer(final[0], meta, outer_batch, frozen), losses, final

    def fwd(carry, batches, meta, frozen, outer_batch):
        carry, batches, meta, frozen, outer_batch = mixflow.unwrap((carry, batches, meta, frozen, outer_batch))
        final, losses, kept = inner(carry, batches, meta, frozen)
        value, outer_vjp = jax.vjp(lambda th, m: outer(th, m, outer_batch, frozen), final[0], meta)
        return (value, losses, final), (carry, kept, outer_vjp, batches, meta, frozen, outer_batch)

    def bwd(residuals, cotangent):
        (theta0, opt0), (g0, g1), outer_vjp, batches, meta, frozen, outer_batch = residuals
        ct_value, ct_losses, (ct_theta2, ct_opt2) = cotangent
        ct_l = (None, None) if _zero(ct_losses) else (ct_losses[0], ct_losses[1])
        ct_value = jnp.zeros((), jnp.float32) if _zero(ct_value) else ct_value
        ct_opt2 = jax.tree.map(mixflow.instantiate, ct_opt2, is_leaf=_zero)
        plus_ct_theta2 = lambda bar: jax.tree.map(lambda d, c: d if _zero(c) else d + c, bar, ct_theta2,
                                                  is_leaf=_zero)
        # (θ_1, υ_1) is re-formed from (∇L_0, θ_0, υ_0) each time it is needed: an elementwise pass, where keeping
        # it would hold two more parameter-sized buffers from the forward pass to the first step's backward pass
        step1_inputs = lambda: task.update(g0, theta0, opt0, meta)
        b0, b1 = part(batches, 0), part(batches, 1)

        # the last step: ∇L_1's cotangent from θ̄_2, then the HVP accumulated into θ̄_2 itself
        bar2, d_meta_outer = outer_vjp(ct_value)
        bar2 = plus_ct_theta2(bar2)
        theta1, opt1 = step1_inputs()
        ct_g1, ct_theta1, _, ct_meta1 = jax.vjp(task.update, g1, theta1, opt1, meta)[1]((bar2, ct_opt2))
        d_theta1, d_meta1, d_b1, _ = hvp(theta1, (meta, b1, frozen), ct_l[1], ct_g1, ct_theta1)

        # the moments' cotangents, from θ̄_2: seeded, recomputed after the HVP (the barrier ties the recomputation's
        # inputs to the HVP's result, so it runs after it and XLA cannot merge it with the first outer pass); else
        # the one formed above, kept
        if seeded:
            theta0, g0, g1, d_theta1 = jax.lax.optimization_barrier((theta0, g0, g1, d_theta1))
            theta1, opt1 = step1_inputs()
            theta2 = task.update(g1, theta1, opt1, meta)[0]
            bar2 = plus_ct_theta2(jax.vjp(lambda th: outer(th, meta, outer_batch, frozen), theta2)[1](ct_value)[0])
        ct_opt1 = jax.vjp(task.update, g1, theta1, opt1, meta)[1]((bar2, ct_opt2))[2]

        # the first step, as `stored_step`'s backward pass (the barrier as there: the HVP's compute-dtype copies of
        # θ_0 are its own, not the forward pass's kept alive)
        ct_g0, ct_theta0, ct_opt0, ct_meta0 = jax.vjp(task.update, g0, theta0, opt0, meta)[1]((d_theta1, ct_opt1))
        d_theta0, d_meta0, d_b0, _ = hvp(jax.lax.optimization_barrier(theta0), (meta, b0, frozen), ct_l[0], ct_g0,
                                         ct_theta0)
        d_meta = jax.tree.map(lambda *ds: sum(d for d in ds if d is not None), d_meta_outer, ct_meta1, d_meta1,
                              ct_meta0, d_meta0, is_leaf=lambda x: x is None)
        d_batches = jax.tree.map(lambda a, b, x: None if a is None and b is None else jnp.stack(
            [jnp.zeros_like(x[0]) if a is None else a, jnp.zeros_like(x[1]) if b is None else b]),
            d_b0, d_b1, batches, is_leaf=lambda x: x is None)
        return (d_theta0, ct_opt0), d_batches, d_meta, None, None

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f


def _zero(c) -> bool:
    return isinstance(c, SymbolicZero)
