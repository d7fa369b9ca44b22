"""Parameters in and out of runs: `export` writes a run's fine-tuned model, its meta-parameters or its
baseline as an export dir or a Hugging Face model dir; `import_hf` makes an export dir of a Hugging Face
model; `load_params` reads a pretrained model for `inner.init_from`.

An export directory holds `params/` (an Orbax checkpoint of the pytree), `export.json` (kind, task, step,
what, model config, and the Hugging Face config it came from, if any) and the tokenizer files, so
`nnx.merge(models.abstract_init(cfg)[0], params)` rebuilds the model elsewhere. A LoRA run's models are
exported merged (W + scale · A B: a plain model), or with `adapters=True` the adapters alone (orbax, or PEFT's
format with hf).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from metatrain import config as config_lib
from metatrain import hf, paths
from metatrain.checkpoints import first_layout_difference, leaf_shapes, save_params
from metatrain.data.tokenizer import HF_PREFIX
from metatrain.errors import ConfigError, DataError
from metatrain.models import ModelConfig, dtype_settings, require_float64
from metatrain.run import READ_AS_FLOAT32, Checkpoint, Run, on_one_device


def _check_matches(path: str, saved, target, field: str = "inner.init_from"):
    """Refuse a checkpoint whose parameter names or shapes differ from the target's, naming the first; a vocabulary
    that differs is named as the tokenizer's."""
    difference = first_layout_difference(saved, target)
    vocab = lambda tree: next((s[0] for k, s in leaf_shapes(tree).items() if k.split("/")[0] == "embed"), None)
    if difference and vocab(saved) != vocab(target) and None not in (vocab(saved), vocab(target)):
        raise ConfigError(f"{field}: {path} has a vocabulary of {vocab(saved):,} tokens, this run's tokenizer "
                          f"{vocab(target):,}; use the tokenizer it was trained with (a Hugging Face model's own: "
                          f"leave data.tokenizer unset; a pretrain run's: its data.tokenizer and data.vocab_size)")
    if difference:
        raise ConfigError(f"{field}: {path} does not hold parameters of this run's model ({difference}); "
                          f"pretrain with the same model.* and data.vocab_size settings")


WHATS = ("inner", "meta", "baseline")
FORMATS = ("orbax", "hf")


def not_written_here(directory: str) -> list[str]:
    """The names in `directory` that no export or import of ours wrote: all that `--overwrite` must not replace.
    Ours: an `export.json` with a `kind`, an Orbax `params/`, a `model.safetensors` or `adapter_model.safetensors`
    whose metadata names metatrain, and beside one of those, `config.json`, `adapter_config.json` and the tokenizer
    files."""
    def is_ours(name):
        path = os.path.join(directory, name)
        if name == "export.json":
            try:
                with open(path) as f:
                    return "kind" in json.load(f)
            except (OSError, ValueError, TypeError):
                return False
        if name == "params":
            return os.path.isfile(os.path.join(path, "_METADATA")) or os.path.isfile(
                os.path.join(path, "_CHECKPOINT_METADATA"))
        if name in ("model.safetensors", "adapter_model.safetensors"):
            return hf.written_by_metatrain(path)
        return False

    names = os.listdir(directory)
    ours = {n for n in names if is_ours(n)}
    if ours:
        ours |= {n for n in names if n in ("config.json", "adapter_config.json", *hf.TOKENIZER_FILES)}
    return sorted(set(names) - ours)


@dataclasses.dataclass
class Exported:
    """Parameters taken out of a run or an export dir, and what is known about them."""

    params: object  # as saved (nnx Variables as {"value": array} dicts)
    model: ModelConfig | None  # the model they are the parameters of; None when they are not a model's
    info: dict  # kind, task, step, what; hf_config and tokenizer_dir, or tokenizer and tokenizer_vocab_size, if known
    run: Run | None = None  # the run they came from (None: an export dir)


def _pure(tree):
    """Saved parameters as a plain nested dict of numpy arrays (`{"value": x}` leaves unwrapped)."""
    if isinstance(tree, dict):
        return _pure(tree["value"]) if set(tree) == {"value"} else {k: _pure(v) for k, v in tree.items()}
    if hasattr(tree, "items"):  # an nnx.State
        return _pure(dict(tree.items()))
    return np.asarray(tree.get_value() if hasattr(tree, "get_value") else tree)  # an nnx Variable, or an array


