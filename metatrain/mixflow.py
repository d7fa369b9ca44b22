"""The inner gradient, in three differentiation modes for the meta-gradient (MixFlow-MG, Sec. 3).

`value_and_grad(loss_fn, mode)` returns `f(params, *inputs) -> (loss, dloss/dparams)`. The forward
value is the same in every mode; what differs is how the *outer* reverse pass differentiates it:

- `autodiff`: plain autodiff, i.e. reverse-over-reverse (Algorithm 1).
- `mixflow`: a custom VJP whose backward pass is a JVP of the gradient (forward-over-reverse).
  By symmetry of second derivatives, the incoming cotangent `v` maps to `H v` (Hessian-vector
  product, Eq. 7) for `params` and to `M v` (mixed-derivative product, Eq. 8) for every
  floating-point input: this is how meta-parameters fed into the inner loss get their gradient.
- `revfwd`: the same custom VJP, with the backward pass computed reverse-over-forward:
  `grad_x <grad L(x), v>` where the inner directional derivative is a JVP.

Integer inputs (token ids) get no cotangent, nor do inputs named in `frozen_argnums` (e.g. the LoRA base
weights: passed in, not closed over, since a custom VJP cannot close over traced values). The loss value
is returned too; its cotangent `c` contributes `c * dL/dx`, which the backward pass gets from the same JVP
at no extra cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from metatrain.errors import ConfigError, renamed
from metatrain.models import dense, grad_seed

MODES = ("autodiff", "mixflow", "revfwd")
RENAMED_MODES = {"default": "autodiff"}  # modes by their names before a rename: still taken, with a warning


def mode_name(mode: str, spelled: str = "metagrad.mode={}", stacklevel: int = 3) -> str:
    """`mode` as named now: a renamed mode (`RENAMED_MODES`) gives its new name, with a `RenamedWarning` naming both
    as `spelled` spells a mode (`spelled.format(name)`); any other name is returned as it is (checked by the
    caller). `stacklevel`: as `errors.renamed`'s, counted from the caller of this function."""
    if mode in RENAMED_MODES:
        renamed(spelled.format(mode), spelled.format(RENAMED_MODES[mode]), stacklevel=stacklevel)
        return RENAMED_MODES[mode]
    return mode


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _is_primal(x) -> bool:
    return isinstance(x, jax.custom_derivatives.CustomVJPPrimal)


def unwrap(tree):
    """A custom VJP's primals as values (with `symbolic_zeros`, its fwd gets them wrapped)."""
    return jax.tree.map(lambda x: x.value, tree, is_leaf=_is_primal)


def instantiate(c):
    """A cotangent, a SymbolicZero made zeros (float0 for integer primals)."""
    if not isinstance(c, SymbolicZero):
        return c
    return np.zeros(c.shape, jax.dtypes.float0) if c.dtype == jax.dtypes.float0 else jnp.zeros(c.shape, c.dtype)


def _split_floats(inputs, frozen_argnums=()):
    """inputs (a tuple of pytrees) → (the float leaves to differentiate, a function rebuilding inputs from new
    values of those, one mapping their cotangents to the inputs' structure; None for the others)."""
    leaves, treedef = jax.tree.flatten(inputs)
    mask = [i not in frozen_argnums and _is_float(x) for i, part in enumerate(inputs) for x in jax.tree.leaves(part)]

    def rebuild(floats):
        it = iter(floats)
        return jax.tree.unflatten(treedef, [next(it) if m else x for x, m in zip(leaves, mask)])

    def cotangents(float_cts):
        it = iter(float_cts)
        return jax.tree.unflatten(treedef, [next(it) if m else None for m in mask])

    return [x for x, m in zip(leaves, mask) if m], rebuild, cotangents


def value_and_grad(loss_fn: Callable[..., jax.Array], mode: str = "mixflow",
                   frozen_argnums: tuple[int, ...] = ()) -> Callable[..., Any]:
    """`loss_fn(params, *inputs) -> scalar` → `f(params, *inputs) -> (loss, grad wrt params)`. `frozen_argnums`:
    positions in `inputs` that get no cotangent (never differentiated)."""
    mode = mode_name(mode, "mode='{}'")
    if mode not in MODES:
        raise ConfigError(f"metagrad.mode: unknown meta-gradient mode {mode!r}; choose one of {MODES}")
    plain = jax.value_and_grad(loss_fn)
    if mode == "autodiff":
        return plain
    vjp = backward(loss_fn, mode, frozen_argnums)

    @jax.custom_vjp
    def f(params, *inputs):
        return plain(params, *inputs)

    def fwd(params, *inputs):  # with symbolic_zeros, primals come wrapped (.value, .perturbed)
        params, inputs = unwrap((params, inputs))
        return plain(params, *inputs), (params, inputs)

    def bwd(residuals, cotangent):
        params, inputs = residuals
        ct_loss, ct_grad = cotangent
        ct_grad = jax.tree.map(lambda c, p: jnp.zeros_like(p) if isinstance(c, SymbolicZero) else c,
                               ct_grad, params, is_leaf=lambda c: isinstance(c, SymbolicZero))
        # The loss value is usually a metric only: its cotangent is a symbolic zero, and then the
        # primal gradient need not be kept alive for the  ct_loss * dL/dx  term.
        return vjp(params, inputs, None if isinstance(ct_loss, SymbolicZero) else ct_loss, ct_grad)

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f


