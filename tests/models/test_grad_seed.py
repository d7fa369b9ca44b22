"""The seeded block-stack gradient (`grad_seed`) against plain autodiff of the transformer, in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metatrain import mixflow, models
from metatrain.models import grad_seed


@pytest.fixture(autouse=True)
def float64():
    with jax.enable_x64(True):
        yield


def problem(lora=None):
    cfg = models.preset("tiny", param_dtype="float64", remat=True)
    model = models.Transformer(cfg, lora, rngs=nnx.Rngs(0))
    graphdef, theta, rest = nnx.split(model, nnx.LoRAParam if lora else nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    loss = lambda t, w: jnp.sum(w * nnx.merge(graphdef, t, rest).example_losses(tokens))
    like = lambda k: jax.tree.map(lambda x: jax.random.normal(k, x.shape, x.dtype), theta)
    return loss, theta, like(jax.random.key(2)), like(jax.random.key(3))


@pytest.mark.parametrize("lora", [None, models.LoRAConfig(rank=2)])
def test_seeded_hvp_equals_seed_plus_autodiff_hvp(lora):
    """mixflow's VJP handed θ's cotangent (the block stack then accumulates H v into it) equals the plain
    VJP plus that cotangent, for θ and for the mixed product of a float input; the block stack took the seeds."""
    loss, theta, v, seed = problem(lora)
    w = jnp.array([0.7, 1.3])
    vjp = jax.jit(mixflow.backward(loss, "mixflow"))
    plain = vjp(theta, (w,), None, v)
    used = []
    real = grad_seed.seeding

    def spy(params, seeds, found=None):
        used.append(found)
        return real(params, seeds, found)

    grad_seed.seeding = spy
    try:
        seeded = vjp(theta, (w,), None, v, seed)
    finally:
        grad_seed.seeding = real
    assert used and used[0], "no block stack leaf was seeded"
    expect = jax.tree.map(jnp.add, plain[0], seed)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), seeded[0], expect)
    np.testing.assert_allclose(seeded[1], plain[1], rtol=1e-10, atol=1e-12)
    # the reference itself against reverse-over-reverse
    ref = jax.jit(mixflow.backward(loss, "autodiff"))(theta, (w,), None, v)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11), plain[0], ref[0])


def test_seeded_scan_gradient_is_seed_plus_gradient():
    """`grad_seed.scan`'s gradient for the stacked weights is seed + the gradient of a plain scan."""
    rng = np.random.default_rng(0)
    ws, x, s = (jnp.asarray(rng.normal(size=shape)) for shape in [(3, 4, 4), (2, 4), (3, 4, 4)])
    apply = lambda w, h: h + jnp.tanh(h @ w)
    plain = lambda ws: jnp.sum(jax.lax.scan(lambda h, w: (apply(w, h), None), x, ws)[0] ** 2)
    seeded = lambda ws: jnp.sum(grad_seed.scan(apply, x, ws, [s]) ** 2)
    np.testing.assert_allclose(seeded(ws), plain(ws), rtol=1e-12)
    np.testing.assert_allclose(jax.grad(seeded)(ws), jax.grad(plain)(ws) + s, rtol=1e-10, atol=1e-12)
