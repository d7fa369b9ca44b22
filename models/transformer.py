"""Chinchilla transformer in Flax NNX: RoPE, pre-norm blocks stacked along a `layers` axis and
applied by a `lax.scan`, with optional per-block rematerialisation. The Llama / Qwen2 options
(SwiGLU, grouped-query attention, untied head, q/k/v biases, llama3 RoPE scaling) are plain JAX on
the same path, so forward-mode and forward-over-reverse differentiation work through them too.

Parameters carry logical axis names (`vocab`, `embed`, `heads`, `kv_heads`, `kv`, `mlp`, `layers`) that the
Trainer maps onto a device mesh. Only the block stack is scanned: with a Python loop over remat'd
blocks XLA:CPU schedules the recomputations early and block remat saves almost nothing, while a scan
with remat on its body bounds activation memory on CPU as on TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from metatrain.models import decode, grad_seed
from metatrain.models.config import ModelConfig
from metatrain.models.dense import dense
from metatrain.models.lora import WEIGHTS, LoRAConfig, adapted, attach

# The mesh axes a batch is split over (`metatrain.sharding`'s data x fsdp). Under FSDP the weights are split along
# `embed`; left to itself, XLA's sharding propagation carries that split into the activations and every device
# computes its member's whole batch. `batch_sharded` pins the activations' batch axis to these mesh axes.
BATCH_AXES = ("data", "fsdp")


def batch_sharded(x: jax.Array) -> jax.Array:
    """`x` with its leading (batch) axis split over the data x fsdp axes of the mesh set by `jax.set_mesh` (as the
    Trainer traces its step), where there is such a mesh of more than one device and it divides the batch; else
    `x` itself. Under `jax.vmap(..., spmd_axis_name=...)` the mapped axis keeps its own mesh axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
        return x
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    if n == 1 or x.shape[0] % n:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(BATCH_AXES))


def _param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)


def compute_dtype(dtype) -> jnp.dtype:
    """Softmax and losses run in at least float32 (float64 stays float64 for gradient checks)."""
    return jnp.promote_types(dtype, jnp.float32)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.scale = _param(rngs, nnx.initializers.ones, (cfg.d_model,), ("embed",), cfg.dtype)
        self.eps = cfg.norm_eps

    def __call__(self, x):  # [..., d_model]
        return rms_norm(x, self.scale[...], self.eps)


def rms_norm(x, scale, eps: float):
    """x / RMS(x) · scale over the last axis, in at least float32, returned in x's dtype."""
    x32 = x.astype(compute_dtype(x.dtype))
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(y.dtype)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig, dtype) -> jax.Array:
    """RoPE's inverse wavelengths [k/2]: base^(-2i/k), with `rope_scaling="llama3"` divided by `rope_factor` for
    wavelengths above original_max/low_freq_factor, kept below original_max/high_freq_factor, blended between."""
    half = cfg.head_dim // 2
    freq = cfg.rope_base ** (-jnp.arange(half, dtype=dtype) / half)  # [k/2]
    if cfg.rope_scaling == "llama3":
        wavelength = 2 * jnp.pi / freq
        ratio = cfg.rope_original_max_positions / wavelength  # periods that fit in the original context
        blend = (ratio - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        scaled = (1 - blend) * freq / cfg.rope_factor + blend * freq
        freq = jnp.where(ratio < cfg.rope_low_freq_factor, freq / cfg.rope_factor,
                         jnp.where(ratio > cfg.rope_high_freq_factor, freq, scaled))
    return freq


def rope(x, positions, freq):
    """Rotary position embedding, rotate-half form. x: [batch, seq, heads, k]; positions: [batch, seq];
    freq: [k/2] from `rope_frequencies`."""
    half = x.shape[-1] // 2
    freq = freq.astype(compute_dtype(x.dtype))
    angle = positions[..., None].astype(freq.dtype) * freq  # [batch, seq, k/2]
    sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention_mask(segment_ids, causal: bool = True):
    """Causal (or, with `causal=False`, bidirectional) mask that never crosses documents.
    segment_ids: [batch, seq] → [batch, 1, seq, seq]. Built from iota and broadcast comparisons so XLA fuses it
    into its consumer: no S² buffer."""
    s = segment_ids.shape[1]
    pos = jax.lax.broadcasted_iota(jnp.int32, (1, 1, s, s), 2), jax.lax.broadcasted_iota(jnp.int32, (1, 1, s, s), 3)
    same_doc = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return ((pos[0] >= pos[1]) & same_doc) if causal else same_doc


def dense_attention(q, k, v, mask):
    """q, k, v: [batch, seq, heads, k]; mask: [batch, 1, seq, seq] → [batch, seq, heads, k]."""
    q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=compute_dtype(q.dtype))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [batch, heads, q, s]
    return jnp.einsum("bhqs,bshk->bqhk", probs, v)