def _origin(init_from: str, tokenizer: str) -> dict:
    """The Hugging Face config a run's model came from and the tokenizer dir it used, where there are any."""
    info = {}
    if init_from.startswith(HF_PREFIX) and os.path.isfile(os.path.join(init_from[len(HF_PREFIX):], "config.json")):
        with open(os.path.join(init_from[len(HF_PREFIX):], "config.json")) as f:
            info["hf_config"] = json.load(f)
    elif init_from and os.path.isfile(os.path.join(init_from, "export.json")):
        with open(os.path.join(init_from, "export.json")) as f:
            info.update({k: v for k, v in json.load(f).items() if k == "hf_config"})
    if tokenizer.startswith(HF_PREFIX):
        info["tokenizer_dir"] = tokenizer[len(HF_PREFIX):]
    return info


def lora_base(cfg, model: ModelConfig):
    """The frozen base weights a LoRA run trained on, on this process's first device: its `inner.init_from`
    weights, or for a run from random weights those its seed gave (the key `step.init_state` uses)."""
    from metatrain import models

    _, state = models.abstract_init(model, cfg.inner.lora)
    target = on_one_device(models.split_adapters(state)[0])
    if cfg.inner.init_from:
        return load_params(cfg.inner.init_from, target)
    _, k_inner = jax.random.split(jax.random.key(cfg.seed))
    return jax.device_put(models.split_adapters(models.init(model, k_inner, cfg.inner.lora)[1])[0],
                          jax.tree.leaves(target)[0].sharding)


def _merged(cfg, model: ModelConfig, adapters):
    """A LoRA run's adapters folded into its base weights: the parameters of a plain `model`."""
    from flax import nnx

    from metatrain import models
    from metatrain.models.lora import merge

    merged = merge(_pure(lora_base(cfg, model)), _pure(adapters), cfg.inner.lora.scale)
    _, state = models.abstract_init(model)
    nnx.replace_by_pure_dict(state, merged)
    return state


FLOAT32_EXPORT = "the export would hold float32 parameters"  # without JAX's 64-bit mode, of a float64 model


def _from_workdir(workdir: str, what: str | None, adapters: bool = False, command: str = "export") -> Exported:
    # its config as it ran (the data sources may be gone); float64 refused where it would be read as float32: the
    # parameters for export, which computes nothing, the parameters and the compute for the other commands
    run = Run.open(workdir, float32_means=None if command == "export" else READ_AS_FLOAT32)
    cfg, model, saved = run.cfg, run.model, run.saved
    if command == "export":
        require_float64({f"{workdir}: model.param_dtype": model.param_dtype}, FLOAT32_EXPORT)
    info = {"task": cfg.task, "step": run.step, **_origin(cfg.inner.init_from, cfg.data.tokenizer)}
    if not cfg.data.tokenizer.startswith(HF_PREFIX):  # a tiktoken encoding: its name and the vocabulary it was cut to
        info.update(tokenizer=cfg.data.tokenizer, tokenizer_vocab_size=cfg.data.vocab_size)
    out = functools.partial(Exported, run=run)
    lora = cfg.inner.lora.rank > 0
    if adapters and not lora:
        raise ConfigError(f"export --adapters: {workdir} is not a LoRA run (inner.lora.rank=0); export without it")

    def model_out(params, which):  # a LoRA run's model: merged, or its adapters alone
        if not lora:
            return out(params, model, dict(info, kind="meta-train", what=which))
        if adapters:
            return out(params, None, dict(info, kind="meta-train", what=which, lora=dataclasses.asdict(
                cfg.inner.lora), base=cfg.inner.init_from or f"random (seed {cfg.seed})", base_model=dataclasses.asdict(
                model)))
        return out(_merged(cfg, model, params), model, dict(info, kind="meta-train", what=which, merged_lora=True))
    if run.kind == "pretrain":  # its parameters are the model
        if what not in (None, "inner"):
            raise ConfigError(f"{command} --what {what}: {workdir} is a pretrain run; it has one model (--what inner)")
        return out(run.part("params"), model, dict(info, kind="pretrain", what="inner"))
    if what in ("inner", "baseline"):
        key = "inner" if what == "inner" else "base"
        if key not in saved or saved[key] is None:
            missing = ("uniform baseline (run with baseline=uniform)" if key == "base" else
                       f"fine-tuned inner model: task {cfg.task!r} restarts every step from η; use --what meta")
            raise ConfigError(f"{command} --what {what}: {workdir} has no {missing}")
        part = run.part(key)
        theta = (part["inner"] if key == "base" else part)[0]
        if key == "inner" and cfg.population.size > 1:  # a population's inner models: member 0's
            theta, info["member"] = jax.tree.map(lambda x: x[0], theta), 0
        return model_out(theta, what)
    if adapters:
        raise ConfigError("export --adapters: only a LoRA run's inner model or baseline has adapters (--what inner)")
    meta = run.part("meta")
    if cfg.task == "maml":  # η is a model: MAML's initialisation (under LoRA: of the adapters)
        return model_out(meta, "meta")
    if isinstance(meta, dict) and isinstance(meta.get("lm"), dict):  # loss weighting's scorer
        scorer = config_lib.meta_model_config(dataclasses.replace(cfg, model=model), check_vocab=False)
        return out(meta["lm"], scorer or model, dict(info, kind="meta-train", what="meta"))
    return out(meta, None, dict(info, kind="meta-train", what="meta"))


