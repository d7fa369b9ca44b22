"""Blockwise attention equals dense attention: output, gradient and forward-over-reverse HVP, float32 and float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metatrain.models.transformer import attention_mask, blockwise_attention, dense_attention


def _inputs(dtype, b=2, s=37, h=2, d=8):
    kq, kk, kv, kt = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (b, s, h, d), dtype) for key in (kq, kk, kv))
    # several documents per row, and padding (segment 0) at the end of the second row
    seg = jnp.stack([jnp.repeat(jnp.arange(1, 4), 13)[:s], jnp.concatenate([jnp.full(30, 1), jnp.zeros(7, int)])])
    return q, k, v, seg.astype(jnp.int32)


def _rel(a, b):
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a, b))
    return np.linalg.norm(a - b) / np.linalg.norm(a)


@pytest.mark.parametrize("dtype, tol, block", [(jnp.float32, 1e-5, 16), (jnp.float64, 1e-10, 8)])  # S=37: padded
def test_blockwise_equals_dense(dtype, tol, block):
    with jax.enable_x64(dtype == jnp.float64):
        q, k, v, seg = _inputs(dtype)
        w = jax.random.normal(jax.random.key(1), v.shape, dtype)  # a fixed readout: loss = <w, attention>
        dense = lambda q, k, v: dense_attention(q, k, v, attention_mask(seg))
        blockwise = lambda q, k, v: blockwise_attention(q, k, v, seg, block)
        assert _rel(dense(q, k, v), blockwise(q, k, v)) <= tol
        def loss(f):  # nonlinear: a nonzero Hessian
            return lambda q, k, v: jnp.sum(w * f(q, k, v) ** 2)

        grads = [jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v) for f in (dense, blockwise)]
        assert _rel(*grads) <= tol
        tangent = jax.random.normal(jax.random.key(2), (3,) + q.shape, dtype)
        hvp = [jax.jvp(jax.grad(loss(f), argnums=(0, 1, 2)), (q, k, v), tuple(tangent))[1] for f in (dense, blockwise)]
        assert _rel(*hvp) <= tol