def blockwise_attention(q, k, v, segment_ids, block: int, causal: bool = True):
    """Causal (or bidirectional) attention over key/value blocks with an online (running max, running sum) softmax.

    Equal to `dense_attention` with `attention_mask(segment_ids, causal)`, but the largest score buffer is
    [batch, heads, block, block]: queries go block by block (a `lax.map`), and for each query block a
    `lax.scan` over key blocks carries the running max `m`, sum `l` and output `acc`. Both loop bodies
    are rematerialised, so reverse mode keeps only the blocks' inputs and carries, O(S·heads·k), never
    [batch, heads, S, S]; forward mode and forward-over-reverse differentiate the same plain JAX.
    FLOPs: the same score and value products as dense (all S x S, masked ones included), plus their
    recomputation in the backward pass. S need not be a multiple of `block` (padded, then cut).

    q, k, v: [batch, seq, heads, k]; segment_ids: [batch, seq] → [batch, seq, heads, k].
    """
    b, s, h, d = q.shape
    block = min(block, s)
    n = -(-s // block)
    pad = n * block - s
    q = q * jnp.asarray(d**-0.5, q.dtype)
    blocks = lambda x: jnp.moveaxis(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(
        (b, n, block) + x.shape[2:]), 1, 0)  # [n, batch, block, ...]
    qb, kb, vb, segb = blocks(q), blocks(k), blocks(v), blocks(segment_ids)
    posb = jnp.arange(n * block).reshape(n, block)
    f = compute_dtype(q.dtype)

    @jax.checkpoint
    def query_block(args):
        qi, seg_q, pos_q = args  # [batch, block, heads, k], [batch, block], [block]

        @jax.checkpoint
        def key_block(carry, kv):
            m, l, acc = carry  # [batch, heads, block], same, [batch, heads, block, k]
            kj, vj, seg_k, pos_k = kv
            scores = jnp.einsum("bqhk,bshk->bhqs", qi, kj, preferred_element_type=f)  # [batch, heads, bq, bs]
            order = pos_q[:, None] >= pos_k[None, :] if causal else jnp.ones((block, block), bool)
            mask = (order & (pos_k < s)[None, :])[None, None] & (
                seg_q[:, None, :, None] == seg_k[:, None, None, :])
            scores = jnp.where(mask, scores, jnp.finfo(f).min)  # before exp: no inf whose 0-gradient is NaN
            m_new = jnp.maximum(m, scores.max(-1))
            p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
            scale = jnp.exp(m - m_new)
            acc = acc * scale[..., None] + jnp.einsum("bhqs,bshk->bhqk", p.astype(v.dtype), vj,
                                                       preferred_element_type=f)
            return (m_new, l * scale + p.sum(-1), acc), None

        init = (jnp.full((b, h, block), jnp.finfo(f).min, f), jnp.zeros((b, h, block), f),
                jnp.zeros((b, h, block, d), f))
        (m, l, acc), _ = jax.lax.scan(key_block, init, (kb, vb, segb, posb))
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # padded query rows see no key: 0, not NaN
        return jnp.moveaxis(out, 1, 2).astype(v.dtype)  # [batch, block, heads, k]

    out = jax.lax.map(query_block, (qb, segb, posb))  # [n, batch, block, heads, k]
    return jnp.moveaxis(out, 0, 1).reshape(b, n * block, h, d)[:, :s]


class Attention(nnx.Module):
    """Multi-head attention; with `n_kv_heads < n_heads` grouped-query (query head i reads key/value head
    i // (n_heads / n_kv_heads), as in Llama and Qwen2). With `lora`, adapters on its targets among q, k, v, o."""

    def __init__(self, cfg: ModelConfig, lora: LoRAConfig | None = None, *, rngs: nnx.Rngs):
        d, h, g, k, dt = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.dtype
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=0, out_axis=(1, 2))
        self.wq = _param(rngs, init, (d, h, k), ("embed", "heads", "kv"), dt)
        self.wk = _param(rngs, init, (d, g, k), ("embed", "kv_heads", "kv"), dt)
        self.wv = _param(rngs, init, (d, g, k), ("embed", "kv_heads", "kv"), dt)
        if cfg.qkv_bias:
            zeros = nnx.initializers.zeros
            self.bq = _param(rngs, zeros, (h, k), ("heads", "kv"), dt)
            self.bk = _param(rngs, zeros, (g, k), ("kv_heads", "kv"), dt)
            self.bv = _param(rngs, zeros, (g, k), ("kv_heads", "kv"), dt)
        out_init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=(0, 1), out_axis=2)
        self.wo = _param(rngs, out_init, (h, k, d), ("heads", "kv", "embed"), dt)
        self.cfg = cfg
        self.kind, self.block, self.causal = cfg.attention, cfg.attention_block, cfg.causal
        model, heads, kv_heads = ((d,), ("embed",)), ((h, k), ("heads", "kv")), ((g, k), ("kv_heads", "kv"))
        attach(self, lora, {"q": model + heads, "k": model + kv_heads, "v": model + kv_heads, "o": heads + model},
               rngs, dt)

    def _project(self, x, name):  # [batch, seq, d_model] -> [batch, seq, heads, k]
        y = adapted(self, name, jnp.einsum("bsd,dhk->bshk", x, getattr(self, "w" + name)[...].astype(x.dtype)), x)
        return y + getattr(self, "b" + name)[...].astype(x.dtype) if self.cfg.qkv_bias else y

    def _qkv(self, x, positions):  # queries [batch, seq, heads, k]; keys and values [batch, seq, kv_heads, k]
        freq = rope_frequencies(self.cfg, jnp.float32)
        return rope(self._project(x, "q"), positions, freq), rope(self._project(x, "k"), positions, freq), \
            self._project(x, "v")

    def _grouped(self, k, v):  # each key/value head serves `groups` consecutive query heads
        groups = self.cfg.n_heads // self.cfg.kv_heads
        return (jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)) if groups > 1 else (k, v)

    def _output(self, out, x):  # [batch, seq, heads, k] -> [batch, seq, d_model]
        return adapted(self, "o", jnp.einsum("bshk,hkd->bsd", out, self.wo[...].astype(x.dtype)), out, n_in=2)

    def __call__(self, x, positions, segment_ids):  # x: [batch, seq, d_model]
        q, k, v = self._qkv(x, positions)
        k, v = self._grouped(k, v)
        if self.kind == "blockwise":
            out = blockwise_attention(q, k, v, segment_ids, self.block, self.causal)
        else:
            out = dense_attention(q, k, v, attention_mask(segment_ids, self.causal))
        return self._output(out, x)

    def cached(self, x, positions, cache, write_at, visible):
        """Attention of new tokens x [batch, seq, d_model] at `positions` [batch, seq] over a key/value cache
        (k, v: [batch, slots, kv_heads, k]), their own keys and values first written into it at slot `write_at`;
        `visible` [batch, seq, slots] says which slots each new token sees. Returns (output, the updated cache)."""
        q, k, v = self._qkv(x, positions)
        put = lambda c, new: jax.lax.dynamic_update_slice(c, new.astype(c.dtype), (0, write_at, 0, 0))
        cache = put(cache[0], k), put(cache[1], v)
        k, v = self._grouped(*cache)
        return self._output(dense_attention(q, k.astype(q.dtype), v, visible[:, None]), x), cache


