"""Decoding with a KV cache: a prefill pass over the prompts fills the cache, then one token per step in a
compiled `lax.while_loop` of up to `CHUNK` steps per call (`stream` yields between calls, where a Ctrl-C is
seen), both through the model's own blocks (`Transformer.cached_logits`).

Prompts of different lengths share a batch left-padded: row b's prompt takes the last L_b of P slots, its
positions count from 0 at its first token, and keys in its padding slots are never attended to. Every step writes
the same cache slot for all rows (P + t, at position L_b + t).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def choose(logits, key, temperature: float, top_k: int, top_p: float):
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


CHUNK = 16  # tokens per compiled call: Ctrl-C / SIGTERM (KeyboardInterrupt) is seen between calls


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "temperature", "top_k", "top_p"))
def _prefill(graphdef, state, tokens, lengths, eos, key, *, max_new: int, temperature: float, top_k: int,
             top_p: float):
    """The prompts through the model into a new cache; the first new token. Returns the decode carry."""
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    b, p = tokens.shape
    total = p + max_new
    slots = jnp.arange(total)
    start = p - lengths  # row b's first real slot
    shape = (cfg.n_layers, b, total, cfg.kv_heads, cfg.head_dim)
    cache = (jnp.zeros(shape, cfg.activation_dtype), jnp.zeros(shape, cfg.activation_dtype))
    real = slots[None, :] >= start[:, None]  # [B, T]: not padding
    positions = jnp.maximum(jnp.arange(p)[None, :] - start[:, None], 0)
    visible = real[:, None, :] & (slots[None, None, :] <= jnp.arange(p)[None, :, None])
    logits, cache = model.cached_logits(tokens, positions, cache, 0, visible)
    key, sub = jax.random.split(key)
    first = choose(logits, sub, temperature, top_k, top_p)
    out = jnp.full((b, max_new), -1, jnp.int32).at[:, 0].set(first)
    return jnp.int32(1), first, cache, out, jnp.isin(first, eos), key


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "top_k", "top_p"), donate_argnums=(6,))
def _steps(graphdef, state, tokens, lengths, eos, stop, carry, *, temperature: float, top_k: int, top_p: float):
    """Decode steps from `carry` until step `stop` (or every row has ended); returns the carry."""
    model = nnx.merge(graphdef, state)
    b, p = tokens.shape
    max_new = carry[3].shape[1]
    slots = jnp.arange(p + max_new)
    real = slots[None, :] >= (p - lengths)[:, None]

    def cond(carry):
        t, _, _, _, done, _ = carry
        return (t < stop) & ~done.all()

    def step(carry):
        t, last, cache, out, done, key = carry
        slot = p + t - 1  # where the last chosen token goes
        visible = (real & (slots[None, :] <= slot))[:, None, :]
        logits, cache = model.cached_logits(last[:, None], (lengths + t - 1)[:, None], cache, slot, visible)
        key, sub = jax.random.split(key)
        nxt = jnp.where(done, -1, choose(logits, sub, temperature, top_k, top_p))
        return t + 1, nxt, cache, out.at[:, t].set(nxt), done | jnp.isin(nxt, eos), key

    return jax.lax.while_loop(cond, step, carry)


def cache_bytes(cfg, prompts: int, tokens: int) -> int:
    """The KV cache's size for `prompts` rows of `tokens` slots (the longest prompt plus the new tokens)."""
    return 2 * cfg.n_layers * prompts * tokens * cfg.kv_heads * cfg.head_dim * jnp.dtype(cfg.activation_dtype).itemsize