def backward(loss_fn: Callable[..., jax.Array], mode: str = "mixflow",
             frozen_argnums: tuple[int, ...] = ()) -> Callable[..., tuple]:
    """The VJP of `value_and_grad(loss_fn)` computed in `mode`: `vjp(params, inputs, ct_loss, ct_grad[, ct_params]) ->
    (d_params, *d_inputs)` at `(params, *inputs)`, for the cotangents of the loss (None: zero) and of the gradient;
    inputs that get no cotangent (integers, `frozen_argnums`) get None. `ct_params` (optional): a cotangent params
    have already, returned added to d_params; under `mixflow` a block stack adds its HVP into it in place.
    `value_and_grad`'s custom VJP is this; a caller holding the primal gradient already (e.g. a saved inner
    gradient) calls it directly."""
    mode = mode_name(mode, "mode='{}'")
    if mode not in MODES:
        raise ConfigError(f"metagrad.mode: unknown meta-gradient mode {mode!r}; choose one of {MODES}")

    def vjp(params, inputs, ct_loss, ct_grad, ct_params=None):
        floats, rebuild, cotangents = _split_floats(inputs, frozen_argnums)

        def loss_of(p, fl):
            return loss_fn(p, *rebuild(fl))

        if mode == "mixflow" and ct_params is not None:
            return _seeded_mixflow(loss_fn, params, floats, rebuild, cotangents, ct_loss, ct_grad, ct_params)

        if mode == "autodiff":  # reverse-over-reverse
            (value, _), pullback = jax.vjp(jax.value_and_grad(loss_of), params, floats)
            d_params, d_inputs = pullback((jnp.zeros_like(value) if ct_loss is None else ct_loss, ct_grad))
        elif mode == "mixflow":
            grad_all = jax.grad(loss_of, argnums=(0, 1))
            (g_p, g_in), (d_params, d_inputs) = jax.jvp(lambda p: grad_all(p, floats), (params,), (ct_grad,))
            if ct_loss is not None:
                d_params = jax.tree.map(lambda h, g: h + ct_loss.astype(g.dtype) * g, d_params, g_p)
                d_inputs = [h + ct_loss.astype(g.dtype) * g for h, g in zip(d_inputs, g_in)]
        else:  # revfwd: one reverse pass over  c * L + <grad_params L, v>,  the inner product by a JVP

            def objective(p, fl):
                zeros = [jnp.zeros_like(x) for x in fl]
                with dense.plain():  # forward mode on the loss: the model's custom-VJP products are off
                    value, along_v = jax.jvp(loss_of, (p, fl), (ct_grad, zeros))
                return along_v if ct_loss is None else ct_loss.astype(value.dtype) * value + along_v

            d_params, d_inputs = jax.grad(objective, argnums=(0, 1))(params, floats)
        d_params = d_params if ct_params is None else jax.tree.map(jnp.add, d_params, ct_params)
        return (d_params, *cotangents(d_inputs))

    return vjp


def _seeded_mixflow(loss_fn, params, floats, rebuild, cotangents, ct_loss, ct_grad, ct_params):
    """mixflow's VJP plus `ct_params`, the cotangent params already have: a block stack's part of  ct_params + H v
    is accumulated in place in ct_params' buffers (`grad_seed`), the rest added after."""
    used = set()

    def grad_all(p, fl, seeds):
        def loss_of(p, fl):
            with grad_seed.seeding(p, seeds, used):
                return loss_fn(p, *rebuild(fl))

        return jax.grad(loss_of, argnums=(0, 1))(p, fl)

    zeros = jax.tree.map(jnp.zeros_like, ct_params)  # the primal seed: the primal gradient stays the gradient
    (g_p, g_in), (d_params, d_inputs) = jax.jvp(lambda p, s: grad_all(p, floats, s), (params, zeros),
                                                (ct_grad, ct_params))
    leaves, treedef = jax.tree.flatten(d_params)
    seeds = jax.tree.leaves(ct_params)
    d_params = jax.tree.unflatten(treedef, [d if i in used else d + s for i, (d, s) in enumerate(zip(leaves, seeds))])
    if ct_loss is not None:
        d_params = jax.tree.map(lambda h, g: h + ct_loss.astype(g.dtype) * g, d_params, g_p)
        d_inputs = [h + ct_loss.astype(g.dtype) * g for h, g in zip(d_inputs, g_in)]
    return (d_params, *cotangents(d_inputs))
