"""Hugging Face checkpoints in and out: local `llama` / `qwen2` model dirs <-> metatrain models.

`load(DIR)` gives an NNX model; `read(DIR)` its config and parameters (stacked over layers, read tensor by
tensor with `safetensors`, so a checkpoint never needs twice its size in memory); `write(OUT, cfg, params)`
writes `config.json` + `model.safetensors` that `transformers.AutoModelForCausalLM.from_pretrained` loads.
No transformers or torch here: only `safetensors` and numpy.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from metatrain.errors import ConfigError, DataError
from metatrain.models import ModelConfig, Transformer
from metatrain.paths import folder_kind, read_json

MODEL_TYPES = ("llama", "qwen2")
ROPE_TYPES = ("default", "llama3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# the architecture keys `config_to_hf` writes; the others of an imported config.json (token ids, context) are kept
_ARCH_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
              "tie_word_embeddings", "attention_bias", "mlp_bias", "rope_parameters", "rope_scaling", "rope_theta",
              "dtype", "torch_dtype", "use_sliding_window", "layer_types")


# ---- configuration ---------------------------------------------------------------------------------------
def read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if os.path.isfile(directory):
        raise DataError(f"{directory} is a file; give the Hugging Face model dir that holds it (config.json + "
                        "model.safetensors)")
    if not os.path.isfile(path):
        raise DataError(f"{path} not found: give a local Hugging Face model dir (config.json + model.safetensors)"
                        + (_metatrain_dir(directory) or _prefixed(directory)))
    return read_json(path, "Hugging Face config.json")


def _prefixed(directory: str) -> str:
    """What to do instead where `directory` was given as hf:DIR (the end of an error line), else ""."""
    if "/hf:" not in "/" + directory:
        return ""
    return ("; drop the hf: prefix here (`metatrain import hf DIR` and hf.load(DIR) take the dir itself; hf:DIR is "
            "for inner.init_from, data.tokenizer and `metatrain generate`)")


def _metatrain_dir(directory: str) -> str:
    """What to do instead where `directory` is a metatrain export or run (the end of an error line), else ""."""
    what = {"export": "an export", "run": "a run"}.get(folder_kind(directory))
    if what is None:
        return ""
    return (f"; {directory} is {what} of metatrain: give it without hf: (`metatrain generate`, inner.init_from), or "
            f"write a Hugging Face model dir from its run with `metatrain export RUN --format hf --out DIR`")


def _field(hf: dict, key: str, where: str, kind=int, default=None):
    """config.json's `key` as a `kind` (int or float), naming the file and key when it is missing or not a number; a
    null value is `default`, as transformers reads it."""
    value = default if hf.get(key) is None else hf[key]
    if value is None:
        raise ConfigError(f"{where}: {key!r} is missing; a Llama / Qwen2 config.json has it")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or value == int(value))
    if not ok:
        raise ConfigError(f"{where}: {key}={value!r} is not {'a whole number' if kind is int else 'a number'}")
    return kind(value)


_SIZES = ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")


def config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """The ModelConfig of a Llama or Qwen2 `config.json`; refuses options metatrain does not implement."""
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {kind!r} is not supported; metatrain imports {MODEL_TYPES}")
    refuse = {"hidden_act": hf.get("hidden_act", "silu") != "silu",
              "attention_bias": kind == "llama" and hf.get("attention_bias", False),
              "mlp_bias": hf.get("mlp_bias", False),
              "use_sliding_window": hf.get("use_sliding_window", False)}
    for key, bad in refuse.items():
        if bad:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported (metatrain implements SwiGLU with silu, "
                              f"q/k/v biases as in Qwen2, full attention)")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{where}: RoPE scaling {rope_type!r} is not implemented; metatrain has {ROPE_TYPES}")
    theta = _field(rope, "rope_theta", where, float, hf.get("rope_theta", 10_000.0))
    sizes = {key: _field(hf, key, where) for key in _SIZES}
    for key, value in sizes.items():
        if value <= 0:
            raise ConfigError(f"{where}: {key}={value} must be > 0")
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    kv_heads = _field(hf, "num_key_value_heads", where, default=heads) or heads
    if kv_heads < 0 or heads % kv_heads:
        raise ConfigError(f"{where}: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
    head_dim = _field(hf, "head_dim", where, default=0)
    if head_dim < 0 or (not head_dim and hidden % heads):
        raise ConfigError(f"{where}: hidden_size={hidden} is not divisible by num_attention_heads={heads}, and "
                          f"head_dim={head_dim} does not give the per-head size")
    if (head_dim or hidden // heads) % 2:
        raise ConfigError(f"{where}: the per-head size {head_dim or hidden // heads} (head_dim, else hidden_size / "
                          "num_attention_heads) must be even for RoPE")
    scaling = {}
    if rope_type == "llama3":
        scaling = dict(rope_scaling="llama3", rope_factor=_field(rope, "factor", where, float),
                       rope_low_freq_factor=_field(rope, "low_freq_factor", where, float),
                       rope_high_freq_factor=_field(rope, "high_freq_factor", where, float),
                       rope_original_max_positions=_field(rope, "original_max_position_embeddings", where))
    try:
        return ModelConfig(
            vocab_size=sizes["vocab_size"], d_model=hidden, n_heads=heads, n_kv_heads=kv_heads, kv_size=head_dim,
            d_ff=sizes["intermediate_size"], n_layers=sizes["num_hidden_layers"], mlp="swiglu",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qkv_bias=kind == "qwen2",
            rope_base=theta, norm_eps=_field(hf, "rms_norm_eps", where, float, 1e-6), **scaling)
    except ConfigError as e:  # what the checks above leave (RoPE's and the norm's constants), named by the file
        raise ConfigError(f"{where}: {e}") from None


def config_to_hf(cfg: ModelConfig, base: dict | None = None) -> dict:
    """A transformers `config.json` for `cfg` (Llama, or Qwen2 when it has q/k/v biases); `base`'s other keys
    (token ids, context length) are kept. Refuses models transformers has no class for."""
    why = ("a GELU MLP (Chinchilla blocks)" if cfg.mlp != "swiglu" else
           "a score head" if cfg.head != "lm" else
           "q/k/v biases with a per-head size other than d_model / n_heads" if cfg.qkv_bias and cfg.kv_size
           and cfg.kv_size != cfg.d_model // cfg.n_heads else "")
    if why:
        raise ConfigError(f"export --format hf: transformers has no Llama or Qwen2 class for {why}; "
                          f"use --format orbax")
    kind = "qwen2" if cfg.qkv_bias else "llama"
    rope = {"rope_type": cfg.rope_scaling or "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scaling == "llama3":
        rope.update(factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_positions)
    out = {k: v for k, v in (base or {}).items() if k not in _ARCH_KEYS}
    out.update(architectures=["Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM"], model_type=kind,
               vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
               num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
               hidden_act="silu", rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
               rope_parameters=rope, dtype=cfg.param_dtype)
    if kind == "llama":
        out.update(head_dim=cfg.head_dim, attention_bias=False, mlp_bias=False)
    return out


# ---- tensors ---------------------------------------------------------------------------------------------
def _layer_tensors(cfg: ModelConfig) -> list[tuple[tuple[str, ...], str, object, object]]:
    """(our path under `blocks`, HF name under `model.layers.{i}.`, HF -> ours, ours -> HF) for one layer."""
    d, k = cfg.d_model, cfg.head_dim
    same = lambda w: w

    def heads(n):  # [n*k, d] <-> [d, n, k]
        return (lambda w: w.reshape(n, k, d).transpose(2, 0, 1), lambda w: w.transpose(1, 2, 0).reshape(n * k, d))

    def bias(n):  # [n*k] <-> [n, k]
        return lambda w: w.reshape(n, k), lambda w: w.reshape(n * k)

    h, g = cfg.n_heads, cfg.kv_heads
    out = [(("attn_norm", "scale"), "input_layernorm.weight", same, same),
           (("attn", "wq"), "self_attn.q_proj.weight", *heads(h)),
           (("attn", "wk"), "self_attn.k_proj.weight", *heads(g)),
           (("attn", "wv"), "self_attn.v_proj.weight", *heads(g)),
           (("attn", "wo"), "self_attn.o_proj.weight", lambda w: w.T.reshape(h, k, d),
            lambda w: w.reshape(h * k, d).T),
           (("mlp_norm", "scale"), "post_attention_layernorm.weight", same, same),
           (("mlp", "w_in"), "mlp.up_proj.weight", np.transpose, np.transpose),
           (("mlp", "w_gate"), "mlp.gate_proj.weight", np.transpose, np.transpose),
           (("mlp", "w_out"), "mlp.down_proj.weight", np.transpose, np.transpose)]
    if cfg.qkv_bias:
        out += [(("attn", "bq"), "self_attn.q_proj.bias", *bias(h)),
                (("attn", "bk"), "self_attn.k_proj.bias", *bias(g)),
                (("attn", "bv"), "self_attn.v_proj.bias", *bias(g))]
    return out


class _Tensors:
    """Lazy access to the tensors of `model.safetensors` or a sharded `model.safetensors.index.json`."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.isfile(index):
            weights = read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weights, dict):
                raise DataError(f"{index}: no 'weight_map' object naming each tensor's file")
            self.where = {name: os.path.join(directory, file) for name, file in weights.items()}
        elif os.path.isfile(single):
            with self._opened(safe_open, single) as f:
                self.where = dict.fromkeys(f.keys(), single)
        else:
            raise DataError(f"{directory}: no model.safetensors or model.safetensors.index.json (metatrain reads "
                            f"safetensors checkpoints; convert .bin files with transformers' save_pretrained)")
        self._open = safe_open
        self._files = {}

    @staticmethod
    def _opened(safe_open, file: str):
        try:
            return safe_open(file, "numpy")
        except Exception as e:  # noqa: BLE001 — SafetensorError (header too small, invalid JSON header, ...)
            raise DataError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e}); is it "
                            "complete?") from None

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.where:
            raise DataError(f"tensor {name!r} is missing from the checkpoint")
        file = self.where[name]
        if file not in self._files:
            if not os.path.isfile(file):
                raise DataError(f"{file} (named in model.safetensors.index.json) not found")
            self._files[file] = self._opened(self._open, file)
        try:
            tensor = self._files[file].get_tensor(name)
        except Exception as e:  # noqa: BLE001 — safetensors' errors: a truncated or damaged file
            raise DataError(f"{file}: cannot read tensor {name!r} ({type(e).__name__}: {e}); is the file "
                            "complete?") from None
        if tuple(tensor.shape) != tuple(shape):
            raise DataError(f"tensor {name!r} in {os.path.basename(file)} has shape {list(tensor.shape)}, config.json "
                            f"implies {list(shape)}")
        return tensor


