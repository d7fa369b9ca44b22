"""The inner loop and the outer loss (Algorithm 2), differentiable with respect to η.

T inner steps run in a `lax.scan` (the first one before it, see `peeled`). Each step is checkpointed
(`jax.checkpoint`): its activations are recomputed in the backward pass, so the outer backward pass holds
only the per-step inner state (θ_i, υ_i), plus, with `save_inner_grads`, the inner gradients ∇L_i (named
`inner_grads` and kept by the checkpoint policy), which saves one inner backward pass per step at meta-gradient time.
With `state_dtype` (e.g. bfloat16) those per-step states and gradients are stored in that dtype
instead, and with `offload_states` in host memory (`stored_step`): the inner loop itself, the
backward pass and the meta-gradient stay in the compute dtype and on the device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from metatrain import mixflow, two_steps
from metatrain import plan as plan_lib
from metatrain.errors import ConfigError, renamed
from metatrain.tasks import Task

INNER_GRADS = "inner_grads"
KEPT_STATES = ("every_step", "sqrt", "binomial")


@dataclasses.dataclass(frozen=True)
class MetaGradMethod:
    """How the meta-gradient is computed (the run config's `metagrad.*`; block remat is `model.remat`).

    `plan.choose` turns a method, T and the model's options into the program that runs.

    Args:
      mode: `mixflow` (forward-over-reverse), `autodiff` (reverse-over-reverse) or `revfwd`.
      save_inner_grads: keep each inner gradient for the backward pass instead of recomputing it.
      kept_states: which inner states the forward pass keeps for the backward pass: `every_step` all T; `sqrt`
        the starts of ⌈T/k⌉ segments of k = ⌈√T⌉ steps, each segment re-run in the backward pass (T extra inner
        steps); `binomial` recursive halving down to parts of two steps, each level re-run (about T·(log2(T) - 1)
        extra inner steps), keeping O(log T) states at any time.
      state_dtype: the dtype the kept states (θ_i, υ_i) and saved gradients are stored in ("": as computed).
      offload_states: keep them in host memory (pinned_host) until the backward pass needs them (`stored_step`).
      unroll: trace the inner steps one after the other instead of as a loop (`unrolled`).
    """

    mode: str = "mixflow"
    save_inner_grads: bool = True
    kept_states: str = "every_step"
    state_dtype: str = ""
    offload_states: bool = False
    unroll: bool = False

    @property
    def peel(self) -> bool:
        """Whether every_step takes the first inner step before the loop (`peeled`): not with `offload_states`,
        whose host-memory checkpoints are brought back one loop step at a time (without a loop left, at T=2, the
        compiler brings them back early and the peak grows)."""
        return not self.offload_states

    def __post_init__(self):
        object.__setattr__(self, "mode", mixflow.mode_name(self.mode, "MetaGradMethod(mode='{}')", stacklevel=5))
        if self.mode not in mixflow.MODES:
            raise ConfigError(f"metagrad.mode: unknown meta-gradient mode {self.mode!r}; choose one of {mixflow.MODES}")
        if self.kept_states not in KEPT_STATES:
            raise ConfigError(f"metagrad.kept_states: unknown schedule {self.kept_states!r}; "
                              f"choose one of {KEPT_STATES}")
        if self.state_dtype and not _float_dtype(self.state_dtype):
            raise ConfigError(f"metagrad.state_dtype: {self.state_dtype!r} is not a floating-point dtype; use "
                              "bfloat16, or leave it empty to store the kept inner states as computed")
        if self.state_dtype and jnp.finfo(self.state_dtype).bits < 32 and not self.save_inner_grads:
            raise ConfigError(NARROW_NEEDS_SAVE)


# MetaGradMethod's arguments by their names before a rename: still taken (and read), with a RenamedWarning
RENAMED_FIELDS = {"inner_checkpoint": "kept_states", "checkpoint_dtype": "state_dtype",
                  "checkpoint_offload": "offload_states"}
_init = MetaGradMethod.__init__


@functools.wraps(_init)
def _init_renamed(self, *args, **kwargs):
    for old, new in RENAMED_FIELDS.items():
        if old in kwargs:
            if new in kwargs:
                raise TypeError(f"MetaGradMethod: give {new} only ({old} is its old name)")
            renamed(f"MetaGradMethod({old}=...)", f"MetaGradMethod({new}=...)")
            kwargs[new] = kwargs.pop(old)
    _init(self, *args, **kwargs)


MetaGradMethod.__init__ = _init_renamed


def _old_field(old: str, new: str) -> property:
    def get(self):
        renamed(f"MetaGradMethod.{old}", f"MetaGradMethod.{new}")
        return getattr(self, new)
    return property(get, doc=f"The old name of `{new}`.")


for _old, _new in RENAMED_FIELDS.items():
    setattr(MetaGradMethod, _old, _old_field(_old, _new))


# An inner gradient recomputed from rounded parameters is not the one the inner update used, and the inner Adam
# update's derivative is steep where a gradient is near zero: the meta-gradient came out wrong by its own size.
NARROW_NEEDS_SAVE = ("metagrad.state_dtype: inner states kept narrower than float32 need "
                     "metagrad.save_inner_grads=true (the inner gradients kept as the inner update used them; "
                     "recomputed from rounded parameters they make the meta-gradient wrong); set "
                     "metagrad.save_inner_grads=true or leave metagrad.state_dtype empty")


def _float_dtype(name: str) -> bool:
    try:
        return jnp.issubdtype(jnp.dtype(name), jnp.floating)
    except TypeError:
        return False


@dataclasses.dataclass
class OuterAux:
    inner: tuple[Any, Any]  # (θ_T, υ_T): the next outer step's start when the task carries state
    inner_losses: jax.Array  # [T]


jax.tree_util.register_dataclass(OuterAux, data_fields=["inner", "inner_losses"], meta_fields=[])


def outer_loss(task: Task, method: MetaGradMethod) -> Callable:
    """`f(meta, inner, batches, outer_batch) -> (V, OuterAux)`; batches have a leading [T] axis. The program is the
    one `plan.choose` names for the method, T and the task's model."""
    # the LoRA base weights (None without LoRA) go in as an argument that gets no cotangent
    inner_loss = lambda theta, meta, batch, frozen: task.with_frozen(frozen).inner_loss(theta, meta, batch)

    def f(meta, inner, batches, outer_batch):
        chosen = plan_lib.choose(method, jax.tree.leaves(batches)[0].shape[0], task.model)
        start = task.inner_start(meta, inner)
        if chosen.step == "two_steps":
            value, inner_losses, final = two_steps.run(task, inner_loss, chosen.seeded)(start, batches, meta,
                                                                                        task.frozen, outer_batch)
            return value, OuterAux(final, inner_losses)
        step = (stored_step if chosen.step == "stored" else checkpointed_step)(task, method, inner_loss)
        final, inner_losses = unrolled(lambda c, b: step(c, b, meta, task.frozen), start, batches, chosen.loop,
                                       method.unroll)
        return task.outer_loss(final[0], meta, outer_batch), OuterAux(final, inner_losses)

    return f


def checkpointed_step(task: Task, method: MetaGradMethod, inner_loss: Callable) -> Callable:
    """One inner step `(carry, batch, meta, frozen) -> (carry', loss)`, `carry = (θ_i, υ_i)`, its inner gradient in
    the method's mode, checkpointed: the backward pass keeps its inputs (and the gradient, named, with
    `save_inner_grads`) and recomputes the rest."""
    inner_value_and_grad = mixflow.value_and_grad(inner_loss, method.mode, frozen_argnums=(2,))

    def step(carry, batch, meta, frozen):
        theta, opt_state = carry
        loss, grads = inner_value_and_grad(theta, meta, batch, frozen)
        if method.save_inner_grads:
            grads = jax.tree.map(lambda g: checkpoint_name(g, INNER_GRADS), grads)
        return task.update(grads, theta, opt_state, meta), loss

    policy = (jax.checkpoint_policies.save_only_these_names(INNER_GRADS) if method.save_inner_grads
              else jax.checkpoint_policies.nothing_saveable)
    return jax.checkpoint(step, policy=policy)


def stored_step(task: Task, method: MetaGradMethod, inner_loss: Callable) -> Callable:
    """One inner step `(carry, batch, meta, frozen) -> (carry', loss)`, `carry = (θ_i, υ_i)`, whose backward pass
    keeps only (θ_i, υ_i) and, with `save_inner_grads`, ∇L_i, stored in `method.state_dtype` (if given) and in
    host memory (with `method.offload_states`; XLA moves them out in the forward pass and back in the backward).

    Its custom VJP recomputes nothing forward: the cotangent of (θ_i+1, υ_i+1) goes through the VJP of the
    inner update at the stored (∇L_i, θ_i, υ_i), then the cotangent it gives ∇L_i through `mixflow.backward` (the
    mode's Hessian- and mixed-vector products; θ_i's own cotangent goes in with it, so that under `mixflow` the block
    stack's HVP is accumulated into it in place: `models.grad_seed`), so a saved gradient is used as such. Every
    `mixflow` run uses this step (also without the storage options). Everything is computed in
    the carry's dtype, from the stored values cast back up."""
    plain = jax.value_and_grad(inner_loss)
    vjp = mixflow.backward(inner_loss, method.mode, frozen_argnums=(2,))
    offload = lambda x: method.offload_states and offloadable(x)

    def store(tree):
        def one(x):
            x = x.astype(method.state_dtype) if method.state_dtype and mixflow._is_float(x) else x
            return jax.device_put(x, jax.memory.Space.Host) if offload(x) else x

        return jax.tree.map(one, tree)

    def load(tree, like):  # the cotangents have the primals' dtypes: the stored values go back to those
        def one(x, c):
            x = jax.device_put(x, jax.memory.Space.Device) if offload(x) else x
            return x.astype(c.dtype) if mixflow._is_float(x) else x

        return jax.tree.map(one, tree, like)

    def run(carry, batch, meta, frozen):
        theta, opt_state = carry
        loss, grads = plain(theta, meta, batch, frozen)
        return task.update(grads, theta, opt_state, meta), loss, grads

    @jax.custom_vjp
    def step(carry, batch, meta, frozen):
        new, loss, _ = run(carry, batch, meta, frozen)
        return new, loss

    def fwd(carry, batch, meta, frozen):  # with symbolic_zeros, primals come wrapped (.value)
        carry, batch, meta, frozen = mixflow.unwrap((carry, batch, meta, frozen))
        new, loss, grads = run(carry, batch, meta, frozen)
        return (new, loss), (store(carry), store(grads) if method.save_inner_grads else None, batch, meta, frozen)

    def bwd(residuals, cotangent):
        carry, grads, batch, meta, frozen = residuals
        ct_new, ct_loss = cotangent
        ct_new = jax.tree.map(mixflow.instantiate, ct_new, is_leaf=lambda c: isinstance(c, SymbolicZero))
        ct_loss = None if isinstance(ct_loss, SymbolicZero) else ct_loss
        theta, opt_state = load(carry, ct_new)
        # the barrier stops XLA merging what the backward pass computes from θ_i with the forward pass's (kept alive
        # from one to the other then): the recomputed gradient, and the compute-dtype copies of θ_i's stacked
        # weights that XLA makes once per value and shares among the loops over layers
        theta = jax.lax.optimization_barrier(theta)
        if grads is None:  # recomputed
            grads = plain(theta, meta, batch, frozen)[1]
        else:
            grads = load(grads, ct_new[0])
        _, pullback = jax.vjp(task.update, grads, theta, opt_state, meta)
        ct_grads, ct_theta, ct_opt, ct_meta = pullback(ct_new)
        # ct_theta goes in, not added after: under mixflow a block stack accumulates H v into it in place
        d_theta, d_meta, d_batch, d_frozen = vjp(theta, (meta, batch, frozen), ct_loss, ct_grads, ct_theta)
        add = lambda d, c: jax.tree.map(lambda x, y: y if x is None else x + y, d, c, is_leaf=lambda x: x is None)
        return (d_theta, ct_opt), d_batch, add(d_meta, ct_meta), d_frozen

    step.defvjp(fwd, bwd, symbolic_zeros=True)
    return step


def offloadable(x) -> bool:
    """Whether `offload_states` moves a checkpoint leaf to the host: matrices and up. Scalars (Adam's count)
    and vectors (norm scales, biases) stay: the TPU compiler cannot stack a scalar, nor a bfloat16 vector, one
    step at a time in host memory."""
    return x.ndim >= 2


def segments(n_steps: int, schedule: str) -> list[int]:
    """Lengths of the segments whose start states the forward pass keeps (every_step: all steps are kept)."""
    if schedule == "every_step" or n_steps <= 2:
        return [1] * n_steps
    if schedule == "sqrt":
        k = math.ceil(math.sqrt(n_steps))
        return [k] * (n_steps // k) + ([n_steps % k] if n_steps % k else [])
    return [n_steps // 2, n_steps - n_steps // 2]  # binomial: the top halves


def kept_states(n_steps: int, schedule: str, peel: bool = True) -> int:
    """How many inner states (θ_i, υ_i) the forward pass stores for the backward pass: every_step all, but the first
    when it is `peeled` (the outer step's own inputs), else one per segment start."""
    kept = segments(n_steps, schedule)
    return n_steps - 1 if len(kept) == n_steps and peel and n_steps >= 2 else len(kept)


def straight_line(n_steps: int, unroll: bool, peel: bool = True) -> bool:
    """Whether no loop over inner steps is left (unrolled; one step; or two, the first `peeled` and a loop of one
    inlined): then each step's checkpoint is freed once its backward pass has used it, not kept to the end."""
    return unroll or n_steps <= (2 if peel else 1)


def unrolled(step: Callable, carry, batches, loop: str = "peeled", unroll: bool = False):
    """`lax.scan(step, carry, batches)` laid out as `loop` (a `plan.LOOPS` name; `plan.choose` picks it).

    `peeled` takes the first step before the loop; `unrolled` traces the steps one after the other, not as a loop
    (`unroll`: the same within each `sqrt` / `binomial` segment). The same arithmetic; what changes is memory: a loop
    keeps its kept inner states in [T, ...] stacks that live until the loop's backward pass ends, and XLA copies
    each step's slice out of them; unrolled, each step's checkpoint is its own buffer, freed as soon as that step's
    backward pass has used it. The program grows with T (compile time too)."""
    n = jax.tree.leaves(batches)[0].shape[0]
    scan = lambda f, c, b: jax.lax.scan(f, c, b, unroll=unroll or loop == "unrolled")
    if loop == "peeled":
        return peeled(step, carry, batches, scan)
    if loop in ("scan", "unrolled"):
        return scan(step, carry, batches)
    if loop == "sqrt":
        segment = jax.checkpoint(lambda c, b: scan(step, c, b),
                                 policy=jax.checkpoint_policies.nothing_saveable)
        k = segments(n, loop)[0]
        full = n // k  # segments of k steps, scanned; then the remainder as one more segment
        split = jax.tree.map(lambda x: x[:full * k].reshape((full, k) + x.shape[1:]), batches)
        carry, losses = jax.lax.scan(segment, carry, split)
        losses = losses.reshape((full * k,) + losses.shape[2:])
        if n % k:
            carry, rest = segment(carry, jax.tree.map(lambda x: x[full * k:], batches))
            losses = jnp.concatenate([losses, rest])
        return carry, losses

    def halves(c, b):  # binomial: each half checkpointed, recursively, down to parts of <= 2 steps
        m = jax.tree.leaves(b)[0].shape[0]
        if m <= 2:
            return scan(step, c, b)
        part = lambda lo, hi: jax.tree.map(lambda x: x[lo:hi], b)
        c, first = checkpointed(c, part(0, m // 2))
        c, second = checkpointed(c, part(m // 2, m))
        return c, jnp.concatenate([first, second])

    checkpointed = jax.checkpoint(halves, policy=jax.checkpoint_policies.nothing_saveable)
    return halves(carry, batches)


def peeled(step: Callable, carry, batches, scan: Callable = jax.lax.scan):
    """`scan(step, carry, batches)` with the first step taken before the loop. The loop keeps each step's
    checkpoint in [n, ...] stacks that live until its backward pass ends; the first step's inputs are the outer
    step's own (θ_0 from η or the carried state, υ_0 fresh), so outside the loop they are kept as they are instead
    of copied into the stacks. With two steps no loop is left (XLA inlines a loop of one step): each checkpoint is
    freed once its step's backward pass has used it, as with `unroll`."""
    carry, first = step(carry, jax.tree.map(lambda x: x[0], batches))
    carry, rest = scan(step, carry, jax.tree.map(lambda x: x[1:], batches))
    return carry, jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)


def meta_value_and_grad(task: Task, method: MetaGradMethod) -> Callable:
    """`g(meta, inner, batches, outer_batch) -> ((V, OuterAux), dV/dmeta)`."""
    return jax.value_and_grad(outer_loss(task, method), has_aux=True)
