"""A population of inner models (DataRater's stabiliser): one η, N inner states, combined meta-gradients.

Each outer step runs every member's T inner steps on the member's own batches, one member after another
(`lax.scan` over the members, so peak memory is about one member's step plus the N carried states), and
reduces their meta-gradients:

- `reduce=grad`: their mean goes to the one meta-optimizer;
- `reduce=update`: each member's meta-gradient goes through its own meta-optimizer (state stacked over the
  members) and the resulting updates are averaged, as in the DataRater paper.

With `lifetime=L` member i is reinitialised at the start of the outer steps s > 0 with
s ≡ i·L/N (mod L) (`due`): fresh θ (the pretrained weights under `inner.init_from`, else a random init from a key
of the run's seed, the step and the member) and a fresh inner optimizer. A reset is a function of the step, so a
resumed run resets exactly where an uninterrupted one does.

State: `inner` leaves carry a leading member axis [N, ...]; under `reduce=update` so do `meta_opt`'s; with
resets from pretrained weights `reset_to` holds them (rebuilt at start-up, not checkpointed).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from metatrain.config import PopulationConfig
from metatrain.tasks import Task
from metatrain.unroll import MetaGradMethod, meta_value_and_grad, outer_loss

RESET_SALT = 0x5EED  # folded into the run's key: the reset keys differ from every init key


def stacked(trees: list):
    """One pytree whose leaves stack the members' leaves on a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def member(tree, i: int = 0):
    """Member i's part of a stacked pytree: its slice of each array, or of ShapeDtypeStructs and shardings the
    member axis dropped (None stays None)."""
    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=x.sharding and one(x.sharding))
        if isinstance(x, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(x.mesh, jax.sharding.PartitionSpec(*x.spec[1:]),
                                              memory_kind=x.memory_kind)
        return x[i]

    return jax.tree.map(one, tree)


def stacked_batches(steps: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Host batches of N members ([(inner, outer)] from the streams) as one (inner [N, ...], outer [N, ...])."""
    return tuple({k: np.stack([s[j][k] for s in steps]) for k in steps[0][j]} for j in (0, 1))


def offset(i, size: int, lifetime: int):
    """The step of member i's first reset: i·L/N, the staggering (member 0's first reset is at L)."""
    return i * lifetime // size


def due(step, i, size: int, lifetime: int):
    """Whether member i is reinitialised at the start of outer step `step` (Python ints or traced arrays)."""
    o = offset(i, size, lifetime)
    return (step > 0) & (step >= o) & ((step - o) % lifetime == 0)


def resets_at(step: int, pop: PopulationConfig) -> list[int]:
    """The members reinitialised at the start of outer step `step` (0-based; the state's step before it runs)."""
    if pop.lifetime == 0:
        return []
    return [i for i in range(pop.size) if bool(due(step, i, pop.size, pop.lifetime))]


def init_inner(task: Task, key: jax.Array, meta, size: int):
    """N fresh inner states: member 0 from `key` itself (as a one-member run), member i from fold_in(key, i).

    One init, looped over the members' keys (`lax.map`): the program does not grow with N (one init per member
    took the compile of 40 tiny members from 4 to 40 s, and 200 members past 10 minutes, a stop signal unheard).
    """
    keys = jnp.concatenate([key[None], jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(1, size))])
    return jax.lax.map(lambda k: task.init_inner(k, meta), keys)


def stack_optimizer(meta_opt: optax.GradientTransformation, size: int) -> optax.GradientTransformation:
    """`reduce=update`'s meta-optimizer as the state sees it: `init` gives N identical states stacked; its
    update runs member by member inside `step` (with the unstacked `meta_opt`)."""
    def update(*_):
        raise NotImplementedError("per-member meta-optimizer states are updated by population.step")

    return optax.GradientTransformation(lambda params: stacked([meta_opt.init(params)] * size), update)


def reset_key(seed: int, step_no, i):
    """The key of member i's random re-initialisation at outer step `step_no` of a run with this seed."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), RESET_SALT), step_no), i)


def fresh(task: Task, meta, key, reset_to):
    """A fresh inner state: the pretrained θ (`reset_to`) with a fresh inner optimizer, or a random init."""
    if reset_to is not None:
        return task.place_pretrained(reset_to, meta, None)[1]
    return task.init_inner(key, meta)


class Members(NamedTuple):
    """What the members' scan gives: per member [N] (values, inner losses, meta-gradient norms), the new inner
    states and per-member meta-optimizer states (stacked), and the mean meta-gradient and mean update."""

    values: jax.Array
    inner_losses: jax.Array
    grad_norms: jax.Array
    inner: Any
    meta_opt: Any
    grad: Any
    updates: Any


def run_members(task: Task, method: MetaGradMethod, pop: PopulationConfig, seed: int, step_no, meta, inner,
                batches: dict, outer_batch: dict, reset_to=None, meta_opt: optax.GradientTransformation | None = None,
                opt_states=None) -> Members:
    """Every member's inner loop and meta-gradient, one after another (`lax.scan`), the sum carried.

    Args:
      task: the task (bound to the frozen base under LoRA).
      method: how each member's meta-gradient is computed.
      pop: the population config (size, lifetime; with `axis` every member at once, `jax.vmap` over the members
        sharded over the population mesh axis, instead of one after another).
      seed: the run's seed (the reset keys derive from it).
      step_no: the outer step (the state's `step`): which members are reset first.
      meta: η.
      inner: the members' inner states, stacked (None for tasks that restart from η).
      batches: inner batches [N, T, batch, seq+1]; outer_batch: [N, batch, seq+1].
      reset_to: θ to reset members to (pretrained), or None for a random init.
      meta_opt, opt_states: with per-member meta-optimizers (`reduce=update`): the one-member optimizer and the
        stacked states; each member's update is taken and averaged.

    Returns:
      `Members`.
    """
    n = pop.size
    value_and_grad = meta_value_and_grad(task, method)
    per_member_opt = opt_states is not None

    def one(carry, xs):
        grad_sum, update_sum = carry
        i, inner, b, ob, opt = xs
        if pop.lifetime and not task.resets_inner:
            key = reset_key(seed, step_no, i)
            inner = jax.lax.cond(due(step_no, i, n, pop.lifetime), lambda: fresh(task, meta, key, reset_to),
                                 lambda: inner)
        (value, aux), grad = value_and_grad(meta, inner, b, ob)
        grad_sum = jax.tree.map(jnp.add, grad_sum, grad)
        new_opt = None
        if per_member_opt:
            updates, new_opt = meta_opt.update(grad, opt, meta)
            update_sum = jax.tree.map(jnp.add, update_sum, updates)
        out = (value, aux.inner_losses.mean(), optax.tree.norm(grad), None if task.resets_inner else aux.inner,
               new_opt)
        return (grad_sum, update_sum), out

    zeros = jax.tree.map(jnp.zeros_like, meta)
    xs = (jnp.arange(n), inner, batches, outer_batch, opt_states)
    mean = lambda tree: None if tree is None else jax.tree.map(lambda x: x / n, tree)
    if pop.axis:  # every member at once (over the population mesh axis); the sums over it are all-reduces
        zero_carry = (zeros, zeros if per_member_opt else None)
        # spmd_axis_name: the activations' sharding constraints inside keep the members over that axis
        (grads, updates), (values, inner_losses, norms, inners, opts) = jax.vmap(
            lambda x: one(zero_carry, x), spmd_axis_name="population")(xs)
        total = lambda tree: None if tree is None else jax.tree.map(lambda x: x.sum(0), tree)
        return Members(values, inner_losses, norms, inners, opts, mean(total(grads)), mean(total(updates)))
    (grad_sum, update_sum), (values, inner_losses, norms, inners, opts) = jax.lax.scan(
        one, (zeros, zeros if per_member_opt else None), xs)
    return Members(values, inner_losses, norms, inners, opts, mean(grad_sum), mean(update_sum))


def step(task: Task, method: MetaGradMethod, meta_opt: optax.GradientTransformation, pop: PopulationConfig,
         seed: int, state: dict, batches: dict, outer_batch: dict, keep_if, all_finite) -> tuple[dict, dict]:
    """The population's outer step: `step.outer_step` with N members (batches [N, T, batch, seq+1], outer
    [N, batch, seq+1]). Metrics: the members' means, plus `outer_loss/member_i` and `outer_loss_spread` (max − min).
    """
    task = task.with_frozen(state.get("frozen"))
    meta = state["meta"]
    per_member_opt = pop.reduce == "update"
    m = run_members(task, method, pop, seed, state["step"], meta, state["inner"], batches, outer_batch,
                    state.get("reset_to"), meta_opt, state["meta_opt"] if per_member_opt else None)
    grad_norm = optax.tree.norm(m.grad)
    if per_member_opt:
        updates, new_opt = m.updates, m.meta_opt
    else:
        updates, new_opt = meta_opt.update(m.grad, state["meta_opt"], meta)
    new_meta = optax.apply_updates(meta, updates)
    ok = (jnp.all(jnp.isfinite(m.values)) & jnp.all(jnp.isfinite(m.grad_norms)) & jnp.isfinite(grad_norm)
          & all_finite(new_meta) & all_finite(new_opt))
    new = {"step": state["step"] + 1, "meta": keep_if(ok, new_meta, meta),
           "meta_opt": keep_if(ok, new_opt, state["meta_opt"]),
           "inner": None if task.resets_inner else keep_if(ok, m.inner, state["inner"])}
    new.update({k: state[k] for k in ("frozen", "reset_to") if k in state})
    metrics = {"outer_loss": m.values.mean(), "inner_loss": m.inner_losses.mean(), "meta_grad_norm": grad_norm,
               "finite": ok, "outer_loss_spread": m.values.max() - m.values.min()}
    metrics.update({f"outer_loss/member_{i}": m.values[i] for i in range(pop.size)})
    if "base" in state:  # one model, on member 0's batches
        base = state["base"]
        base_value, base_aux = outer_loss(task.baseline_task(), method)(base["meta"], base["inner"],
                                                                        member(batches, 0), member(outer_batch, 0))
        new["base"] = {"meta": base["meta"], "inner": base_aux.inner}
        metrics.update(baseline_outer_loss=base_value, baseline_inner_loss=base_aux.inner_losses.mean())
    return new, metrics


def member_shardings(shardings):
    """Shardings of stacked leaves: each member's sharding with the member axis in front, over the mesh's
    `population` axis where it has one (`population.axis=true`), else unsplit."""
    def stacked_(s):
        axis = "population" if "population" in s.mesh.axis_names else None
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(axis, *s.spec), memory_kind=s.memory_kind)

    return jax.tree.map(stacked_, shardings)