class MLP(nnx.Module):
    """GELU: w_out(gelu(w_in x)). SwiGLU: w_out(silu(w_gate x) * w_in x) (Hugging Face's up_proj = w_in,
    gate_proj = w_gate, down_proj = w_out). With `lora`, adapters on its targets among up, gate, down."""

    def __init__(self, cfg: ModelConfig, lora: LoRAConfig | None = None, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w_in = _param(rngs, init, (cfg.d_model, cfg.d_ff), ("embed", "mlp"), cfg.dtype)
        if cfg.mlp == "swiglu":
            self.w_gate = _param(rngs, init, (cfg.d_model, cfg.d_ff), ("embed", "mlp"), cfg.dtype)
        self.w_out = _param(rngs, init, (cfg.d_ff, cfg.d_model), ("mlp", "embed"), cfg.dtype)
        self.kind = cfg.mlp
        model, ff = ((cfg.d_model,), ("embed",)), ((cfg.d_ff,), ("mlp",))
        shapes = {"up": model + ff, "down": ff + model} | ({"gate": model + ff} if cfg.mlp == "swiglu" else {})
        attach(self, lora, shapes, rngs, cfg.dtype)

    def _matmul(self, x, name):  # x @ W (+ its low-rank update)
        return adapted(self, name, dense(x, getattr(self, WEIGHTS[name])[...].astype(x.dtype)), x)

    def __call__(self, x):  # [batch, seq, d_model]
        h = self._matmul(x, "up")  # [batch, seq, d_ff]
        if self.kind == "swiglu":
            h = jax.nn.silu(self._matmul(x, "gate")) * h
        else:
            h = jax.nn.gelu(h)
        return self._matmul(h, "down")


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, lora: LoRAConfig | None = None, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg, rngs=rngs)
        self.attn = Attention(cfg, lora, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg, rngs=rngs)
        self.mlp = MLP(cfg, lora, rngs=rngs)

    def __call__(self, x, positions, segment_ids):
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        return x + self.mlp(self.mlp_norm(x))

    def cached(self, x, positions, cache, write_at, visible):
        """The block over new tokens with the attention's key/value cache (`Attention.cached`)."""
        h, cache = self.attn.cached(self.attn_norm(x), positions, cache, write_at, visible)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache


