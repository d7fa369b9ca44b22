"""Text generation with a KV cache: a prefill pass over the prompts fills the cache, then one token per step in a
compiled `lax.while_loop`.

Prompts of different lengths share a batch left-padded: row b's prompt takes the last L_b of P slots, its
positions count from 0 at its first token, and keys in its padding slots are never attended to. Every step writes
the same cache slot for all rows (P + t, at position L_b + t). The math is the model's (`models.transformer`:
RMSNorm, RoPE, grouped-query attention, q/k/v biases, GELU or SwiGLU), over the parameters as a pure dict; a
LoRA run's model generates after its adapters are merged into the base weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from metatrain.models import ModelConfig
from metatrain.models.transformer import compute_dtype, rms_norm, rope, rope_frequencies


def _layer(cfg: ModelConfig, x, p, k_cache, v_cache, positions, write_at, visible):
    """One block over new tokens x [B, S, D] at `positions` [B, S], their keys and values written into the
    layer's cache [B, T, G, K] at slot `write_at`; `visible` [B, S, T]: which cache slots each new token sees."""
    a = p["attn"]
    h = rms_norm(x, p["attn_norm"]["scale"], cfg.norm_eps)

    def project(name):
        y = jnp.einsum("bsd,dhk->bshk", h, a["w" + name].astype(h.dtype))
        return y + a["b" + name].astype(h.dtype) if cfg.qkv_bias else y

    freq = rope_frequencies(cfg, jnp.float32)
    q, k, v = rope(project("q"), positions, freq), rope(project("k"), positions, freq), project("v")
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, write_at, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, write_at, 0, 0))
    groups = cfg.n_heads // cfg.kv_heads
    keys, values = jnp.repeat(k_cache, groups, axis=2), jnp.repeat(v_cache, groups, axis=2)
    q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    scores = jnp.einsum("bqhk,bshk->bhqs", q, keys.astype(q.dtype), preferred_element_type=compute_dtype(q.dtype))
    scores = jnp.where(visible[:, None], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bhqs,bshk->bqhk", probs, values)
    x = x + jnp.einsum("bshk,hkd->bsd", out.astype(x.dtype), a["wo"].astype(x.dtype))
    m = p["mlp"]
    h = rms_norm(x, p["mlp_norm"]["scale"], cfg.norm_eps)
    up = h @ m["w_in"].astype(h.dtype)
    up = jax.nn.silu(h @ m["w_gate"].astype(h.dtype)) * up if cfg.mlp == "swiglu" else jax.nn.gelu(up)
    return x + up @ m["w_out"].astype(h.dtype), k_cache, v_cache


def _forward(cfg: ModelConfig, params, tokens, positions, cache, write_at, visible):
    """Logits of the last new token [B, vocab] and the updated cache (k, v: [layers, B, T, G, K])."""
    x = jnp.take(params["embed"], tokens, axis=0).astype(cfg.activation_dtype)

    def body(x, layer):
        p, kc, vc = layer
        x, kc, vc = _layer(cfg, x, p, kc, vc, positions, write_at, visible)
        return x, (kc, vc)

    x, cache = jax.lax.scan(body, x, (params["blocks"], *cache))
    x = rms_norm(x[:, -1], params["final_norm"]["scale"], cfg.norm_eps)
    w = params["embed"].T if cfg.tie_embeddings else params["out"]
    return (x @ w.astype(x.dtype)).astype(jnp.float32), cache


def _choose(logits, key, temperature: float, top_k: int, top_p: float):
    """The next token of each row: argmax at temperature 0, else a draw from the top-k / top-p softmax."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_ = jnp.take_along_axis(logits, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(sorted_, axis=-1), axis=-1)
        drop = cum - jax.nn.softmax(sorted_, axis=-1) >= top_p  # keep up to and including the one crossing top_p
        sorted_ = jnp.where(drop, -jnp.inf, sorted_)
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(sorted_)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "temperature", "top_k", "top_p"))
def _generate(cfg: ModelConfig, params, tokens, lengths, eos, key, *, max_new: int, temperature: float,
              top_k: int, top_p: float):
    b, p = tokens.shape
    total = p + max_new
    slots = jnp.arange(total)
    start = p - lengths  # row b's first real slot
    shape = (cfg.n_layers, b, total, cfg.kv_heads, cfg.head_dim)
    cache = (jnp.zeros(shape, cfg.activation_dtype), jnp.zeros(shape, cfg.activation_dtype))
    real = slots[None, :] >= start[:, None]  # [B, T]: not padding
    positions = jnp.maximum(jnp.arange(p)[None, :] - start[:, None], 0)
    visible = real[:, None, :] & (slots[None, None, :] <= jnp.arange(p)[None, :, None])
    logits, cache = _forward(cfg, params, tokens, positions, cache, 0, visible)
    key, sub = jax.random.split(key)
    first = _choose(logits, sub, temperature, top_k, top_p)
    out = jnp.full((b, max_new), -1, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos)

    def cond(state):
        t, _, _, _, done, _ = state
        return (t < max_new) & ~done.all()

    def step(state):
        t, last, cache, out, done, key = state
        slot = p + t - 1  # where the last chosen token goes
        visible = (real & (slots[None, :] <= slot))[:, None, :]
        logits, cache = _forward(cfg, params, last[:, None], (lengths + t - 1)[:, None], cache, slot, visible)
        key, sub = jax.random.split(key)
        nxt = jnp.where(done, -1, _choose(logits, sub, temperature, top_k, top_p))
        return t + 1, nxt, cache, out.at[:, t].set(nxt), done | jnp.isin(nxt, eos), key

    return jax.lax.while_loop(cond, step, (jnp.int32(1), first, cache, out, done, key))[3]


def generate(cfg: ModelConfig, params: dict, prompts: list[list[int]], max_new_tokens: int = 32,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             eos: int | list[int] | None = None) -> list[list[int]]:
    """New tokens for each prompt, with a KV cache.

    Args:
      cfg: the model's architecture (`head="lm"`).
      params: its parameters as a pure dict (`nnx.to_pure_dict`, or `hf.read`'s).
      prompts: token-id lists, of any lengths (at least one token each).
      max_new_tokens: at most this many new tokens per prompt.
      temperature: 0 is greedy; above it, a draw from softmax(logits / temperature).
      top_k: draw among the k likeliest tokens only (0: all).
      top_p: draw among the likeliest tokens whose probabilities sum to top_p (1: all).
      seed: the draws' random key.
      eos: end-of-sequence id(s): a row stops after emitting one.

    Returns:
      Per prompt, the list of new token ids, up to and including the first EOS.
    """
    if not prompts or any(len(x) == 0 for x in prompts):
        raise ValueError("generate: give at least one prompt, each of at least one token")
    lengths = np.asarray([len(x) for x in prompts], np.int32)
    tokens = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for i, x in enumerate(prompts):
        tokens[i, tokens.shape[1] - len(x):] = x
    eos_ids = jnp.asarray([-2] if eos is None else np.atleast_1d(eos), jnp.int32)
    out = np.asarray(_generate(cfg, jax.tree.map(jnp.asarray, params), jnp.asarray(tokens), jnp.asarray(lengths),
                               eos_ids, jax.random.key(seed), max_new=int(max_new_tokens),
                               temperature=float(temperature), top_k=int(top_k), top_p=float(top_p)))
    return [[int(t) for t in row if t >= 0] for row in out]
