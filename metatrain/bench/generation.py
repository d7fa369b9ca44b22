"""`metatrain bench generate`: seconds per new token with the KV cache against re-running the whole sequence.

Both generate greedily from the same random model and prompt, after one untimed call that compiles them. The
cache: `generation.generate` (a prefill, then one token per compiled step). Without it: every step runs the
model's full forward over the prompt and all the new-token slots ([batch, prompt + new], one compiled shape; the
causal mask keeps the empty slots from changing a logit) and takes the next token from the last filled position.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def measure(cfg, prompt_len: int = 32, new_tokens: int = 256, batch: int = 1, seed: int = 0) -> dict:
    """{seconds per token with and without the cache, their ratio, and the settings}; the two token sequences are
    checked to be the same."""
    from metatrain import aot, models

    # the parameters alone, before they are allocated (they were, then the process was killed for memory)
    aot.check_bytes_fit(models.param_count(cfg) * jnp.dtype(cfg.param_dtype).itemsize, "the model's parameters take",
                        FIX)
    with aot.out_of_memory("generating", FIX):
        return _measure(cfg, prompt_len, new_tokens, batch, seed)


FIX = "use a smaller model (--model, --n-layers) or fewer tokens (--batch, --prompt-len, --new-tokens)"


def _measure(cfg, prompt_len: int, new_tokens: int, batch: int, seed: int) -> dict:
    from flax import nnx

    from metatrain import models
    from metatrain.generation import generate

    graphdef, state = models.init(cfg, jax.random.key(seed))
    params = nnx.to_pure_dict(state)
    prompts = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, prompt_len)).tolist()

    def cached():
        return generate(cfg, params, prompts, new_tokens, eos=None)

    model = nnx.merge(graphdef, state)
    total = prompt_len + new_tokens

    @jax.jit
    def next_token(tokens, length):  # tokens [batch, total]: the full forward, the logits at position length - 1
        logits = model(tokens)
        return jnp.argmax(jax.lax.dynamic_index_in_dim(logits, length - 1, axis=1, keepdims=False), -1)

    def uncached():
        tokens = np.zeros((batch, total), np.int32)
        tokens[:, :prompt_len] = prompts
        tokens = jnp.asarray(tokens)
        for t in range(new_tokens):
            nxt = next_token(tokens, prompt_len + t)
            tokens = tokens.at[:, prompt_len + t].set(nxt.astype(jnp.int32))
        return np.asarray(tokens[:, prompt_len:]).tolist()

    out = {}
    for name, fn in (("cached", cached), ("uncached", uncached)):
        result = fn()  # compiles
        tic = time.perf_counter()
        result = fn()
        jax.block_until_ready(result) if not isinstance(result, list) else None
        out[name] = {"seconds": time.perf_counter() - tic, "tokens": result}
    same = out["cached"]["tokens"] == out["uncached"]["tokens"]
    per = {k: v["seconds"] / new_tokens for k, v in out.items()}
    return {"params": models.param_count(cfg), "d_model": cfg.d_model, "n_layers": cfg.n_layers,
            "vocab_size": cfg.vocab_size, "prompt_len": prompt_len, "new_tokens": new_tokens, "batch": batch,
            "seconds_per_token_cached": per["cached"], "seconds_per_token_uncached": per["uncached"],
            "speedup": per["uncached"] / per["cached"], "same_tokens": same}