class Transformer(nnx.Module):
    """Decoder-only transformer. `__call__(tokens)` gives logits [batch, seq, vocab] for `head="lm"`
    and one score per example [batch] for `head="score"` (mean over the sequence's valid positions). With `lora`
    (rank > 0) each block also holds LoRA adapters (`nnx.LoRAParam`, see `lora.py`)."""

    def __init__(self, cfg: ModelConfig, lora: LoRAConfig | None = None, *, rngs: nnx.Rngs):
        lora = lora if lora is not None and lora.rank > 0 else None
        self.cfg = cfg
        embed_init = nnx.initializers.normal(cfg.d_model**-0.5)
        self.embed = _param(rngs, embed_init, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.dtype)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, lora, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg, rngs=rngs)
        if cfg.head == "score":
            self.out = _param(rngs, nnx.initializers.zeros, (cfg.d_model, 1), ("embed", None), cfg.dtype)
        elif not cfg.tie_embeddings:
            self.out = _param(rngs, nnx.initializers.lecun_normal(), (cfg.d_model, cfg.vocab_size),
                              ("embed", "vocab"), cfg.dtype)

    def __call__(self, tokens, segment_ids=None, positions=None):
        """tokens, segment_ids, positions: int [batch, seq]. segment_ids 0 marks padding."""
        x = self.features(tokens, segment_ids, positions)  # [batch, seq, d_model]
        if self.cfg.head == "score":
            if segment_ids is None:
                segment_ids = jnp.ones(tokens.shape, jnp.int32)
            valid = (segment_ids > 0).astype(x.dtype)[..., None]  # [batch, seq, 1]
            pooled = (x * valid).sum(1) / jnp.maximum(valid.sum(1), 1)  # [batch, d_model]
            return (pooled @ self.out[...].astype(x.dtype))[:, 0]  # [batch]
        return dense(x, self.unembedding.astype(x.dtype))  # [batch, seq, vocab]: the loss takes it to float32

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, eos: int | list[int] | None = None) -> list[list[int]]:
        """New tokens per prompt (token-id lists), with a KV cache: see `metatrain.generation.generate`. `eos`
        defaults to the model's own (`eos_token_id`, set by `hf.load`)."""
        return decode.generate(self, prompts, max_new_tokens, temperature, top_k, top_p, seed,
                               getattr(self, "eos_token_id", None) if eos is None else eos)

    def cached_logits(self, tokens, positions, cache, write_at, visible):
        """The next-token logits (float32) of the last of new tokens [batch, seq] at `positions`, through every
        block with its key/value cache (k, v: [layers, batch, slots, kv_heads, k]; see `Attention.cached`).
        Returns (logits [batch, vocab], the updated cache)."""
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.activation_dtype)
        graphdef, stacked = nnx.split(self.blocks)

        def body(x, layer):
            block_state, k, v = layer
            return nnx.merge(graphdef, block_state).cached(x, positions, (k, v), write_at, visible)

        x, cache = jax.lax.scan(body, x, (stacked, *cache))
        x = self.final_norm(x[:, -1])
        return (x @ self.unembedding.astype(x.dtype)).astype(jnp.float32), cache

    @property
    def unembedding(self) -> jax.Array:  # [d_model, vocab]
        return self.embed[...].T if self.cfg.tie_embeddings else self.out[...]

    def example_losses(self, tokens, segment_ids=None, positions=None, loss_mask=None) -> jax.Array:
        """Per-example mean next-token loss of a batch of sequences, [batch]: tokens (and segment_ids, positions,
        loss_mask) [batch, seq + 1], predicting tokens[:, 1:] from tokens[:, :-1]. The mean is over the targets
        that are not padding and, with `loss_mask`, are marked 1 there (a conversation's assistant tokens). With
        `loss_chunk` > 0 the logits are made `loss_chunk` positions at a time (`chunked_next_token_loss`)."""
        if isinstance(tokens, (list, tuple)):
            tokens = jnp.asarray(tokens)
        self._check_ids(tokens[:, -1:])  # the last targets: the model's call checks the inputs, the other targets
        cut = lambda a, sl: None if a is None else a[:, sl]
        inputs = (tokens[:, :-1], cut(segment_ids, slice(None, -1)), cut(positions, slice(None, -1)))
        targets = loss_targets(segment_ids, loss_mask)
        if not self.cfg.loss_chunk:
            return next_token_loss(self(*inputs), tokens[:, 1:], targets)
        return chunked_next_token_loss(self.features(*inputs), self.unembedding, tokens[:, 1:], targets,
                                       self.cfg.loss_chunk)

    def _check_ids(self, tokens) -> None:
        """Called eagerly (under jit the ids are not known, and nothing is checked), ids outside the vocabulary are
        refused: an id past the embedding gave NaN logits (JAX's gather fills), a negative one a row counted from
        the end, and neither said why."""
        # in NumPy (jnp.min would be traced under jit); an array split over other hosts' devices is not read
        if tokens.size and not isinstance(tokens, jax.core.Tracer) and getattr(tokens, "is_fully_addressable", True):
            ids = np.asarray(tokens)
            lo, hi, vocab = int(ids.min()), int(ids.max()), self.cfg.vocab_size
            if lo < 0 or hi >= vocab:
                raise ValueError(f"token id {hi if hi >= vocab else lo} is outside the model's vocabulary "
                                 f"[0, {vocab}); encode with the model's own tokenizer")

    def features(self, tokens, segment_ids=None, positions=None):
        """The final normalised hidden states, [batch, seq, d_model]."""
        if isinstance(tokens, (list, tuple)):
            tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):  # (static: no cost under jit)
            raise ValueError(f"the model takes token ids, integers [batch, seq]; got {tokens.dtype} of shape "
                             f"{tuple(tokens.shape)}")
        self._check_ids(tokens)
        b, s = tokens.shape
        if segment_ids is None:
            segment_ids = jnp.ones((b, s), jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s), (b, s))
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.activation_dtype)  # [batch, seq, d_model]
        x = batch_sharded(x)

        graphdef, stacked = nnx.split(self.blocks)
        seeds = grad_seed.lookup(stacked) if grad_seed.seedable(self.cfg) else None
        if seeds is not None:  # inside MixFlow's Hessian-vector product: θ̄ + H ḡ accumulated in place
            apply = lambda state, h, pos, seg: batch_sharded(nnx.merge(graphdef, state)(h, pos, seg))
            return self.final_norm(grad_seed.scan(apply, x, stacked, seeds, (positions, segment_ids)))

        def body(x, block_state):
            return batch_sharded(nnx.merge(graphdef, block_state)(x, positions, segment_ids)), None

        if self.cfg.remat:
            body = jax.checkpoint(body, policy=getattr(jax.checkpoint_policies, self.cfg.remat_policy))
        x, _ = jax.lax.scan(body, x, stacked, unroll=not self.cfg.scan_layers)
        return self.final_norm(x)


