"""Gradients of a block stack accumulated in place into a given buffer ("seeded"), layer by layer.

MixFlow's backward pass of one inner step computes  θ̄ + H ḡ : the cotangent θ̄ coming from later steps plus the
Hessian-vector product, a JVP of the inner gradient. Autodiff writes the stacked blocks' part of H ḡ into a new
[layers, ...] buffer per weight and adds θ̄ afterwards, so both are live at once: one parameter-sized buffer more
than the result needs. Here the inner gradient of the block stack is computed by a hand-written backward scan whose
per-layer weight gradients are added into an accumulator carried through the loop. Started from a seed `s`, the
gradient comes out as  s + ∇ ; differentiated forward (a JVP with primal s = 0 and tangent θ̄) its tangent is
θ̄ + H ḡ, updated in place slice by slice in θ̄'s own buffer.

`seeding(params, seeds)` makes a block stack traced inside it, whose weights are leaves of `params` (the very
traced arrays), start its gradient from the matching leaves of `seeds`; `lookup` is how the model asks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from metatrain.models import dense

_TABLE: contextvars.ContextVar = contextvars.ContextVar("gradient_seeds", default=None)


@contextlib.contextmanager
def seeding(params, seeds, used: set | None = None):
    """Within: a block stack over leaves of `params` accumulates their gradient into the matching leaves of
    `seeds` (same tree structure). `used` collects the positions (in `params`' leaves) of those seeded so: the
    caller adds the other seeds itself."""
    table = {id(p): (s, i) for i, (p, s) in enumerate(zip(jax.tree.leaves(params), jax.tree.leaves(seeds)))}
    token = _TABLE.set((table, used if used is not None else set()))
    try:
        yield
    finally:
        _TABLE.reset(token)


def seedable(model) -> bool:
    """Whether a block stack of this `ModelConfig` takes gradient seeds: per-block remat with the default policy
    (the hand-written backward scan rematerialises each block itself)."""
    return bool(getattr(model, "remat", False)) and getattr(model, "remat_policy", None) == "nothing_saveable"


def lookup(stacked) -> list | None:
    """The seed of each leaf of a block stack's state (None where it has none), or None when no leaf has one."""
    current = _TABLE.get()
    if current is None:
        return None
    table, used = current
    found = [table.get(id(x)) for x in jax.tree.leaves(stacked)]
    if all(f is None for f in found):
        return None
    used.update(f[1] for f in found if f is not None)
    return [None if f is None else f[0] for f in found]


def scan(apply: Callable, x, stacked, seeds: list, extras=()):
    """`lax.scan` of `apply(layer_state, x, *extras) -> x` over the stacked layers, rematerialised per block, whose
    gradient for `stacked` is accumulated into `seeds` (a list over its leaves; None: from zero). `extras` (token
    positions, segment ids) get no cotangent. x: [batch, seq, d_model]."""
    leaves, treedef = jax.tree.flatten(stacked)
    return _seeded(apply, treedef, x, leaves, [jnp.zeros_like(w) if s is None else s for w, s in zip(leaves, seeds)],
                   tuple(extras))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _seeded(apply, treedef, x, leaves, seeds, extras):
    return _forward(apply, treedef, x, leaves, extras)[0]


def _forward(apply, treedef, x, leaves, extras):
    def body(h, layer):
        return apply(jax.tree.unflatten(treedef, layer), h, *extras), h

    # forward only, and under MixFlow's JVP differentiated forward (as this custom VJP's fwd): plain products, as
    # forward mode needs (models.dense); the gradient is _bwd's
    with dense.plain():
        return jax.lax.scan(body, x, leaves)  # (output, each layer's input [layers, batch, seq, d_model])


def _fwd(apply, treedef, x, leaves, seeds, extras):
    y, inputs = _forward(apply, treedef, x, leaves, extras)
    return y, (inputs, leaves, seeds, extras)


def _bwd(apply, treedef, residuals, dy):
    inputs, leaves, seeds, extras = residuals
    n = inputs.shape[0]

    def body(carry, i):
        dh, acc = carry
        layer = [w[i] for w in leaves]
        _, pullback = jax.vjp(lambda ws, h: apply(jax.tree.unflatten(treedef, ws), h, *extras), layer, inputs[i])
        d_layer, dh = pullback(dh)
        # the layer's gradient added into its slice of the accumulator: updated in place, no [layers, ...] temporary
        acc = [jax.lax.dynamic_update_index_in_dim(a, a[i] + d.astype(a.dtype), i, 0) for a, d in zip(acc, d_layer)]
        return (dh, acc), None

    (dx, acc), _ = jax.lax.scan(body, (dy, list(seeds)), jnp.arange(n - 1, -1, -1))
    return dx, acc, [None] * len(seeds), jax.tree.map(lambda _: None, extras)


_seeded.defvjp(_fwd, _bwd)
