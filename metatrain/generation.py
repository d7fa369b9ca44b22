"""Text generation with a KV cache from a model's parameters (`generate(cfg, params, prompts)`): the model is
rebuilt from its config and decoded through its own blocks (`metatrain.models.decode`: a prefill pass, then one
token per step in a compiled loop). A LoRA run's model generates after its adapters are merged into the base
weights; `Transformer.generate` does the same for a model at hand (`hf.load`'s).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from metatrain import models
from metatrain.models import ModelConfig, decode


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
      top_k: draw among the k likeliest tokens only (0, or more than the vocabulary: all).
      top_p: draw among the likeliest tokens whose probabilities sum to top_p (1: all).
      seed: the draws' random key.
      eos: end-of-sequence id(s): a row stops after emitting one.

    Returns:
      Per prompt, the list of new token ids, up to and including the first EOS.
    """
    return decode.generate(model(cfg, params), prompts, max_new_tokens, temperature, top_k, top_p, seed, eos)


def model(cfg: ModelConfig, params: dict):
    """The NNX `Transformer` of `cfg` holding `params` (a pure dict); `decode.stream(model, ...)` generates from it
    a chunk at a time."""
    graphdef, state = models.abstract_init(cfg)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state)