def loss_targets(segment_ids=None, loss_mask=None):
    """The targets a sequence's next-token loss counts, [batch, seq] (> 0 where one counts: not padding and, with
    `loss_mask`, marked there: a conversation's assistant tokens), from segment_ids and loss_mask [batch, seq + 1];
    None where every target counts."""
    targets = None if segment_ids is None else segment_ids[:, 1:]
    if loss_mask is not None:
        targets = (jnp.ones_like(loss_mask[:, 1:]) if targets is None else targets) * (loss_mask[:, 1:] > 0)
    return targets


def next_token_loss(logits, tokens_out, segment_ids=None):
    """Per-example mean cross-entropy. logits: [batch, seq, vocab]; tokens_out: [batch, seq] → [batch]."""
    logits = logits.astype(compute_dtype(logits.dtype))
    # one-hot rather than a gather: it fuses (iota compare), where a gather's transpose is a scatter
    target = jax.nn.one_hot(tokens_out, logits.shape[-1], dtype=logits.dtype)
    nll = jax.nn.logsumexp(logits, axis=-1) - jnp.sum(target * logits, axis=-1)  # [batch, seq]
    if segment_ids is None:
        return nll.mean(-1)
    valid = (segment_ids > 0).astype(nll.dtype)
    return (nll * valid).sum(-1) / jnp.maximum(valid.sum(-1), 1)


