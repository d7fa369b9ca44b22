"""`dense`'s CPU products (weight gradient as x^T g) against plain `x @ w`, in float64, through the transformer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metatrain import mixflow, models
from metatrain.models import dense


@pytest.fixture(autouse=True)
def float64():
    with jax.enable_x64(True):
        yield


def close(a, b):
    # float64 sums of the same products in another order: differences are ~1e-16 of the values' scale
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-10, atol=1e-12)


def uses_custom_vjp(fn, *args) -> bool:
    return "custom_vjp_call" in str(jax.make_jaxpr(fn)(*args))


def test_only_widening_products_in_the_context_take_the_custom_vjp():
    x = jnp.ones((2, 3, 4))
    assert not uses_custom_vjp(lambda x, w: dense.dense(x, w), x, jnp.ones((4, 8)))  # outside: x @ w
    with dense.cpu_products():
        assert uses_custom_vjp(lambda x, w: dense.dense(x, w), x, jnp.ones((4, 8)))
        assert not uses_custom_vjp(lambda x, w: dense.dense(x, w), x, jnp.ones((4, 4)))  # g is no wider than x
        assert not uses_custom_vjp(lambda x, w: dense.dense(x, w), x, jnp.ones((4, 2)))
        with dense.plain():
            assert not uses_custom_vjp(lambda x, w: dense.dense(x, w), x, jnp.ones((4, 8)))


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])  # remat: the seeded block stack (models.grad_seed) too
def test_gradients_and_second_order_products_match_plain_products(remat):
    """The tiny transformer's loss: gradient, MixFlow's VJP (forward-over-reverse HVP and mixed product, seeded
    with a cotangent for θ) and reverse-over-reverse, with and without the CPU products."""
    cfg = models.preset("tiny", param_dtype="float64", remat=remat)
    graphdef, theta = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(0)))
    assert cfg.d_model < cfg.d_ff and cfg.d_model < cfg.vocab_size  # both kinds of widening product are there
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    loss = lambda t, w: jnp.sum(w * nnx.merge(graphdef, t).example_losses(tokens))
    like = lambda k: jax.tree.map(lambda x: jax.random.normal(k, x.shape, x.dtype), theta)
    v, seed, w = like(jax.random.key(2)), like(jax.random.key(3)), jnp.array([0.7, 1.3])

    def everything():  # a new function each time: jit's cache does not know the context
        grad = jax.grad(loss, argnums=(0, 1))(theta, w)
        hvp = mixflow.backward(loss, "mixflow")(theta, (w,), jnp.float64(0.5), v, seed)
        rr = mixflow.backward(loss, "autodiff")(theta, (w,), None, v)
        return grad, hvp, rr

    plain = jax.jit(lambda: everything())()
    with dense.cpu_products():
        assert uses_custom_vjp(lambda t: loss(t, w), theta)
        products = jax.jit(lambda: everything())()
    close(products, plain)


def test_revfwd_traces_the_loss_with_plain_products():
    """Forward mode cannot go through a custom VJP: `revfwd` differentiates the loss forward inside `plain()`."""
    cfg = models.preset("tiny", param_dtype="float64")
    graphdef, theta = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    loss = lambda t: jnp.sum(nnx.merge(graphdef, t).example_losses(tokens))
    v = jax.tree.map(jnp.ones_like, theta)
    reference = mixflow.backward(loss, "mixflow")(theta, (), None, v)
    with dense.cpu_products():
        close(mixflow.backward(loss, "revfwd")(theta, (), None, v), reference)