def _from_export_dir(path: str, what: str | None, command: str = "export") -> Exported:
    with open(os.path.join(path, "export.json")) as f:
        info = json.load(f)
    held = info.get("what", "inner")
    if what not in (None, held):
        raise ConfigError(f"{command} --what {what}: {path} is an export dir holding only {held!r}; give the run's "
                          f"work dir, or an export made with --what {what}")
    model = ModelConfig(**info["model"]) if info.get("model") else None
    if model is not None and command == "export":  # before anything is read in float32
        require_float64({f"{path}: model.param_dtype": model.param_dtype}, FLOAT32_EXPORT)
    elif model is not None:
        require_float64(dtype_settings(model, prefix=f"{path}: model."), READ_AS_FLOAT32)
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(os.path.join(path, "params"))
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        info["tokenizer_dir"] = path
    return Exported(params, model, info)


def read_source(src: str, what: str | None = None, adapters: bool = False, command: str = "export") -> Exported:
    """The parameters of a run's work dir (`what`: inner | meta | baseline) or of an export / import dir; errors
    name `command`'s --what."""
    if what is not None and what not in WHATS:
        raise ConfigError(f"{command} --what: {what!r} is not one of {WHATS}")
    src = paths.local(src)
    if os.path.isfile(os.path.join(src, "export.json")):
        if adapters:
            raise ConfigError(f"export --adapters: {src} is an export dir; give the LoRA run's work dir")
        return _from_export_dir(src, what, command)
    return _from_workdir(src, what, adapters, command)


def export(src: str, out: str | None = None, what: str | None = None, fmt: str = "orbax",
           adapters: bool = False, overwrite: bool = False) -> tuple[str, str]:
    """Write parameters out of a run's latest checkpoint, or of an export dir.

    Args:
      src: a work dir, or an export / import dir.
      out: the output dir (default: `src/export` or `src/hf`); new or empty, or with `overwrite` one holding only
        what an export or import wrote.
      what: `inner`, `meta` or `baseline`; default inner for hf, meta (a pretrain run: its model) for orbax.
      fmt: `orbax` (an export dir that `inner.init_from` accepts) or `hf` (a Hugging Face model dir).
      adapters: a LoRA run's adapters alone (orbax: an export dir; hf: PEFT's adapter_model.safetensors and
        adapter_config.json); otherwise they are merged into the base weights.
      overwrite: replace an earlier export in `out`.

    Returns:
      (the output dir, one line saying what was written).
    """
    if fmt not in FORMATS:
        raise ConfigError(f"export --format: {fmt!r} is not one of {FORMATS}")
    src = paths.local(src)
    out = paths.local(out or os.path.join(src, "export" if fmt == "orbax" else "hf"))
    paths.output_dir(out, "export --out", not_written_here, overwrite, source=(src, "the source"))
    exported = read_source(src, what or ("inner" if fmt == "hf" or adapters else None), adapters)
    info = exported.info
    if fmt == "hf" and not adapters and exported.model is None:
        raise ConfigError(f"export --format hf: η of task {info.get('task')!r} is not a language model; "
                          f"use --format orbax")
    if fmt == "hf" and adapters:  # PEFT puts them on a transformers model of the base's architecture
        hf.config_to_hf(exported.run.model)  # refuses one transformers has no class for (adapters: a run's only)
    with paths.filled_dir(out):  # an error or a signal while writing takes out what was written (a full disk)
        if fmt == "hf" and adapters:  # the PEFT format, for the base model the run started from
            lora, base = info["lora"], info["base"]
            files = hf.write_adapters(out, _pure(exported.params), lora["rank"], lora["alpha"],
                                      base.removeprefix(HF_PREFIX) if base.startswith(HF_PREFIX) else base)
        elif fmt == "hf":
            files = hf.write(out, exported.model, _pure(exported.params), info.get("hf_config"),
                             info.get("tokenizer_dir"))
        else:
            save_params(os.path.join(out, "params"), exported.params)
            payload = {k: v for k, v in info.items() if k != "tokenizer_dir"}
            payload["model"] = dataclasses.asdict(exported.model) if exported.model else None
            with open(os.path.join(out, "export.json"), "w") as f:
                json.dump(payload, f, indent=1)
            files = ["params/", "export.json", *hf.copy_tokenizer(info.get("tokenizer_dir"), out)]
    origin = f"{info.get('kind')}, step {info['step']}" if info.get("step") is not None else (
        f"imported from {info['source']}" if info.get("source") else info.get("kind"))
    return out, f"{info.get('what', 'inner')} parameters ({origin}): " + ", ".join(
        files) + ("" if info.get("tokenizer_dir") else " (no tokenizer files: the run used a tiktoken encoding)")