def chunked_next_token_loss(x, w_out, tokens_out, segment_ids=None, chunk: int = 512):
    """`next_token_loss(x @ w_out, tokens_out, segment_ids)` made `chunk` positions at a time: a scan over
    sequence chunks whose body is rematerialised, so neither pass holds more than one chunk's [batch, chunk,
    vocab] logits (and their derivatives). Plain JAX ops: forward-over-reverse differentiable as MixFlow needs.
    x: [batch, seq, d_model]; w_out: [d_model, vocab]; tokens_out, segment_ids: [batch, seq] → [batch]."""
    b, s, d = x.shape
    n = -(-s // chunk)
    valid = jnp.ones((b, s), bool) if segment_ids is None else segment_ids > 0
    pad = lambda a: jnp.pad(a, [(0, 0), (0, n * chunk - s)] + [(0, 0)] * (a.ndim - 2))
    split = lambda a: pad(a).reshape((b, n, chunk) + a.shape[2:]).swapaxes(0, 1)  # [n, batch, chunk, ...]

    @jax.checkpoint
    def body(total, part):
        xc, tc, vc = part  # [batch, chunk, d_model], [batch, chunk], [batch, chunk]
        logits = dense(xc, w_out.astype(xc.dtype)).astype(compute_dtype(xc.dtype))  # [batch, chunk, vocab]
        target = jax.nn.one_hot(tc, logits.shape[-1], dtype=logits.dtype)
        nll = jax.nn.logsumexp(logits, axis=-1) - jnp.sum(target * logits, axis=-1)  # [batch, chunk]
        return total + jnp.where(vc, nll, 0).sum(-1), None

    total, _ = jax.lax.scan(body, jnp.zeros((b,), compute_dtype(x.dtype)), (split(x), split(tokens_out),
                                                                             split(valid)))
    return total / jnp.maximum(valid.sum(-1), 1).astype(total.dtype)
