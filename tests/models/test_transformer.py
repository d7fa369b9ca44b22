import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metatrain import models
from metatrain.errors import ConfigError
from metatrain.models.transformer import attention_mask, dense_attention, rope


def test_rope_matches_complex_rotation():
    """RoPE rotates each (x_i, x_{i+k/2}) pair by position * base^(-i/(k/2)): compare with complex numbers."""
    rng = np.random.default_rng(0)
    b, s, h, k = 2, 5, 3, 8
    x = rng.normal(size=(b, s, h, k))
    pos = rng.integers(0, 100, size=(b, s))
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), 10_000.0))
    half = k // 2
    z = x[..., :half] + 1j * x[..., half:]
    theta = pos[:, :, None, None] * 10_000.0 ** (-np.arange(half) / half)
    z = z * np.exp(1j * theta)
    np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], -1), rtol=1e-5, atol=1e-5)


def test_rope_relative():
    """q·k after RoPE depends only on the position difference."""
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(2, 1, 1, 1, 16))
    rotated = lambda x, i: rope(jnp.asarray(x), jnp.array([[i]]), 1e4)
    dot = lambda i, j: float((rotated(q, i) * rotated(k, j)).sum())
    assert dot(3, 1) == pytest.approx(dot(10, 8), rel=1e-4)


def _reference_attention(q, k, v, seg):
    """Plain loops: causal softmax attention within documents."""
    b, s, h, d = q.shape
    out = np.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            for i in range(s):
                js = [j for j in range(i + 1) if seg[bi, j] == seg[bi, i]]
                logits = np.array([q[bi, i, hi] @ k[bi, j, hi] / np.sqrt(d) for j in js])
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[bi, i, hi] = sum(pj * v[bi, j, hi] for pj, j in zip(p, js))
    return out


def test_attention_matches_reference():
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(size=(3, 2, 7, 2, 4))
    seg = np.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1]])
    got = dense_attention(*(jnp.asarray(a) for a in (q, k, v)), attention_mask(jnp.asarray(seg)))
    np.testing.assert_allclose(np.asarray(got), _reference_attention(q, k, v, seg), rtol=1e-5, atol=1e-5)


def test_documents_do_not_see_each_other():
    cfg = models.preset("tiny")
    gd, params = models.init(cfg, jax.random.key(0))
    model = nnx.merge(gd, params)
    tokens = jax.random.randint(jax.random.key(1), (1, 10), 0, cfg.vocab_size)
    seg = jnp.array([[1] * 4 + [2] * 6])
    changed = tokens.at[0, :4].set((tokens[0, :4] + 1) % cfg.vocab_size)  # edit document 1 only
    a, b = model(tokens, seg), model(changed, seg)
    np.testing.assert_allclose(a[0, 4:], b[0, 4:], rtol=1e-6)  # document 2 unchanged
    assert not np.allclose(a[0, :4], b[0, :4])


@pytest.fixture
def float64():
    with jax.enable_x64(True):
        yield


def test_scan_over_layers_equals_loop_and_remat_is_exact(float64):
    """In float64, so that "exact" can be checked to 1e-12: in float32 the recomputed forward pass may round
    differently (an XLA fusion choice), and a loose tolerance would hide a real difference."""
    cfg = models.preset("tiny", n_layers=3, param_dtype="float64")
    gd, params = models.init(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.vocab_size)
    model = nnx.merge(gd, params)
    # the same blocks applied one by one in Python
    x = params["embed"][...][tokens]
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    seg = jnp.ones((2, 6), jnp.int32)
    bgd, bstate = nnx.split(model.blocks)
    for i in range(3):
        x = nnx.merge(bgd, jax.tree.map(lambda a, i=i: a[i], bstate))(x, positions, seg)
    loop_logits = model.final_norm(x) @ params["embed"][...].T
    np.testing.assert_allclose(model(tokens), loop_logits, rtol=1e-12, atol=1e-12)

    loss = lambda gd_: lambda p: nnx.merge(gd_, p)(tokens).sum()
    gd_remat, _ = models.init(cfg.replace(remat=True), jax.random.key(0))
    g1 = jax.grad(loss(gd))(params)
    g2 = jax.grad(loss(gd_remat))(params)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert a.dtype == jnp.float64
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_score_head_and_logical_axes():
    cfg = models.preset("tiny", head="score")
    gd, params = models.init(cfg, jax.random.key(0))
    assert nnx.merge(gd, params)(jnp.zeros((3, 5), jnp.int32)).shape == (3,)
    specs = nnx.get_partition_spec(params)
    assert tuple(specs["blocks"]["mlp"]["w_in"]) == ("layers", "embed", "mlp")
    assert tuple(specs["embed"]) == ("vocab", "embed")


@pytest.mark.parametrize("name", list(models.LADDER))
def test_ladder_parameter_counts(name):
    millions = models.LADDER[name][0]
    cfg = models.preset(name)
    assert abs(models.param_count(cfg) / 1e6 - millions) / millions <= 0.10


@pytest.mark.parametrize("name", ["44m", "489m", "tiny"])
def test_param_count_matches_model(name):
    cfg = models.preset(name)
    _, abstract = models.abstract_init(cfg)
    assert sum(x.size for x in jax.tree.leaves(abstract)) == models.param_count(cfg)


def test_bad_model_config():
    with pytest.raises(ConfigError, match="n_heads"):
        models.preset("tiny", d_model=30, n_heads=4)
    with pytest.raises(ConfigError, match="unknown model preset"):
        models.preset("huge")