def import_hf(directory: str, out: str, overwrite: bool = False) -> tuple[str, ModelConfig]:
    """Import a local Hugging Face model dir as an export dir that `inner.init_from` accepts.

    Args:
      directory: a `llama` or `qwen2` model dir; its tensors are read one at a time.
      out: the export dir to write (`params/`, `export.json`, tokenizer files), as for `export`.
      overwrite: replace an earlier import in `out`.

    Returns:
      (the export dir, the model's `ModelConfig`).
    """
    from flax import nnx

    from metatrain import models

    directory = paths.local(directory)
    out = paths.output_dir(out, "import hf --out", not_written_here, overwrite, source=(directory, "the model dir"))
    cfg, params = hf.read(directory)
    _, state = models.abstract_init(cfg)
    nnx.replace_by_pure_dict(state, params)
    with paths.filled_dir(out):  # an error or a signal while writing takes out what was written (a full disk)
        save_params(os.path.join(out, "params"), state)
        with open(os.path.join(out, "export.json"), "w") as f:
            json.dump({"kind": "import", "what": "inner", "source": directory,
                       "model": dataclasses.asdict(cfg), "hf_config": hf.read_config(directory)}, f, indent=1)
        hf.copy_tokenizer(directory, out)
    return out, cfg


def load_params(path: str, target: Any, field: str = "inner.init_from") -> Any:
    """Pretrained parameters restored onto given shapes and shardings.

    Args:
      path: a `metatrain pretrain` work dir (its latest checkpoint), an export / import dir, or `hf:DIR`.
      target: the parameters' `jax.ShapeDtypeStruct`s (a pytree), with shardings.
      field: the config key named in errors.

    Returns:
      The parameters (a pytree of `target`'s structure), placed as `target` says; a checkpoint of another shape is
        refused, naming the first parameter that differs.
    """
    path = paths.prefixed(path, (HF_PREFIX,), bare=True)
    if path.startswith(HF_PREFIX):
        from flax import nnx

        _, params = hf.read(path[len(HF_PREFIX):], str(jax.tree.leaves(target)[0].dtype))
        state = jax.tree.map(lambda t: t, target)  # a copy of the target's structure to fill
        nnx.replace_by_pure_dict(state, params)
        _check_matches(path, state, target, field)
        return jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), state, target)
    if os.path.exists(os.path.join(path, "export.json")):
        with ocp.StandardCheckpointer() as checkpointer:
            params_dir = os.path.join(path, "params")
            _check_matches(path, checkpointer.metadata(params_dir).item_metadata.tree, target, field)
            return checkpointer.restore(params_dir, target)
    try:
        checkpoint = Checkpoint.latest(path)
    except DataError as e:
        raise ConfigError(f"{field}: {e}") from None
    if "params" not in checkpoint.saved:
        raise ConfigError(f"{field}: {path} is not a `metatrain pretrain` work dir or an export dir (no "
                          f"'params' in its checkpoint, no export.json)")
    _check_matches(path, checkpoint.saved["params"], target, field)
    return checkpoint.part("params", target)
