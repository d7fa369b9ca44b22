import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metatrain import models
from metatrain.errors import ConfigError
from metatrain.models.transformer import attention_mask, dense_attention, rope, rope_frequencies


def test_rope_matches_complex_rotation():
    """RoPE rotates each (x_i, x_{i+k/2}) pair by position * base^(-i/(k/2)): compare with complex numbers."""
    rng = np.random.default_rng(0)
    b, s, h, k = 2, 5, 3, 8
    x = rng.normal(size=(b, s, h, k))
    pos = rng.integers(0, 100, size=(b, s))
    freq = rope_frequencies(models.ModelConfig(d_model=h * k, n_heads=h, rope_base=10_000.0), jnp.float32)
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), freq))
    half = k // 2
    z = x[..., :half] + 1j * x[..., half:]
    theta = pos[:, :, None, None] * 10_000.0 ** (-np.arange(half) / half)
    z = z * np.exp(1j * theta)
    np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], -1), rtol=1e-5, atol=1e-5)


def test_rope_relative():
    """q·k after RoPE depends only on the position difference."""
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(2, 1, 1, 1, 16))
    freq = rope_frequencies(models.ModelConfig(d_model=16, n_heads=1), jnp.float32)
    rotated = lambda x, i: rope(jnp.asarray(x), jnp.array([[i]]), freq)
    dot = lambda i, j: float((rotated(q, i) * rotated(k, j)).sum())
    assert dot(3, 1) == pytest.approx(dot(10, 8), rel=1e-4)


def test_llama3_rope_scaling_bands():
    """llama3 scaling: wavelengths longer than original_max / low_freq_factor slowed by `factor`, shorter than
    original_max / high_freq_factor kept, the band between blended linearly in original_max / wavelength."""
    cfg = models.ModelConfig(d_model=64, n_heads=1, rope_base=500_000.0, rope_scaling="llama3", rope_factor=8.0,
                             rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_positions=64)
    base = np.asarray(rope_frequencies(cfg.replace(rope_scaling=""), jnp.float64 if jax.config.x64_enabled
                                       else jnp.float32))
    got = np.asarray(rope_frequencies(cfg, base.dtype))
    ratio = 64 / (2 * np.pi / base)
    low, high = ratio < 1, ratio > 4
    mid = ~low & ~high
    assert low.any() and high.any() and mid.any()  # the test reaches all three bands
    np.testing.assert_allclose(got[low], base[low] / 8, rtol=1e-6)
    np.testing.assert_allclose(got[high], base[high], rtol=1e-6)
    t = (ratio[mid] - 1) / 3
    np.testing.assert_allclose(got[mid], (1 - t) * base[mid] / 8 + t * base[mid], rtol=1e-5)


def test_grouped_query_attention_equals_repeated_heads():
    """n_kv_heads=2 of 4: the same model as full multi-head attention whose k/v heads are the kv heads repeated."""
    cfg = models.preset("tiny-llama")
    graphdef, state = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(params=0)))
    full_graphdef, full_state = nnx.split(models.Transformer(cfg.replace(n_kv_heads=0), rngs=nnx.Rngs(params=1)))
    weights = nnx.to_pure_dict(state)
    attn = dict(weights["blocks"]["attn"])
    for name in ("wk", "wv", "bk", "bv"):  # [layers, (d_model,) kv_heads, k]: repeat along the heads axis
        attn[name] = jnp.repeat(attn[name], 2, axis=attn[name].ndim - 2)
    nnx.replace_by_pure_dict(full_state, {**weights, "blocks": {**weights["blocks"], "attn": attn}})
    gqa, full = nnx.merge(graphdef, state), nnx.merge(full_graphdef, full_state)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)
    np.testing.assert_allclose(gqa(tokens), full(tokens), atol=1e-5)  # float32 rounding; a wrong head map is O(1)


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


def test_scan_over_layers_equals_loop_and_unrolled_and_remat_is_exact(float64):
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
    gd_straight, _ = models.init(cfg.replace(scan_layers=False), jax.random.key(0))  # the blocks unrolled
    np.testing.assert_allclose(nnx.merge(gd_straight, params)(tokens), loop_logits, rtol=1e-12, atol=1e-12)

    loss = lambda gd_: lambda p: nnx.merge(gd_, p)(tokens).sum()
    gd_remat, _ = models.init(cfg.replace(remat=True), jax.random.key(0))
    g1 = jax.grad(loss(gd))(params)
    for other in (gd_remat, gd_straight):
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(jax.grad(loss(other))(params))):
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


# published sizes (the checkpoints' model cards / safetensors headers), to the parameter
PUBLISHED = {"smollm2-135m": 134_515_008, "smollm2-360m": 361_821_120, "qwen2.5-0.5b": 494_032_768,
             "llama3.2-1b": 1_235_814_400, "tinyllama-1.1b": 1_100_048_384}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_pretrained_shapes_have_the_published_sizes(name):
    assert models.param_count(models.preset(name)) == PUBLISHED[name]


