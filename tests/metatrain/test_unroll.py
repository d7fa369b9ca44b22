"""Inner-checkpoint schedules: the same unrolled loop and meta-gradient as keeping every step, fewer kept states."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metatrain import mixflow
from metatrain.unroll import segments, unrolled


@pytest.fixture(autouse=True)
def float64():
    """These checks compare to 1e-12: float64, switched on for each test only (the rest of the session is float32)."""
    with jax.enable_x64(True):
        yield


def inner_loss(theta, eta, x):
    return jnp.sum(jnp.exp(eta) * jnp.tanh(x @ theta) ** 2) + 0.5 * jnp.sum(theta**2) * eta.sum()


def outer(eta, theta0, xs, loop, mode, unroll=False):
    vg = mixflow.value_and_grad(inner_loss, mode)

    def step(theta, x):
        loss, g = vg(theta, eta, x)
        return theta - 0.1 * g, loss

    theta, losses = unrolled(jax.checkpoint(step), theta0, xs, loop, unroll)
    return jnp.sum(theta**3) + 0.1 * losses.sum()


@pytest.mark.parametrize("n_steps", [7, 16])  # 7: sqrt has a short last segment, binomial odd halves
@pytest.mark.parametrize("schedule", ["sqrt", "binomial"])
@pytest.mark.parametrize("mode", ["autodiff", "mixflow"])
def test_same_meta_gradient_as_every_step(n_steps, schedule, mode):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    eta, theta0 = 0.1 * jax.random.normal(k1, (3,)), jax.random.normal(k2, (4, 3))
    xs = jax.random.normal(k3, (n_steps, 5, 4))
    ref = jax.grad(outer, argnums=(0, 1))(eta, theta0, xs, "peeled", "autodiff")
    got = jax.grad(outer, argnums=(0, 1))(eta, theta0, xs, schedule, mode)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-14)
    value = lambda s: float(outer(eta, theta0, xs, s, mode))
    assert value(schedule) == pytest.approx(value("peeled"), rel=1e-14)


@pytest.mark.parametrize("loop", ["unrolled", "sqrt"])
def test_unrolled_steps_give_the_same_meta_gradient(loop):
    """`unroll`: the inner steps traced one after the other (no loop, no [T, ...] checkpoint stacks) compute the
    loop's meta-gradient; the program differs (no while loop left)."""
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    eta, theta0 = 0.1 * jax.random.normal(k1, (3,)), jax.random.normal(k2, (4, 3))
    xs = jax.random.normal(k3, (5, 5, 4))
    grad = jax.grad(outer, argnums=(0, 1))
    ref = grad(eta, theta0, xs, "peeled", "autodiff")
    for r, g in zip(ref, grad(eta, theta0, xs, loop, "mixflow", True)):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-14)
    loops = lambda unroll: jax.jit(grad, static_argnums=(3, 4, 5)).lower(
        eta, theta0, xs, "unrolled" if unroll else "scan", "mixflow", unroll).as_text().count("stablehlo.while")
    assert loops(False) > 0 and loops(True) == 0


def test_kept_states():
    assert segments(16, "every_step") == [1] * 16
    assert segments(16, "sqrt") == [4, 4, 4, 4] and segments(10, "sqrt") == [4, 4, 2]
    assert segments(16, "binomial") == [8, 8] and sum(segments(7, "binomial")) == 7
    assert segments(2, "sqrt") == [1, 1]  # two steps: nothing to save by re-running


@pytest.mark.parametrize("n_steps", [2, 5])
@pytest.mark.parametrize("mode", ["autodiff", "mixflow"])
def test_every_step_takes_the_first_step_before_the_loop(n_steps, mode):
    """every_step: the first step runs outside the loop (its checkpoint is the outer step's own inputs, not a slot
    in the loop's stacks), the loop has n - 1 steps, and the meta-gradient is that of a plain Python loop."""
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    eta, theta0 = 0.1 * jax.random.normal(k1, (3,)), jax.random.normal(k2, (4, 3))
    xs = jax.random.normal(k3, (n_steps, 5, 4))

    def python_loop(eta, theta0, xs):  # the reference: no scan, no checkpoint, reverse-over-reverse
        theta, losses = theta0, []
        for x in xs:
            loss, g = jax.value_and_grad(inner_loss)(theta, eta, x)
            theta, losses = theta - 0.1 * g, losses + [loss]
        return jnp.sum(theta**3) + 0.1 * sum(losses)

    ref = jax.grad(python_loop, argnums=(0, 1))(eta, theta0, xs)
    got = jax.grad(outer, argnums=(0, 1))(eta, theta0, xs, "peeled", mode)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-14)
    jaxpr = jax.make_jaxpr(outer, static_argnums=(3, 4))(eta, theta0, xs, "peeled", mode)
    assert [e.params["length"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"] == [n_steps - 1]
