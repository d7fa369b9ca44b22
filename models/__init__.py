"""NNX transformers (Chinchilla blocks, and the Llama / Qwen2 options), the paper's size ladder, and the shapes of
public pretrained checkpoints."""

from __future__ import annotations

import jax
from flax import nnx

from metatrain.models.config import (
    LADDER,
    PRETRAINED_SHAPES,
    SMALL_PRESETS,
    ModelConfig,
    dtype_settings,
    param_count,
    preset,
    require_float64,
)
from metatrain.models.lora import LoRAConfig, split_adapters
from metatrain.models.transformer import Transformer, loss_targets, next_token_loss


def init(cfg: ModelConfig, key: jax.Array, lora: LoRAConfig | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """Builds the model and splits it once: a static graphdef and a pytree of parameters (LoRA adapters included
    when `lora.rank > 0`; `split_adapters` separates them)."""
    model = Transformer(cfg, lora, rngs=nnx.Rngs(params=key))
    return nnx.split(model)


def abstract_init(cfg: ModelConfig, lora: LoRAConfig | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """Like `init`, but with `jax.ShapeDtypeStruct` leaves: nothing is allocated."""
    model = nnx.eval_shape(lambda: Transformer(cfg, lora, rngs=nnx.Rngs(params=0)))
    return nnx.split(model)


__all__ = ["LADDER", "PRETRAINED_SHAPES", "SMALL_PRESETS", "LoRAConfig", "ModelConfig", "Transformer", "abstract_init",
           "dtype_settings", "init", "loss_targets", "next_token_loss", "param_count", "preset", "require_float64",
           "split_adapters"]
