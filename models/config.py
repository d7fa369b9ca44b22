"""Model configuration and the Chinchilla size ladder of the MixFlow-MG paper's Table 6 ("Chinchilla models from
Hoffmann et al. (2022a) used in scaling benchmarks")."""

from __future__ import annotations

import dataclasses
import difflib
import math

import jax
import jax.numpy as jnp

from metatrain.errors import ConfigError

REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable")
HEADS = ("lm", "score")
MLPS = ("gelu", "swiglu")
ROPE_SCALINGS = ("", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: Chinchilla blocks by default (RoPE, pre-norm RMSNorm, GELU MLP, tied
    embeddings); with `mlp="swiglu"`, `n_kv_heads`, `tie_embeddings=False`, `rope_scaling="llama3"` and
    `qkv_bias` the Llama / Qwen2 blocks of pretrained checkpoints.

    `head="lm"` gives next-token logits; `head="score"` gives one scalar per example
    (used by meta models, e.g. per-example loss weights).
    """

    vocab_size: int = 1024  # follows the tokenizer in runs (data.vocab_size)
    d_model: int = 128  # the residual stream width
    n_heads: int = 4  # attention heads
    n_kv_heads: int = 0  # key/value heads (grouped-query attention); 0 means n_heads, 1 is multi-query
    kv_size: int = 0  # per-head size; 0 means d_model // n_heads
    d_ff: int = 512  # the MLP hidden width
    n_layers: int = 2  # transformer blocks
    mlp: str = "gelu"  # gelu: w_out(gelu(w_in x)) | swiglu: w_out(silu(w_gate x) * w_in x)
    tie_embeddings: bool = True  # the output head is the transposed input embedding
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    head: str = "lm"  # lm: next-token logits | score: one scalar per example (pooled)
    causal: bool = True  # false: bidirectional attention (within each document); needs head=score
    rope_base: float = 10_000.0  # Hugging Face's rope_theta
    rope_scaling: str = ""  # "" | llama3 (Llama 3.1+ frequency scaling, with the four rope_* fields below)
    rope_factor: float = 8.0  # llama3 scaling: the frequency division factor
    # llama3 scaling: wavelengths above max_positions / this are divided by rope_factor
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below max_positions / this are kept
    rope_original_max_positions: int = 8192  # llama3 scaling: the context length the model was trained at
    norm_eps: float = 1e-6  # RMSNorm's epsilon
    remat: bool = False  # rematerialise each block in the backward pass
    remat_policy: str = "nothing_saveable"  # a jax.checkpoint_policies name
    param_dtype: str = "float32"  # dtype of the parameters: float32, bfloat16, float64 (needs JAX_ENABLE_X64=1)
    compute_dtype: str = ""  # matmuls and activations ("" = param_dtype); softmax and losses stay >= float32
    attention: str = "dense"  # dense | blockwise (online softmax over key blocks: no [batch, heads, S, S])
    attention_block: int = 512  # query and key block size of blockwise attention
    # 0: the next-token loss from [batch, seq, vocab] logits; N > 0: N positions at a time, each chunk's logits
    # recomputed in the backward pass (no [batch, seq, vocab] buffer; forward- and reverse-differentiable)
    loss_chunk: int = 0
    # true: the blocks run as one `lax.scan` loop over their stacked weights; false: as straight-line code (faster
    # on CPU for a few small blocks, where the loop's slicing and copies cost more than the blocks; longer compiles
    # for many). Blocks rematerialised by MixFlow's seeded backward scan stay a loop.
    scan_layers: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.n_kv_heads < 0 or (self.n_kv_heads and self.n_heads % self.n_kv_heads):
            raise ConfigError(f"model.n_kv_heads must divide model.n_heads={self.n_heads} (0 = n_heads), "
                              f"got {self.n_kv_heads}")
        if self.mlp not in MLPS:
            raise ConfigError(f"model.mlp must be one of {MLPS}, got {self.mlp!r}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ConfigError(f"model.rope_scaling must be one of {ROPE_SCALINGS} ('' = none), "
                              f"got {self.rope_scaling!r}")
        scaling = (self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor)
        if self.rope_scaling and not (all(map(math.isfinite, scaling)) and self.rope_factor > 0 and 0 <
                                      self.rope_low_freq_factor < self.rope_high_freq_factor and
                                      self.rope_original_max_positions > 0):
            raise ConfigError("model.rope_*: llama3 scaling needs finite rope_factor > 0, 0 < rope_low_freq_factor < "
                              "rope_high_freq_factor and rope_original_max_positions > 0")
        if not all(math.isfinite(v) and v > 0 for v in (self.rope_base, self.norm_eps)):
            raise ConfigError(f"model.rope_base and model.norm_eps must be finite numbers > 0, got {self.rope_base}, "
                              f"{self.norm_eps}")
        if self.kv_size < 0:
            raise ConfigError(f"model.kv_size must be >= 0 (0 = d_model // n_heads), got {self.kv_size}")
        if self.kv_size == 0 and self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "change one of them or set model.kv_size explicitly")
        if self.head_dim % 2:
            raise ConfigError(f"RoPE needs an even per-head size, got {self.head_dim}")
        if self.head not in HEADS:
            raise ConfigError(f"model.head must be one of {HEADS}, got {self.head!r}")
        if not self.causal and self.head == "lm":
            raise ConfigError("model.causal=false needs model.head=score: a next-token head must not see the tokens "
                              "it predicts")
        if self.remat_policy not in REMAT_POLICIES:
            raise ConfigError(f"model.remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
        if self.attention not in ("dense", "blockwise"):
            raise ConfigError(f"model.attention must be dense or blockwise, got {self.attention!r}")
        if self.attention_block <= 0:
            raise ConfigError(f"model.attention_block must be > 0, got {self.attention_block}")
        if self.loss_chunk < 0:
            raise ConfigError(f"model.loss_chunk must be >= 0 (0 = whole-sequence logits), got {self.loss_chunk}")
        if self.compute_dtype not in ("", "float32", "float64", "bfloat16"):
            raise ConfigError(f"model.compute_dtype must be float32, bfloat16 or empty (= param_dtype), "
                             f"got {self.compute_dtype!r}")
        if self.param_dtype not in ("float32", "float64", "bfloat16"):
            raise ConfigError(f"model.param_dtype must be float32, float64 or bfloat16, got {self.param_dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.kv_size or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dtype(self):
        return jnp.dtype(self.param_dtype)

    @property
    def activation_dtype(self):
        return jnp.dtype(self.compute_dtype or self.param_dtype)

    def replace(self, **changes) -> ModelConfig:
        """This config with `changes` (field=value); an unknown field is a `ConfigError` naming the nearest ones."""
        fields = [f.name for f in dataclasses.fields(self)]
        for name in changes:
            if name not in fields:
                near = difflib.get_close_matches(name, fields, n=3)
                raise ConfigError(f"ModelConfig has no field {name!r}"
                                  + (f"; did you mean {' or '.join(map(repr, near))}?" if near else
                                     f"; its fields: {', '.join(fields)}"))
        return dataclasses.replace(self, **changes)


def dtype_settings(cfg: ModelConfig, prefix: str = "model.") -> dict[str, str]:
    """The model's dtype settings by their keys (`{"model.param_dtype": ..., "model.compute_dtype": ...}`), for
    `require_float64`."""
    return {f"{prefix}{name}": getattr(cfg, name) for name in ("param_dtype", "compute_dtype")}


def require_float64(dtypes: dict[str, str], without: str = "JAX computes in float32") -> None:
    """Refuse float64 where JAX's 64-bit mode is off: JAX would make every float64 array float32 without a word.

    Args:
      dtypes: the dtype each setting asks for, by the setting's name (`{"model.param_dtype": "float64"}`).
      without: what happens without the mode, for the message.

    Raises:
      ConfigError: the first setting that asks for float64, and how to turn the mode on.
    """
    if jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64)) == jnp.float64:  # on (also inside jax.enable_x64)
        return
    for name, dtype in dtypes.items():
        if dtype == "float64":
            raise ConfigError(f"{name}=float64 needs JAX's 64-bit mode, which is off: run with JAX_ENABLE_X64=1 (or "
                              f"jax.config.update('jax_enable_x64', True) before anything else); without it {without}")


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters, counted from the shapes (no allocation)."""
    d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff
    attn = 2 * d * h * k + 2 * d * g * k + (cfg.qkv_bias and (h + 2 * g) * k)  # q, o; k, v; biases
    block = attn + (3 if cfg.mlp == "swiglu" else 2) * d * f + 2 * d  # MLP; two norms
    out = 0 if (cfg.head == "lm" and cfg.tie_embeddings) else d * (cfg.vocab_size if cfg.head == "lm" else 1)
    return cfg.vocab_size * d + cfg.n_layers * block + d + out


# name: (millions in the paper, d_model, ffw_size, kv_size, n_heads, n_layers)
LADDER = {
    "44m": (44, 512, 2048, 64, 8, 8),
    "90m": (90, 640, 2560, 64, 10, 13),
    "140m": (140, 768, 3072, 64, 12, 15),
    "196m": (196, 896, 3584, 64, 14, 16),
    "278m": (278, 1024, 4096, 64, 16, 18),
    "489m": (489, 1280, 5120, 128, 10, 21),
    "587m": (587, 1408, 5632, 128, 11, 21),
    "724m": (724, 1536, 6144, 128, 12, 22),
    "1b": (1018, 1792, 7168, 128, 14, 23),
    "1.4b": (1429, 2048, 8192, 128, 16, 25),
    "1.6b": (1609, 2176, 8704, 128, 17, 25),
    "2b": (2007, 2304, 9216, 128, 18, 28),
    "2.6b": (2639, 2560, 10240, 128, 20, 30),
    "3.8b": (3802, 2816, 11264, 128, 22, 36),
    "4.5b": (4516, 3072, 12288, 128, 24, 36),
    "6.8b": (6796, 3584, 14336, 128, 28, 40),
    "9.3b": (9293, 4096, 16384, 128, 32, 42),
    "11.5b": (11452, 4352, 17408, 128, 32, 47),
    "12.3b": (12295, 4608, 18432, 128, 36, 44),
    "12.6b": (12569, 4608, 18432, 128, 32, 47),
    "13.7b": (13735, 4864, 19456, 128, 32, 47),
    "16b": (16183, 5120, 20480, 128, 40, 47),
}
LADDER_VOCAB = 32_000  # Chinchilla's SentencePiece vocabulary

SMALL_PRESETS = {  # for tests, check-grads and CPU benchmarks
    "tiny": ModelConfig(vocab_size=64, d_model=16, n_heads=2, d_ff=32, n_layers=2),
    # every Llama/Qwen2 option at once: SwiGLU, grouped-query attention, untied head, q/k/v biases, llama3 RoPE
    "tiny-llama": ModelConfig(vocab_size=64, d_model=16, n_heads=4, n_kv_heads=2, d_ff=24, n_layers=2, mlp="swiglu",
                              tie_embeddings=False, qkv_bias=True, rope_base=500_000.0, rope_scaling="llama3",
                              rope_factor=4.0, rope_original_max_positions=16, norm_eps=1e-5),
    "small": ModelConfig(vocab_size=1024, d_model=64, n_heads=4, d_ff=256, n_layers=2),
    "bench": ModelConfig(vocab_size=1024, d_model=128, n_heads=4, d_ff=512, n_layers=8),
}


# Shapes of public pretrained checkpoints (their config.json; no weights): for memory planning and compile checks
_LLAMA = dict(mlp="swiglu", norm_eps=1e-5)
PRETRAINED_SHAPES = {
    "smollm2-135m": ModelConfig(vocab_size=49152, d_model=576, n_heads=9, n_kv_heads=3, d_ff=1536, n_layers=30,
                                rope_base=100_000.0, **_LLAMA),
    "smollm2-360m": ModelConfig(vocab_size=49152, d_model=960, n_heads=15, n_kv_heads=5, d_ff=2560, n_layers=32,
                                rope_base=100_000.0, **_LLAMA),
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, d_model=896, n_heads=14, n_kv_heads=2, d_ff=4864, n_layers=24,
                                rope_base=1_000_000.0, qkv_bias=True, mlp="swiglu", norm_eps=1e-6),
    "llama3.2-1b": ModelConfig(vocab_size=128256, d_model=2048, n_heads=32, n_kv_heads=8, d_ff=8192, n_layers=16,
                               rope_base=500_000.0, rope_scaling="llama3", rope_factor=32.0, **_LLAMA),
    "tinyllama-1.1b": ModelConfig(vocab_size=32000, d_model=2048, n_heads=32, n_kv_heads=4, d_ff=5632, n_layers=22,
                                  tie_embeddings=False, **_LLAMA),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named model: a ladder size (`44m` ... `16b`), a pretrained checkpoint's shape (`llama3.2-1b`, ...) or a
    tiny one (`tiny`, `tiny-llama`, `small`, `bench`)."""
    key = name.lower()
    if key in PRETRAINED_SHAPES:
        base = PRETRAINED_SHAPES[key]
    elif key in LADDER:
        _, d, f, k, h, n = LADDER[key]
        base = ModelConfig(vocab_size=LADDER_VOCAB, d_model=d, d_ff=f, kv_size=k, n_heads=h, n_layers=n)
    elif key in SMALL_PRESETS:
        base = SMALL_PRESETS[key]
    else:
        raise ConfigError(f"unknown model preset {name!r}; choose one of "
                          f"{sorted(SMALL_PRESETS) + list(LADDER) + list(PRETRAINED_SHAPES)}")
    return base.replace(**overrides)