PARAM_DTYPES = ("float32", "float64", "bfloat16")


def _dtype_name(dtype) -> str:
    """The name of a parameter dtype given by name (`"bfloat16"`) or as a NumPy/JAX dtype (`jnp.bfloat16`)."""
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name if dtype is not None else None
    except TypeError:
        name = None
    if name not in PARAM_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(PARAM_DTYPES)} (a name or a NumPy/JAX dtype), got "
                          f"{dtype!r}")
    return name


def read(directory: str, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """The architecture and parameters of a local Hugging Face model dir.

    Args:
      directory: a `llama` or `qwen2` model dir (`~` is expanded).
      dtype: the parameters' dtype: float32, float64 or bfloat16, by name or as a NumPy/JAX dtype.

    Returns:
      (`ModelConfig`, the parameters as a pure dict of `Transformer(cfg)`'s state).
    """
    from metatrain import models

    directory, dtype = os.path.expanduser(directory), _dtype_name(dtype)
    models.require_float64({"dtype": dtype})
    hf = read_config(directory)
    cfg = config_from_hf(hf, os.path.join(directory, "config.json")).replace(param_dtype=dtype)
    tensors = _Tensors(directory)
    from flax import nnx

    shapes = nnx.to_pure_dict(models.abstract_init(cfg)[1])
    np_dtype = np.dtype(cfg.dtype)
    get = lambda name, shape: tensors.get(name, shape).astype(np_dtype)
    params = {"embed": get("model.embed_tokens.weight", shapes["embed"].shape),
              "final_norm": {"scale": get("model.norm.weight", shapes["final_norm"]["scale"].shape)}, "blocks": {}}
    if not cfg.tie_embeddings:
        params["out"] = get("lm_head.weight", shapes["out"].shape[::-1]).T
    for path, name, to_ours, to_hf in _layer_tensors(cfg):
        shape = shapes["blocks"][path[0]][path[1]].shape  # [layers, ...]
        stacked = np.empty(shape, np_dtype)
        for i in range(cfg.n_layers):
            stacked[i] = to_ours(get(f"model.layers.{i}.{name}", to_hf(np.empty(shape[1:], np.int8)).shape))
        params["blocks"].setdefault(path[0], {})[path[1]] = stacked
    return cfg, params


def to_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Our pure-dict parameters as Hugging Face tensors by name."""
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]["scale"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = params["out"].T
    for path, name, _, to_hf in _layer_tensors(cfg):
        stacked = params["blocks"][path[0]][path[1]]
        for i in range(cfg.n_layers):
            out[f"model.layers.{i}.{name}"] = to_hf(stacked[i])
    return {name: np.ascontiguousarray(np.asarray(x)) for name, x in out.items()}


def write(out: str, cfg: ModelConfig, params: dict, base_config: dict | None = None,
          tokenizer_dir: str | None = None) -> list[str]:
    """`config.json` + `model.safetensors` (+ the tokenizer files of `tokenizer_dir`); returns the files written."""
    from safetensors.numpy import save_file

    hf = config_to_hf(cfg, base_config)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    save_file(to_tensors(cfg, params), os.path.join(out, "model.safetensors"),
              metadata={"format": "pt", "writer": "metatrain"})
    return ["config.json", "model.safetensors", *copy_tokenizer(tokenizer_dir, out)]


# our LoRA target -> the Hugging Face module it adapts, under model.layers.{i}.
PEFT_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                "up": "mlp.up_proj", "gate": "mlp.gate_proj", "down": "mlp.down_proj"}


def adapter_tensors(adapters: dict) -> dict[str, np.ndarray]:
    """A LoRA run's adapters (pure dicts, layer-stacked: A [layers, in..., r], B [layers, r, out...]) as PEFT's
    tensors: `base_model.model.model.layers.{i}.<module>.lora_A.weight` [r, in] and `lora_B.weight` [out, r], the
    in and out axes flattened as the model's own weights are (so B_w A_w = (A B)ᵀ, the Hugging Face layout)."""
    out = {}
    for group in adapters["blocks"].values():
        for key, a in group.items():
            if not (key.startswith("lora_") and key.endswith("_a")):
                continue
            name = key[len("lora_"):-len("_a")]
            a, b = np.asarray(a), np.asarray(group[f"lora_{name}_b"])
            rank = a.shape[-1]
            for i in range(a.shape[0]):
                prefix = f"base_model.model.model.layers.{i}.{PEFT_MODULES[name]}"
                out[f"{prefix}.lora_A.weight"] = a[i].reshape(-1, rank).T
                out[f"{prefix}.lora_B.weight"] = b[i].reshape(rank, -1).T
    return {name: np.ascontiguousarray(x) for name, x in out.items()}


def write_adapters(out: str, adapters: dict, rank: int, alpha: float, base: str) -> list[str]:
    """`adapter_model.safetensors` + `adapter_config.json`: LoRA adapters in the PEFT format, which
    `peft.PeftModel.from_pretrained(base_model, out)` loads (scaling alpha / r, as ours); returns the files."""
    from safetensors.numpy import save_file

    tensors = adapter_tensors(adapters)
    modules = sorted({name.split(".")[-3] for name in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": modules, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
              "base_model_name_or_path": base}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt", "writer": "metatrain"})
    return ["adapter_config.json", "adapter_model.safetensors"]


def written_by_metatrain(path: str) -> bool:
    """Whether the safetensors file at `path` was written by `write` (its metadata says so)."""
    from safetensors import safe_open

    try:
        with safe_open(path, "np") as f:
            return (f.metadata() or {}).get("writer") == "metatrain"
    except Exception:  # noqa: BLE001 — unreadable: not ours
        return False


def copy_tokenizer(source: str | None, out: str) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES if source else ():
        if os.path.isfile(os.path.join(source, name)) and os.path.abspath(source) != os.path.abspath(out):
            shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
            copied.append(name)
    return copied


def load(directory: str, dtype: str = "float32") -> Transformer:
    """The NNX model of a local Hugging Face model dir (`llama` or `qwen2`).

    Args:
      directory: a dir with `config.json` and `model.safetensors` (or a sharded index); `~` is expanded.
      dtype: the parameters' dtype: float32, float64 or bfloat16, by name or as a NumPy/JAX dtype.

    Returns:
      The NNX model. With int tokens [batch, seq], `model(tokens)` gives logits [batch, seq, vocab], and
        `model.generate(prompts, max_new_tokens=N)` the new token ids of each prompt, stopping at config.json's EOS.
    """
    import jax.numpy as jnp
    from flax import nnx

    from metatrain import models

    directory = os.path.expanduser(directory)
    cfg, params = read(directory, dtype)
    graphdef, state = models.abstract_init(cfg)
    nnx.replace_by_pure_dict(state, _tree_map(jnp.asarray, params))
    model = nnx.merge(graphdef, state)
    eos = read_config(directory).get("eos_token_id")
    model.eos_token_id = tuple(eos) if isinstance(eos, list) else eos  # an attribute of the (hashable) graph
    return model


def _tree_map(fn, tree):
    return {k: _tree_map(fn, v) for k, v in tree.items()} if isinstance(tree, dict) else fn(tree)