@pytest.mark.parametrize("name", ["44m", "489m", "tiny", "tiny-llama", "llama3.2-1b", "qwen2.5-0.5b"])
def test_param_count_matches_model(name):
    cfg = models.preset(name)
    _, abstract = models.abstract_init(cfg)
    assert sum(x.size for x in jax.tree.leaves(abstract)) == models.param_count(cfg)


def test_bad_model_config():
    with pytest.raises(ConfigError, match="n_heads"):
        models.preset("tiny", d_model=30, n_heads=4)
    with pytest.raises(ConfigError, match="unknown model preset"):
        models.preset("huge")
    # a misspelt field (it was dataclasses' TypeError, "unexpected keyword argument")
    with pytest.raises(ConfigError, match="ModelConfig has no field 'n_layerz'; did you mean 'n_layers'"):
        models.preset("tiny", n_layerz=2)
    with pytest.raises(ConfigError, match="has no field 'zzz'; its fields: vocab_size, d_model"):
        models.preset("tiny").replace(zzz=1)


@pytest.mark.slow
def test_chunked_loss_equals_whole_sequence_logits_with_its_derivatives():
    """`loss_chunk`: the same per-example losses, gradient and forward-over-reverse Hessian-vector product as the
    [batch, seq, vocab] logits (float64; a chunk that does not divide the sequence, padding positions)."""
    with jax.enable_x64(True):
        cfg = models.preset("tiny", param_dtype="float64", n_layers=1)
        (graphdef, theta), (chunked_graphdef, _) = (models.init(cfg.replace(loss_chunk=c), jax.random.key(0))
                                                     for c in (0, 5))
        tokens = jax.random.randint(jax.random.key(1), (3, 13), 0, cfg.vocab_size)
        seg = jnp.ones((3, 13), jnp.int32).at[1, 9:].set(0)

        def loss(gd, t):
            return (nnx.merge(gd, t).example_losses(tokens, seg) * jnp.array([1.0, 2.0, 3.0])).sum()

        for f in (lambda gd, t: nnx.merge(gd, t).example_losses(tokens, seg), jax.grad(loss, argnums=1)):
            a, b = f(graphdef, theta), f(chunked_graphdef, theta)
            assert all(jnp.allclose(x, y, rtol=1e-10, atol=1e-12) for x, y in zip(jax.tree.leaves(a),
                                                                                   jax.tree.leaves(b)))
        v = jax.tree.map(lambda x: jax.random.normal(jax.random.key(2), x.shape, x.dtype), theta)
        hvp = lambda gd: jax.jvp(lambda t: jax.grad(loss, argnums=1)(gd, t), (theta,), (v,))[1]
        for x, y in zip(jax.tree.leaves(hvp(graphdef)), jax.tree.leaves(hvp(chunked_graphdef))):
            assert jnp.allclose(x, y, rtol=1e-9, atol=1e-11)
        assert not jnp.allclose(loss(graphdef, theta), loss(graphdef, jax.tree.map(lambda x, y: x + y, theta, v)))


def test_ids_outside_the_vocabulary_are_refused_when_the_model_is_called_eagerly():
    """An id past the embedding gave NaN logits (JAX's gather fills), a negative one the logits of the id counted from
    the end, and neither said why. Under jit the ids are not known and nothing is checked (or paid)."""
    model = models.Transformer(models.ModelConfig(vocab_size=32, d_model=16, n_heads=2, d_ff=32, n_layers=1),
                               rngs=nnx.Rngs(params=0))
    for tokens, bad in (([[1, 32]], 32), (np.array([[-1, 2]]), -1), (jnp.array([[5, 400]]), 400)):
        with pytest.raises(ValueError, match=re.escape(f"token id {bad} is outside the model's vocabulary [0, 32)")):
            model(tokens)
    with pytest.raises(ValueError, match="token id 32 is outside"):
        model.example_losses(jnp.array([[1, 2, 32]]))
    assert model([[0, 31]]).shape == (1, 2, 32)
    wrapped = jax.jit(lambda t: model(t))(jnp.array([[1, -1]]))  # jit: the gather as before
    assert np.allclose(wrapped, model([[1, 31]]), atol=1e-6)


def test_loss_chunk_must_not_be_negative():
    with pytest.raises(ConfigError, match="loss_chunk"):
        models.preset("tiny", loss_chunk=-1)


def test_the_model_takes_integer_token_ids_batch_by_seq_and_says_so_otherwise():
    """Floats died in `jnp.take` ("indices must have an integer type"), one sequence without its batch axis in an
    unpacking ("not enough values to unpack")."""
    model = models.Transformer(models.ModelConfig(vocab_size=32, d_model=16, n_heads=2, d_ff=32, n_layers=1),
                               rngs=nnx.Rngs(params=0))
    assert model([[1, 2, 3]]).shape == model(np.array([[1, 2, 3]], np.int32)).shape == (1, 3, 32)
    for tokens, says in ((np.ones((1, 4)), "got float64 of shape (1, 4)"),
                         (np.ones(4, np.int32), "got int32 of shape (4,)")):
        with pytest.raises(ValueError, match=r"the model takes token ids, integers \[batch, seq\]; " + re.escape(says)):
            model(tokens)