def _prompt_tokens(cfg, prompts, max_new_tokens, temperature, top_k, top_p) -> tuple[np.ndarray, np.ndarray]:
    """The prompts left-padded into one array [batch, longest] and their lengths, after checking every argument:
    a ValueError in one line where one is out of its range (an id past the vocabulary would be read as another)."""
    if cfg.head != "lm":
        raise ValueError("generate: a model with a score head has no next-token logits")
    if isinstance(prompts, (str, bytes)):
        raise ValueError("generate: prompts is text; give a list of prompts, each a list of token ids (encode the "
                         "text with the model's tokenizer first)")
    if len(prompts) and np.ndim(prompts[0]) == 0 and np.asarray(prompts[0]).dtype.kind in "iu":  # [3, 7, 1]
        raise ValueError("generate: prompts is one list of token ids; give a list of prompts ([ids] for one) or a "
                         "[batch, seq] array")
    unsized = next((i for i, x in enumerate(prompts) if not hasattr(x, "__len__")), None)
    if unsized is not None:
        raise ValueError(f"generate: prompt {unsized} is not a list of token ids (whole numbers)")
    if len(prompts) == 0 or any(len(x) == 0 for x in prompts):
        raise ValueError("generate: give at least one prompt, each of at least one token")
    text = next((i for i, x in enumerate(prompts) if isinstance(x, (str, bytes))), None)
    if text is not None:
        raise ValueError(f"generate: prompt {text} is text; prompts are lists of token ids (encode the text with "
                         f"the model's tokenizer first)")
    whole, number = (int, np.integer), (int, float, np.number)
    for name, value, kinds, ok, want in (
            ("max_new_tokens", max_new_tokens, whole, lambda v: v >= 1, "a whole number >= 1"),
            ("temperature", temperature, number, lambda v: 0 <= v < math.inf, "a finite number >= 0 (0: greedy)"),
            ("top_k", top_k, whole, lambda v: v >= 0, "a whole number >= 0 (0: all tokens)"),
            ("top_p", top_p, number, lambda v: 0 < v <= 1, "a number in (0, 1]")):
        if isinstance(value, bool) or not isinstance(value, kinds) or not ok(value):  # (NaN passes no check)
            raise ValueError(f"generate: {name} must be {want}, got {value!r}")
    lengths = np.asarray([len(x) for x in prompts], np.int32)
    tokens = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for i, x in enumerate(prompts):
        try:
            ids = np.asarray(x)
        except ValueError:
            ids = np.asarray(None)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"generate: prompt {i} is not a list of token ids (whole numbers)")
        bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"generate: prompt {i} has token id {bad[0]}, outside the model's vocabulary of "
                             f"{cfg.vocab_size} (0 to {cfg.vocab_size - 1})")
        tokens[i, tokens.shape[1] - len(ids):] = ids
    return tokens, lengths


def stream(model, prompts: list[list[int]], max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0, seed: int = 0, eos: int | list[int] | None = None, chunk: int = CHUNK):
    """`generate`, a chunk at a time: yields the new tokens of every prompt so far after each compiled call of up
    to `chunk` steps (the last yield is `generate`'s result), so a caller can stop between calls."""
    tokens, lengths = _prompt_tokens(model.cfg, prompts, max_new_tokens, temperature, top_k, top_p)
    eos_ids = jnp.asarray([-2] if eos is None else np.atleast_1d(eos), jnp.int32)
    sampling = dict(temperature=float(temperature), top_k=min(int(top_k), model.cfg.vocab_size), top_p=float(top_p))
    graphdef, state = nnx.split(model)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    carry = _prefill(graphdef, state, tokens, lengths, eos_ids, jax.random.key(seed), max_new=int(max_new_tokens),
                     **sampling)
    while True:
        t, done, out = int(carry[0]), bool(np.asarray(carry[4]).all()), np.asarray(carry[3])
        yield [[int(x) for x in row if x >= 0] for row in out]
        if t >= max_new_tokens or done:
            return
        carry = _steps(graphdef, state, tokens, lengths, eos_ids, jnp.int32(min(t + chunk, max_new_tokens)), carry,
                       **sampling)


def generate(model, prompts: list[list[int]], max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eos: int | list[int] | None = None) -> list[list[int]]:
    """New tokens for each prompt from an NNX `Transformer` (`head="lm"`); see `metatrain.generation.generate`.
    A `top_k` above the vocabulary is all tokens."""
    *_, out = stream(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos)
    return out
