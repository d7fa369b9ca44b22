"""LoRA adapters on the transformer's projections (Hu et al., 2021): y = x W + (alpha / rank) · (x A) B.

A is [in..., rank] (random), B is [rank, out...] (zeros), so a model with fresh adapters computes what its base
weights compute. The adapters are `nnx.LoRAParam` variables beside the base `nnx.Param`s of each block, stacked
over layers like them, so `split_adapters` separates θ (the adapters) from the frozen base with one filter.

Why not `nnx.LoRA`: it wraps an `nnx.Linear` (a 2-D kernel applied as `x @ W`), while our projections are
einsums over [d_model, heads, head_dim] weights inside a scanned layer stack; the product is applied as
(x A) B, never as the parameter-sized A B.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from metatrain.errors import ConfigError

ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("up", "gate", "down")  # Hugging Face's up_proj (w_in), gate_proj (w_gate), down_proj (w_out)
TARGETS = ATTENTION_TARGETS + MLP_TARGETS


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """`rank` 0: no adapters (θ is the whole model). `targets`: comma-separated projections among q,k,v,o (attention)
    and up,gate,down (MLP; gate exists in SwiGLU models only and is skipped in GELU ones)."""

    rank: int = 0  # 0: no adapters (θ is the whole model); R > 0: θ is rank-R adapters on a frozen base
    alpha: float = 16.0  # adapters are applied as (alpha / rank) · x·A·B
    targets: str = ",".join(TARGETS)  # comma list among q,k,v,o,up,gate,down (gate: SwiGLU models only)

    def __post_init__(self):
        if self.rank < 0:
            raise ConfigError(f"inner.lora.rank must be >= 0 (0 = no LoRA), got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError(f"inner.lora.alpha must be a finite number > 0, got {self.alpha}")
        unknown = [t for t in self.target_set if t not in TARGETS]
        if unknown or not self.target_set:
            raise ConfigError(f"inner.lora.targets: {','.join(unknown) or 'nothing given'} is not among "
                              f"{','.join(TARGETS)}; give a comma-separated list, e.g. inner.lora.targets=q,v")

    @property
    def target_set(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in str(self.targets).split(",") if t.strip())

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def adapter(rngs: nnx.Rngs, in_shape: tuple, in_names: tuple, out_shape: tuple, out_names: tuple, rank: int,
            dtype) -> tuple[nnx.LoRAParam, nnx.LoRAParam]:
    """(A [in..., rank], B [rank, out...]) with logical axis names; A ~ N(0, 1/fan_in), B = 0."""
    fan_in = math.prod(in_shape)
    a = nnx.initializers.normal(fan_in**-0.5)(rngs.params(), in_shape + (rank,), dtype)
    make = lambda value, names: nnx.LoRAParam(value, out_sharding=names, eager_sharding=False)
    return make(a, in_names + (None,)), make(jnp.zeros((rank,) + out_shape, dtype), (None,) + out_names)


def attach(module, lora: LoRAConfig | None, shapes: dict, rngs: nnx.Rngs, dtype) -> None:
    """Gives `module` adapters `lora_{name}_a` / `lora_{name}_b` for each of its projections (`shapes`: name ->
    (in shape, in axis names, out shape, out axis names)) among lora's targets; sets `module.lora` (the names
    adapted) and `module.lora_scale`."""
    module.lora = tuple(t for t in lora.target_set if t in shapes) if lora else ()
    module.lora_scale = lora.scale if lora else 0.0
    for name in module.lora:
        a, b = adapter(rngs, *shapes[name], lora.rank, dtype)
        setattr(module, f"lora_{name}_a", a)
        setattr(module, f"lora_{name}_b", b)


def adapted(module, name: str, y, x, n_in: int = 1):
    """y + scale · (x A) B for projection `name` of `module` (y itself where it has no adapter), contracting x's
    last `n_in` axes with A's leading ones. x: [batch, seq, in...], y: [batch, seq, out...]."""
    if name not in module.lora:
        return y
    a = getattr(module, f"lora_{name}_a")[...].astype(x.dtype)
    b = getattr(module, f"lora_{name}_b")[...].astype(x.dtype)
    xa = jnp.tensordot(x, a, axes=n_in)  # [batch, seq, rank]
    return y + jnp.tensordot(xa, b * jnp.asarray(module.lora_scale, x.dtype), axes=1)


WEIGHTS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "up": "w_in", "gate": "w_gate", "down": "w_out"}


def merge(base: dict, adapters: dict, scale: float) -> dict:
    """Plain nested dicts of arrays (layer-stacked) → the base weights with each adapter folded in:
    W + scale · A B per layer. The result is a plain model's parameters (no adapters)."""
    out = dict(base)
    for key, sub in adapters.items():
        if key.startswith("lora_") and key.endswith("_a"):
            name = key[len("lora_"):-len("_a")]
            a, b = np.asarray(sub), np.asarray(adapters[f"lora_{name}_b"])  # [layers, in..., r], [layers, r, out...]
            w = np.asarray(base[WEIGHTS[name]])
            a, b_flat = a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], b.shape[1], -1)
            delta = np.einsum("lir,lro->lio", a, b_flat)  # [layers, in, out]
            out[WEIGHTS[name]] = (w + scale * delta.reshape(w.shape)).astype(w.dtype)
        elif isinstance(sub, dict):
            out[key] = merge(base[key], sub, scale)
    return out


def split_adapters(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """A model's parameters → (frozen base, adapters)."""
    adapters, base = nnx.split_state(state, nnx.LoRAParam, ...)
    return base, adapters
