"""`x @ w` for the model's widening projections, with a weight gradient XLA:CPU computes without a large transpose.

XLA:CPU multiplies matrices with the contracting axis last in the left operand and first in the right one; an
operand laid out otherwise is transposed first. JAX writes the weight gradient of `x @ w` as `dot_general(g, x)`
over the tokens, the cotangent g [tokens, out] on the left, so g is transposed before every weight gradient. Where
w widens (in < out: the logits, g [tokens, vocab], the step's largest array; the MLP's up-projections) that copy can
cost more than the product. Within `cpu_products()` (`step.lower` turns it on for CPU programs) `dense` computes
that gradient as `dot_general(x, g)`: the narrower x is transposed instead. The products are the same, summed in
another order. TPUs multiply either layout, and their programs (and memory figures) are left as they are.

It is a custom VJP: reverse mode and forward-over-reverse (MixFlow's Hessian-vector products) go through it, and
so does reverse-over-reverse. Forward mode on the model itself (a JVP of the loss, as `metagrad.mode=revfwd`
computes) does not: trace that inside `plain()`.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_ON: contextvars.ContextVar = contextvars.ContextVar("cpu_products", default=False)


@contextlib.contextmanager
def cpu_products(enabled: bool = True):
    """Within (at trace time): `dense` takes the custom VJP where its weight widens (`enabled`), else it is
    `x @ w`."""
    token = _ON.set(enabled)
    try:
        yield
    finally:
        _ON.reset(token)


def plain():
    """Within: `dense` is `x @ w`, e.g. for forward-mode differentiation of the model."""
    return cpu_products(False)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w`: x [..., in], w [in, out] of x's dtype → [..., out]. Within `cpu_products()`, where in < out, its
    weight gradient is computed as x^T g (module docstring)."""
    if not _ON.get() or w.shape[0] >= w.shape[1]:
        return x @ w
    return _widening(x, w)


@jax.custom_vjp
def _widening(x, w):
    return x @ w


def _fwd(x, w):
    return x @ w, (x, w)


def _bwd(residuals, g):
    x, w = residuals
    tokens = tuple(range(x.ndim - 1))
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())))  # g w^T: [..., in]
    dw = jax.lax.dot_general(x, g, ((tokens, tokens), ((), ())))  # x^T g: [in, out], x transposed, not g
    return dx.astype(x.dtype), dw.astype(w.dtype)


_widening.defvjp(_fwd, _bwd)
