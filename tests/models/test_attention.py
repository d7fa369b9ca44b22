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


# tol: float32 attention over 37 keys is exact to a few ulps of its outputs (1e-5 relative leaves a margin of ~100);
# float64 to 1e-10 likewise
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype, tol, block", [(jnp.float32, 1e-5, 16), (jnp.float64, 1e-10, 8)])  # S=37: padded
def test_blockwise_equals_dense(dtype, tol, block, causal):
    with jax.enable_x64(dtype == jnp.float64):
        q, k, v, seg = _inputs(dtype)
        w = jax.random.normal(jax.random.key(1), v.shape, dtype)  # a fixed readout: loss = <w, attention>
        dense = lambda q, k, v: dense_attention(q, k, v, attention_mask(seg, causal))
        blockwise = lambda q, k, v: blockwise_attention(q, k, v, seg, block, causal)
        assert _rel(dense(q, k, v), blockwise(q, k, v)) <= tol
        def loss(f):  # nonlinear: a nonzero Hessian
            return lambda q, k, v: jnp.sum(w * f(q, k, v) ** 2)

        grads = [jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v) for f in (dense, blockwise)]
        assert _rel(*grads) <= tol
        tangent = jax.random.normal(jax.random.key(2), (3,) + q.shape, dtype)
        hvp = [jax.jvp(jax.grad(loss(f), argnums=(0, 1, 2)), (q, k, v), tuple(tangent))[1] for f in (dense, blockwise)]
        assert _rel(*hvp) <= tol


@pytest.mark.parametrize("kind", ["dense", "blockwise"])
def test_bidirectional_attention_sees_later_tokens_of_its_own_document_only(kind):
    """causal=False: a position's output changes with a later key of its document, never with another document's;
    causal=True: with neither."""
    q, k, v, seg = _inputs(jnp.float32)
    later = v.at[0, 20].add(1.0)  # row 0: documents at positions 0-12, 13-25, 26-36; 20 is in the second
    for causal in (True, False):
        def attend(v, causal=causal):
            if kind == "dense":
                return dense_attention(q, k, v, attention_mask(seg, causal))
            return blockwise_attention(q, k, v, seg, 8, causal)

        changed = np.abs(np.asarray(attend(later) - attend(v)))[0].max(axis=(1, 2)) > 0  # [seq]
        assert not changed[:13].any() and not changed[26:].any()  # other documents: never
        assert bool(changed[15]) == (not causal)  # an earlier position of the same document: only bidirectional
        assert changed[20] and changed[25]  # the position itself and later ones: always
