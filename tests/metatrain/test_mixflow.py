"""The three modes on a small analytic bilevel problem, against jax.grad-of-jax.grad and closed forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metatrain import mixflow


@pytest.fixture(autouse=True)
def float64():
    """These checks compare to 1e-12: float64, switched on for each test only (the rest of the session is float32)."""
    with jax.enable_x64(True):
        yield


def inner_loss(theta, eta, batch):
    """Depends on θ (params), η (float input: mixed derivatives) and integer tokens."""
    x = batch["x"][batch["idx"]]  # integer input
    return jnp.sum(jnp.exp(eta) * jnp.tanh(x @ theta) ** 2) + 0.5 * jnp.sum(theta**2) * eta.sum()


def outer(eta, theta0, batch, mode, use_loss=False):
    vg = mixflow.value_and_grad(inner_loss, mode)
    theta = theta0
    total = 0.0
    for _ in range(2):
        loss, g = vg(theta, eta, batch)
        theta = theta - 0.1 * g
        total = total + loss
    return jnp.sum(theta**3) + (0.3 * total if use_loss else 0.0)


@pytest.fixture
def problem():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.normal(size=3)), jnp.asarray(rng.normal(size=(4,))),
            {"x": jnp.asarray(rng.normal(size=(5, 4))), "idx": jnp.array([0, 2, 3])})


@pytest.mark.parametrize("mode", ["mixflow", "revfwd"])
@pytest.mark.parametrize("use_loss", [False, True])
def test_meta_gradient_matches_reverse_over_reverse(problem, mode, use_loss):
    eta, theta0, batch = problem
    ref = jax.grad(outer, argnums=(0, 1))(eta, theta0, batch, "autodiff", use_loss)
    got = jax.grad(outer, argnums=(0, 1))(eta, theta0, batch, mode, use_loss)
    assert np.abs(ref[0]).max() > 1e-3  # the mixed path is exercised
    for a, b in zip(ref, got):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_forward_value_is_plain_gradient(problem):
    _, theta0, batch = problem
    eta = jnp.zeros(3)
    for mode in mixflow.MODES:
        loss, g = mixflow.value_and_grad(inner_loss, mode)(theta0, eta, batch)
        ref_loss, ref_g = jax.value_and_grad(inner_loss)(theta0, eta, batch)
        np.testing.assert_allclose(g, ref_g, rtol=1e-14)
        assert float(loss) == pytest.approx(float(ref_loss))


def test_hvp_and_mixed_product_closed_form():
    """L = 0.5 θᵀAθ + θ·(Bη): cotangent v on ∇L maps to (A v, Bᵀ v)."""
    rng = np.random.default_rng(3)
    A = rng.normal(size=(3, 3))
    A = jnp.asarray(A + A.T)
    B = jnp.asarray(rng.normal(size=(3, 2)))
    loss = lambda th, eta: 0.5 * th @ A @ th + th @ (B @ eta)
    v = jnp.asarray(rng.normal(size=3))
    for mode in ("mixflow", "revfwd"):
        f = mixflow.value_and_grad(loss, mode)
        _, vjp = jax.vjp(lambda th, eta, f=f: f(th, eta)[1], jnp.ones(3), jnp.ones(2))
        d_th, d_eta = vjp(v)
        np.testing.assert_allclose(d_th, A @ v, rtol=1e-12)
        np.testing.assert_allclose(d_eta, B.T @ v, rtol=1e-12)


def test_unknown_mode():
    with pytest.raises(ValueError, match="mixflow"):
        mixflow.value_and_grad(inner_loss, "fwdfwd")
