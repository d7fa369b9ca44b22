"""Typed run configuration: dataclasses, YAML presets in `configs/`, dotted command-line overrides.

`load(preset, overrides)` is the one place a run's configuration is read and validated. Everything
goes through OmegaConf structured configs, so an unknown key or a wrong type is refused with the
field's name; `validate` then checks every value's range and the fields that depend on each other,
before anything is built or compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import math
import os
import re

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from metatrain import paths
from metatrain.argtypes import MAX_INT
from metatrain.data.pipeline import SOURCE_FIELDS, DataConfig
from metatrain.data.sources import PATH_SOURCES, missing_path
from metatrain.data.tokenizer import HF_PREFIX
from metatrain.errors import ConfigError, TaskError, renamed
from metatrain.mixflow import MODES, RENAMED_MODES, mode_name
from metatrain.models import LoRAConfig, ModelConfig, preset
from metatrain.tasks import task_class
from metatrain.unroll import KEPT_STATES, NARROW_NEEDS_SAVE

# keys by their names before a rename: still read (in overrides, preset and saved YAML files), with a RenamedWarning
RENAMED = {"mode": "metagrad.mode", "save_inner_grads": "metagrad.save_inner_grads",
           "inner_checkpoint": "metagrad.kept_states", "checkpoint_dtype": "metagrad.state_dtype",
           "checkpoint_offload": "metagrad.offload_states", "inner_unroll": "metagrad.unroll",
           "meta_opt.offload": "meta_opt.offload_moments"}
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class MetaOptConfig:
    lr: float = 1e-3  # AdamW step size for η
    weight_decay: float = 0.0  # AdamW's decoupled weight decay on η
    warmup_steps: int = 0  # linear warm-up from 0 over this many outer steps
    schedule: str = "constant"  # constant | cosine
    clip_norm: float = 1.0  # the meta-gradient is clipped to this global norm
    eps: float = 1e-8  # Adam's denominator floor
    # its moments (matrices and up) in host memory between outer steps, on the device only for the update at the
    # step's end, when the backward pass's buffers are free (TPU/GPU; no gain on CPU)
    offload_moments: bool = False
    # η's matrices too: on the device at the step's start (the inner loop's first step reads them) and for the
    # update; saves η's bytes at the peak when the first step's checkpoint is not η itself (offload_states)
    offload_params: bool = False


@dataclasses.dataclass(frozen=True)
class MetaGradConfig:
    """How the meta-gradient is computed: the fields of `unroll.MetaGradMethod`, where `auto` compiles each choice
    and keeps the lowest peak memory."""

    mode: str = "mixflow"  # mixflow (forward-over-reverse) | autodiff (reverse-over-reverse) | revfwd | auto
    save_inner_grads: bool = True  # keep each inner gradient for the backward pass instead of recomputing it
    kept_states: str = "every_step"  # every_step | sqrt | binomial | auto: inner states kept for the backward pass
    state_dtype: str = ""  # "" (as computed) | bfloat16: the dtype kept states and saved gradients are stored in
    offload_states: bool = False  # keep them in host memory until the backward pass (TPU/GPU; no gain on CPU)
    unroll: bool = False  # the inner steps as straight-line code, not a loop: each kept state freed once used


@dataclasses.dataclass(frozen=True)
class PopulationConfig:
    """A population of inner models (DataRater's stabiliser) for tasks that carry inner state: every outer step runs
    each member's T inner steps on its own batches, one member after another, and combines their meta-gradients."""

    size: int = 1  # inner models; data.batch is per member
    reduce: str = "grad"  # grad: the mean meta-gradient, one meta-optimizer | update: one per member, updates averaged
    lifetime: int = 0  # member i is reinitialised every this many outer steps, offset by i*lifetime/size; 0: never
    # true: the members side by side, over a `population` mesh axis of `size` devices (each member's batch over its
    # data x fsdp devices) instead of one after another: for pods, where devices outnumber what one member needs
    axis: bool = False


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # -1: all devices not used by the other axis
    fsdp: int = 1  # devices each parameter is sharded over (along the embed axis)
    # a single-process run on CPU: its cores as this many JAX devices, each running its share of the batch on its own
    # thread (XLA:CPU runs one device's program mostly on one core); 0: one per core, as many as divide data.batch
    # (with the other mesh keys at their defaults). Left alone where XLA_FLAGS or JAX_NUM_CPU_DEVICES sets a count.
    # With more than one device, XLA:CPU gets 4 threads per device (PJRT_NPROC, unless set) so that collectives
    # never wait for a thread.
    cpu_devices: int = 1


@dataclasses.dataclass(frozen=True)
class InnerConfig:
    # the inner model starts from: a `metatrain pretrain` work dir, an export / import dir, or hf:DIR (a local Hugging
    # Face model dir); with an export dir or hf:DIR the model's architecture (and tokenizer) follow the checkpoint
    init_from: str = ""
    # rank > 0: θ is LoRA adapters (stacked over layers) on a frozen base, the init_from weights
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)


@dataclasses.dataclass(frozen=True)
class MetaModelConfig:
    """The meta model of tasks that have one (loss weighting's scorer); all empty: the inner model's architecture.
    A preset, or an export / import dir or hf:DIR (its architecture and weights), then fields that are not 0."""

    preset: str = ""  # a model preset: smollm2-135m, 44m, small, ...
    init_from: str = ""  # a `metatrain export` / `metatrain import hf` dir or hf:DIR; same tokenizer as the inner model
    d_model: int = 0  # 0: the preset's or checkpoint's
    n_layers: int = 0  # 0: the preset's or checkpoint's
    n_heads: int = 0  # 0: the preset's or checkpoint's
    d_ff: int = 0  # 0: the preset's or checkpoint's
    # lm: an example's score is its mean next-token log-likelihood under the meta model | score: a pooled scalar
    # head on the meta model (DataRater's rater; zero-initialised, so the weights start uniform)
    head: str = "lm"
    causal: bool = True  # false: bidirectional attention within each document (needs head=score)

    @property
    def given(self) -> bool:
        return self != MetaModelConfig()


@dataclasses.dataclass(frozen=True)
class LogConfig:
    wandb: bool = False  # also log to Weights & Biases (pip install wandb); resumes the same W&B run
    wandb_project: str = "metatrain"  # the W&B project
    wandb_entity: str = ""  # default: your W&B default entity
    wandb_name: str = ""  # default: the work dir's name


@dataclasses.dataclass(frozen=True)
class Config:
    task: str = "loss_weighting"  # loss_weighting | maml | learned_lr | package.module:Class (a Task subclass of yours)
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(
        d_model=64, n_heads=4, d_ff=256, n_layers=2, remat=True))
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    inner_lr: float = 1e-3  # the inner Adam step size
    inner: InnerConfig = dataclasses.field(default_factory=InnerConfig)
    meta_model: MetaModelConfig = dataclasses.field(default_factory=MetaModelConfig)
    metagrad: MetaGradConfig = dataclasses.field(default_factory=MetaGradConfig)
    population: PopulationConfig = dataclasses.field(default_factory=PopulationConfig)
    meta_opt: MetaOptConfig = dataclasses.field(default_factory=MetaOptConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    steps: int = 300  # outer steps (meta-updates) to train for
    seed: int = 0  # initialises η, θ and the baseline
    workdir: str = "runs/default"  # where config, logs, plots and checkpoints go (a local path or gs://...)
    baseline: str = "none"  # none | uniform: also train the inner model with uniform weights on the same data
    eval_batches: int = 8  # held-out batches per evaluation
    eval_every: int = 0  # held-out evaluation every this many steps and at the end; 0: 10 points per run
    log_every: int = 10  # write training metrics every this many steps
    checkpoint_every: int = 100  # 0: only at the end and when stopped
    keep_checkpoints: int = 3  # the newest this many checkpoints are kept
    max_bad_steps: int = 5  # stop after this many non-finite meta-gradients in a row


STATE_DTYPES = ("", "float32", "bfloat16")


def presets() -> dict[str, str]:
    """{name: YAML text} of the presets shipped in the package (`configs/*.yaml`, installed as `metatrain.configs`)."""
    files = importlib.resources.files("metatrain.configs")
    return {f.name.rsplit(".", 1)[0]: f.read_text() for f in files.iterdir() if f.name.endswith(".yaml")}


def _check(cond: bool, field: str, message: str):
    if not cond:
        raise ConfigError(f"{field}: {message}")


def _positive(value: float, field: str, minimum: float = 0.0, strict: bool = True):
    ok = math.isfinite(value) and (value > minimum if strict else value >= minimum)
    _check(ok, field, f"must be a finite number {'>' if strict else '>='} {minimum:g}, got {value}")


def validate(cfg: Config, local_files: bool = True) -> Config:
    """`cfg`'s values checked (ConfigError: one line naming the key); `local_files=False` leaves out what needs the
    files it names (the work dir, `init_from` checkpoints), for a run that starts on another machine."""
    g = cfg.metagrad
    if g.mode in RENAMED_MODES:  # a Config built in Python (overrides and YAML files are read under the new names)
        g = dataclasses.replace(g, mode=mode_name(g.mode, stacklevel=3))
        cfg = dataclasses.replace(cfg, metagrad=g)
    _check(g.mode in MODES + (AUTO,), "metagrad.mode", f"{g.mode!r} is not one of {MODES + (AUTO,)}")
    _check(g.kept_states in KEPT_STATES + (AUTO,), "metagrad.kept_states",
           f"{g.kept_states!r} is not one of {KEPT_STATES + (AUTO,)}")
    _check(g.state_dtype in STATE_DTYPES, "metagrad.state_dtype",
           f"{g.state_dtype!r} is not one of {STATE_DTYPES} ('' keeps the inner states as computed; bfloat16 "
           "halves them)")
    _check(g.state_dtype != "bfloat16" or g.save_inner_grads, "metagrad.state_dtype",
           NARROW_NEEDS_SAVE.removeprefix("metagrad.state_dtype: "))
    for name, minimum in (("steps", 1), ("eval_batches", 1), ("log_every", 1), ("keep_checkpoints", 1),
                          ("max_bad_steps", 1), ("checkpoint_every", 0), ("eval_every", 0)):
        value = getattr(cfg, name)
        _check(value >= minimum, name, f"must be >= {minimum}, got {value}")
    _positive(cfg.inner_lr, "inner_lr")
    o = cfg.meta_opt
    _positive(o.lr, "meta_opt.lr")
    _positive(o.clip_norm, "meta_opt.clip_norm")
    _positive(o.eps, "meta_opt.eps")
    _positive(o.weight_decay, "meta_opt.weight_decay", strict=False)
    _check(o.schedule in ("constant", "cosine"), "meta_opt.schedule", f"{o.schedule!r} is not constant or cosine")
    _check(o.warmup_steps >= 0, "meta_opt.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _check(o.schedule != "cosine" or o.warmup_steps < cfg.steps, "meta_opt.warmup_steps",
           f"{o.warmup_steps} leaves no steps to decay over with schedule=cosine and steps={cfg.steps}")
    _check(cfg.baseline in ("none", "uniform"), "baseline", f"{cfg.baseline!r} is not none or uniform")
    _check(bool(cfg.workdir.strip()), "workdir", "must not be empty")
    _check(not local_files or not os.path.isfile(cfg.workdir), "workdir",
           f"{cfg.workdir!r} is a file; give a directory (new or a run's)")
    init_from = cfg.inner.init_from.removeprefix(HF_PREFIX)
    _check(not local_files or not init_from or os.path.isdir(init_from), "inner.init_from",
           f"{init_from!r} is not a directory; give a `metatrain pretrain` work dir, a `metatrain export` or "
           f"`metatrain import hf` dir, or hf:DIR")
    _check(not (cfg.meta_model.init_from and cfg.meta_model.preset), "meta_model.preset",
           "give meta_model.preset or meta_model.init_from, not both (the checkpoint fixes the architecture)")
    for name in ("d_model", "n_layers", "n_heads", "d_ff"):
        _check(getattr(cfg.meta_model, name) >= 0, f"meta_model.{name}", "must be >= 0 (0: not changed)")
    if cfg.meta_model.given and (local_files or not cfg.meta_model.init_from):
        meta_model_config(cfg, check_vocab=False)  # a bad preset, checkpoint or field combination: refused early
    for name in ("data", "fsdp"):
        size = getattr(cfg.mesh, name)
        _check(size == -1 or size >= 1, f"mesh.{name}", f"must be -1 (fill) or >= 1, got {size}")
    _check(cfg.mesh.cpu_devices >= 0, "mesh.cpu_devices", f"must be >= 0 (0: one per core), got {cfg.mesh.cpu_devices}")
    try:
        cls = task_class(cfg.task)
    except TaskError as e:
        raise ConfigError(f"task: {e}") from None
    _check(not cfg.meta_model.given or getattr(cls, "uses_meta_model", False), "meta_model",
           f"task {cfg.task!r} has no meta model to configure (loss_weighting's scorer is one); drop the meta_model.* "
           "settings")
    validate_population(cfg, cls)
    _representable(cfg)
    return cfg


def _representable(node, prefix: str = "") -> None:
    """Every whole number of the config a 32-bit integer (JAX's; a larger size, count or seed overflows in a compiled
    program, numpy or Grain) and every other number finite."""
    for field in dataclasses.fields(node):
        value, key = getattr(node, field.name), prefix + field.name
        if dataclasses.is_dataclass(value):
            _representable(value, key + ".")
        elif isinstance(value, int) and not isinstance(value, bool):
            _check(-MAX_INT - 1 <= value <= MAX_INT, key,
                   f"must be {'at most' if value > 0 else 'at least'} {MAX_INT if value > 0 else -MAX_INT - 1} "
                   f"(a 32-bit integer), got {value}")
        elif isinstance(value, float):
            _check(math.isfinite(value), key, f"must be a finite number, got {value}")


def validate_population(cfg: Config, cls) -> None:
    p = cfg.population
    _check(p.size >= 1, "population.size", f"must be >= 1, got {p.size}")
    _check(p.reduce in ("grad", "update"), "population.reduce", f"{p.reduce!r} is not grad or update")
    _check(p.lifetime >= 0, "population.lifetime", f"must be >= 0 (0: never reset), got {p.lifetime}")
    if p.size == 1:
        _check(p.lifetime == 0, "population.lifetime", "resets need a population: set population.size >= 2")
        _check(not p.axis, "population.axis", "a population axis needs a population: set population.size >= 2")
        return
    _check(not getattr(cls, "resets_inner", False) or p.lifetime == 0, "population.lifetime",
           f"task {cfg.task!r} restarts every outer step from η: its members carry no inner state to reset; "
           "set population.lifetime=0")
    _check(not (p.reduce == "update" and cfg.meta_opt.offload_moments), "population.reduce",
           "update keeps one meta-optimizer per member, in device memory: use reduce=grad with "
           "meta_opt.offload_moments")
    _check(p.lifetime == 0 or p.lifetime >= p.size, "population.lifetime",
           f"{p.lifetime} is shorter than the population ({p.size}): the staggered resets are lifetime/size steps "
           f"apart; use at least {p.size}")


# model fields a run chooses; the others (the architecture) follow a pretrained checkpoint
RUN_MODEL_FIELDS = ("head", "remat", "remat_policy", "param_dtype", "compute_dtype", "attention", "attention_block",
                    "loss_chunk", "scan_layers")
UNROLLED_NOTE_LAYERS = 8  # blocks as straight-line code from which a run is told what they cost to compile


def unrolled_note(cfg: Config) -> str | None:
    """The line that tells a run of many blocks as straight-line code (`model.scan_layers=false`, the main job's
    setting, kept for a model with more layers or a pretrained one) that its compile grows with them, or None.

    On 2 CPU cores a tiny run of 16 such blocks took 78 s to start instead of 22 s as a loop, and 48 blocks 336 s and
    4.6 GB instead of 21 s and 1.3 GB.
    """
    m = cfg.model
    if m.scan_layers or m.n_layers < UNROLLED_NOTE_LAYERS:
        return None
    return (f"note: model.scan_layers=false compiles the model's {m.n_layers} blocks as straight-line code, whose "
            "compile time and memory grow with them; model.scan_layers=true compiles one block as a loop")


def checkpoint_model(source: str, field: str = "inner.init_from") -> tuple[ModelConfig, str] | None:
    """(architecture, directory) of an export / import dir or hf:DIR; None for anything else (a pretrain work dir)."""
    if source.startswith(HF_PREFIX):
        from metatrain import hf

        directory = source[len(HF_PREFIX):]
        return hf.config_from_hf(hf.read_config(directory), os.path.join(directory, "config.json")), directory
    if source and os.path.isfile(os.path.join(source, "export.json")):
        with open(os.path.join(source, "export.json")) as f:
            saved = json.load(f).get("model")
        if not saved:
            raise ConfigError(f"{field}: {source} holds parameters that are not a model's")
        return ModelConfig(**saved), source
    return None


def meta_model_config(cfg: Config, check_vocab: bool = True) -> ModelConfig | None:
    """The meta model's architecture (`meta_model`), None when it is the inner model's. It reads the inner model's
    tokens, so it has the inner model's vocabulary (a checkpoint with another vocabulary is refused) and the run's
    own settings (remat, dtypes, attention)."""
    m = cfg.meta_model
    if not m.given:
        return None
    if m.init_from:
        found = checkpoint_model(m.init_from, "meta_model.init_from")
        if found is None:
            raise ConfigError(f"meta_model.init_from: {m.init_from!r} is not a `metatrain export` / `metatrain import "
                              "hf` dir or hf:DIR")
        model = found[0]
        if check_vocab and model.vocab_size != cfg.model.vocab_size:
            raise ConfigError(f"meta_model.init_from: {m.init_from} has a vocabulary of {model.vocab_size} tokens, the "
                              f"inner model {cfg.model.vocab_size}; the scorer reads the inner model's tokens: give "
                              "a checkpoint with the same tokenizer")
        return _scorer(model, m, cfg.model)
    try:
        base = preset(m.preset) if m.preset else cfg.model
    except ConfigError as e:
        raise ConfigError(f"meta_model.preset: {e}") from None
    return _scorer(base, m, cfg.model)


def _scorer(model: ModelConfig, m: MetaModelConfig, inner: ModelConfig) -> ModelConfig:
    fields = {k: getattr(m, k) for k in ("d_model", "n_layers", "n_heads", "d_ff") if getattr(m, k)}
    try:
        return model.replace(**fields, vocab_size=inner.vocab_size, head=m.head, causal=m.causal,
                             **{k: getattr(inner, k) for k in RUN_MODEL_FIELDS if k != "head"})
    except ConfigError as e:  # the model's own check names model.FIELD: here it is meta_model.FIELD
        message = str(e)
        raise ConfigError(re.sub(r"(?<![\w.])model\.", "meta_model.", message) if message.startswith("model.") else
                          f"meta_model: {message}") from None


def follow_pretrained(cfg: Config, tokenizer_given: bool) -> Config:
    """With `inner.init_from` an export / import dir or hf:DIR, the model's architecture comes from the checkpoint,
    and so does the tokenizer (`hf:` its dir) where it has a tokenizer.json and `data.tokenizer` is not given."""
    found = checkpoint_model(cfg.inner.init_from)
    if found is None:
        return cfg  # a pretrain work dir: the run states its model, and the checkpoint must match it
    model, directory = found
    model = model.replace(**{name: getattr(cfg.model, name) for name in RUN_MODEL_FIELDS})
    data = cfg.data
    if not tokenizer_given and os.path.isfile(os.path.join(directory, "tokenizer.json")):
        data = dataclasses.replace(data, tokenizer=HF_PREFIX + directory)
    return dataclasses.replace(cfg, model=model, data=data)


def _dotlist(overrides) -> OmegaConf:
    """The overrides as a config; a value that is not valid YAML is refused naming its key."""
    import yaml

    for override in overrides:
        try:
            OmegaConf.from_dotlist([override])
        except yaml.YAMLError as e:
            raise ConfigError(f"{override_key(override)}: {override.partition('=')[2]!r} cannot be read as a value "
                              f"({str(e).splitlines()[0]}); quote it, e.g. {override_key(override)}='...'") from None
    return OmegaConf.from_dotlist(list(overrides))


def _preset_config(preset: str):
    """A preset's config: a shipped preset by name, or a YAML file of `key: value` groups (refused in one line when
    missing, not UTF-8, not YAML, or not a mapping)."""
    import yaml

    if not preset.endswith((".yaml", ".yml")):
        text = presets().get(preset)
        if text is None:
            raise ConfigError(f"preset: no config {preset!r}; choose one of {sorted(presets())} or give a .yaml "
                              "path")
        return OmegaConf.create(text)
    if os.path.isdir(preset):
        raise ConfigError(f"preset: {preset} is a directory, not a YAML file")
    try:
        text = read_text(preset)
    except UnicodeDecodeError as e:
        raise ConfigError(f"preset: {preset} is not UTF-8 text (byte {e.object[e.start]:#04x} at position "
                          f"{e.start}); save it as UTF-8") from None
    if text is None:
        raise ConfigError(f"preset: {preset}: no such file")
    try:
        node = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _not_yaml(preset, e) from None
    if node is None:
        return OmegaConf.create({})
    if not isinstance(node, dict):
        kind = {list: "a list", str: "plain text"}.get(type(node), f"a {type(node).__name__}")
        raise ConfigError(f"preset: {preset} holds {kind}, not a mapping of settings; write "
                          "`key: value` lines, e.g. `task: maml` and `model: {d_model: 64}`")
    try:  # read again by OmegaConf's loader: it takes `1e-3` as a number, PyYAML's does not; it refuses a key twice
        return OmegaConf.create(text)
    except yaml.YAMLError as e:
        raise _not_yaml(preset, e) from None


def _not_yaml(preset: str, e) -> ConfigError:
    """A YAML reader's error as one line: where in the file, and what."""
    where = getattr(e, "problem_mark", None)
    at = f"line {where.line + 1}, column {where.column + 1}: " if where else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return ConfigError(f"preset: {preset} is not valid YAML ({at}{problem})")


@functools.cache
def _field_types(cls: type) -> dict:
    """A config dataclass's fields' types (its annotations resolved once: `typing.get_type_hints` is slow)."""
    import typing

    return typing.get_type_hints(cls)


def _refuse_groups(keys, where: str = "") -> None:
    """A key given a value that names a whole group (`model=1`, `inner.lora=4`, `model: 3` in a YAML file) is
    refused, naming one of the group's keys."""
    for key in keys:
        node = _field_type(key)
        if dataclasses.is_dataclass(node):
            raise ConfigError(f"{key}{where}: a group of settings, not a value; set its keys, e.g. "
                              f"{key}.{dataclasses.fields(node)[0].name}=...")


def _field_type(key: str):
    """The type of the config field a dotted key names (None: no such field)."""
    node = Config
    for part in key.split("."):
        node = _field_types(node).get(part) if dataclasses.is_dataclass(node) else None
    return node


@functools.cache
def _all_keys(cls: type | None = None, prefix: str = "") -> tuple[str, ...]:
    """Every settable dotted key of the config (its values', not its groups')."""
    out = []
    for name, kind in _field_types(cls or Config).items():
        out += _all_keys(kind, f"{prefix}{name}.") if dataclasses.is_dataclass(kind) else [prefix + name]
    return tuple(out)


def _unknown_key(key: str) -> str:
    """Why `key` is refused where the config has no such setting, with the key(s) it most likely meant: those it
    ends (`lora.rank` of `inner.lora.rank`), else those of its last name (`state_dtype`), else those it starts
    (`data.shuffle`), else a close spelling."""
    import difflib

    keys, leaf = _all_keys(), key.rpartition(".")[2]
    close = ([k for k in keys if k.endswith("." + key)] or [k for k in keys if k.rpartition(".")[2] == leaf]
             or [k for k in keys if k.startswith(key)] or difflib.get_close_matches(key, keys, n=1, cutoff=0.8))
    hint = f"did you mean {' or '.join(close[:3])}?" if close else ("`python -m metatrain.reference` lists every key "
                                                                      "(docs/configuration.md)")
    return f"no such setting; {hint}"


def _refuse_numbers_as_switches(node, where: str = "") -> None:
    """A switch (a bool key) given a whole number other than 0 or 1 (`model.remat=5`, `remat: 2` in a YAML file) is
    refused in one line: OmegaConf reads any such number as true, which hides a key given a count by mistake."""
    for key in _keys(node, groups=False):
        value = OmegaConf.select(node, key, throw_on_resolution_failure=False)
        if (isinstance(value, int) and not isinstance(value, bool) and value not in (0, 1)
                and _field_type(key) is bool):
            leaf = key.rpartition(".")[2]
            fix = f"`{leaf}: true` or `{leaf}: false`" if where else f"{key}=true or {key}=false"
            raise ConfigError(f"{key}{where}: {value} is not true or false; write {fix}")


# OmegaConf's words for a value of the wrong type: "Value 'abc' of type 'str' could not be converted to Integer",
# "Value 'maybe' is not a valid bool (type str)"
_WRONG_TYPE = re.compile(r"Value '(.*)' (?:of type '\w+' could not be converted to (Integer|Float)"
                         r"|is not a valid bool)")


def _wrong_type(why: str, key: str, given: str | None, where: str = "") -> str:
    """OmegaConf's message for a value of the wrong type, said as what the key takes (the value as the user wrote it,
    where known); any other message unchanged."""
    m = _WRONG_TYPE.match(why)
    if not m or not key:
        return why
    value, kind = given or m.group(1), m.group(2)
    try:  # a number as it is written, any other text quoted
        float(value)
    except ValueError:
        value = repr(value)
    if kind == "Integer":
        return f"{value} is not a whole number; write it in digits, without a decimal point or exponent"
    if kind == "Float":
        return f"{value} is not a number"
    leaf = key.rpartition(".")[2]
    return f"{value} is not true or false; write " + (f"`{leaf}: true` or `{leaf}: false`" if where
                                                        else f"{key}=true or {key}=false")


def _keys(node, prefix: str = "", groups: bool = True) -> list[str]:
    """The dotted keys of a YAML mapping: its groups' and its values' (`groups=False`: its values' only)."""
    out = []
    for key, value in (node.items() if OmegaConf.is_dict(node) else ()):
        if groups or not OmegaConf.is_dict(value):
            out.append(prefix + str(key))
        out += _keys(value, f"{prefix}{key}.", groups)
    return out


_ABSENT = object()


def _upgrade_yaml(node, where: str) -> None:
    """A preset or saved YAML file's renamed keys (`RENAMED`) and `metagrad.mode` value (`RENAMED_MODES`) moved to
    their new names in place, each with a RenamedWarning."""
    for old, new in RENAMED.items():
        value = OmegaConf.select(node, old, default=_ABSENT)
        if value is _ABSENT:
            continue
        renamed(f"{old} (in {where})", new, stacklevel=4)
        parent, _, leaf = old.rpartition(".")
        del (OmegaConf.select(node, parent) if parent else node)[leaf]
        OmegaConf.update(node, new, value, force_add=True)
    mode = OmegaConf.select(node, "metagrad.mode", default=None)
    if isinstance(mode, str) and mode in RENAMED_MODES:
        renamed(f"metagrad.mode: {mode} (in {where})", f"metagrad.mode: {RENAMED_MODES[mode]}", stacklevel=4)
        OmegaConf.update(node, "metagrad.mode", RENAMED_MODES[mode])


def _upgrade_overrides(overrides) -> list[str]:
    """`key=value` overrides with renamed keys (`RENAMED`) and `metagrad.mode` values (`RENAMED_MODES`) under their
    new names, each with a RenamedWarning."""
    out = []
    for override in overrides:
        key, _, value = override.partition("=")
        key = key.strip()
        if key in RENAMED:
            renamed(key, RENAMED[key], stacklevel=4)
            key = RENAMED[key]
        if key == "metagrad.mode" and value.strip() in RENAMED_MODES:
            value = mode_name(value.strip(), "metagrad.mode={}", stacklevel=5)
        out.append(f"{key}={value}")
    return out


def override_key(override: str) -> str:
    """The key a `key=value` override sets (`data.batch` of ` data.batch=2`)."""
    return override.split("=")[0].strip()


def load(preset: str | None = None, overrides: list[str] = (), pretrained: bool = True) -> Config:
    """Defaults ← `configs/<preset>.yaml` (or a YAML path) ← `key=value` overrides; validated. With `pretrained`
    the model follows `inner.init_from`'s checkpoint (`follow_pretrained`); False reads a saved config as it is."""
    cfg, tokenizer_given = _merged(preset, overrides)
    cfg = local_paths(cfg)
    given = {override_key(o) for o in overrides}
    if preset == "default" and "data.corrupt_fraction" not in given and cfg.data.source.startswith(PATH_SOURCES):
        # the default preset corrupts 30% of the built-in corpus for its demonstration, never the user's documents
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, corrupt_fraction=0.0))
    if not pretrained:
        return dataclasses.replace(validate(dataclasses.replace(cfg, inner=InnerConfig())), inner=cfg.inner)
    return follow_pretrained(validate(cfg), tokenizer_given)


def check(preset: str | None = None, overrides: list[str] = ()) -> Config:
    """A run config checked where the run does not start (`metatrain.launch.tpu`, before it creates or ships anything):
    its keys, types and values, as `load` checks them, but no file it names is read or looked for (they are the
    run's machine's).

    Args:
      preset: a preset name or YAML path, as `load` takes it.
      overrides: `key=value` strings.

    Returns:
      The merged `Config`, its paths as given.

    Raises:
      ConfigError: one line naming the key and what is wrong.
    """
    return validate(_merged(preset, overrides)[0], local_files=False)


PRESET_FIRST = "a preset goes first, before the overrides"
NO_PRESET = "this command takes no preset or run dir: the model and shapes come from its flags, see --help"


def check_syntax(overrides: list[str], bare: str = PRESET_FIRST) -> None:
    """Refuse an override that is not `key=value`, in one line.

    Args:
      overrides: the command's overrides.
      bare: what a bare word (no `=`) is told: where the command takes a preset (`train`) or a run config instead
        (`NO_PRESET` for `bench` and `check-grads`).

    Raises:
      ConfigError: the first override that is not `key=value`.
    """
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if not bad:
        return
    hint = f" ({bare})" if "=" not in bad[0] else ""
    raise ConfigError(f"override {bad[0]!r}: write overrides as key=value, e.g. steps=100{hint}")


def _merged(preset: str | None, overrides: list[str]) -> tuple[Config, bool]:
    """(defaults ← preset ← overrides, typed; whether a data.tokenizer was given), not yet validated."""
    tokenizer_given = any(override_key(o) == "data.tokenizer" for o in overrides)
    try:
        merged = OmegaConf.structured(Config)
        if preset:
            preset_cfg = _preset_config(preset)
            _upgrade_yaml(preset_cfg, preset)
            _refuse_groups(_keys(preset_cfg, groups=False), f" in {preset}")
            _refuse_numbers_as_switches(preset_cfg, f" in {preset}")
            tokenizer_given |= OmegaConf.select(preset_cfg, "data.tokenizer") is not None
            try:
                merged = OmegaConf.merge(merged, preset_cfg)
            except OmegaConfBaseException as e:
                key, why = getattr(e, "full_key", None) or "config", str(e).splitlines()[0]
                if why.startswith("Incompatible value 'None'"):  # `steps:` with nothing after it: YAML's null
                    why = f"no value; write one after the colon (`{key.split('.')[-1]}: ...`)"
                elif why.startswith("Key '") and " not in " in why:
                    key = next((k for k in _keys(preset_cfg, groups=False) if k.startswith(key + ".")), key)
                    why = _unknown_key(key)
                else:
                    why = _wrong_type(why, key, None, f" in {preset}")
                raise ConfigError(f"{key} in {preset}: {why}") from None
        check_syntax(overrides)
        overrides = _upgrade_overrides(overrides)
        _refuse_groups([override_key(o) for o in overrides])
        given = _dotlist(overrides)
        _refuse_numbers_as_switches(given)
        merged = OmegaConf.merge(merged, given)
        cfg = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        why = str(e).splitlines()[0]
        given = next((o.partition("=")[2] for o in reversed(overrides) if override_key(o) == key), "")
        if key in [f"data.{name}" for name in SOURCE_FIELDS] and missing_path(given):  # YAML reads `jsonl:` as a
            why = missing_path(given)  # mapping; the line DataConfig gives the text 'jsonl:'
        elif "Cannot convert 'DictConfig'" in why or "Cannot convert 'ListConfig'" in why:
            why = "the value reads as YAML structure (a 'name: value' pair or a list), not text; quote or complete it"
        elif why.startswith("Incompatible value 'None'"):  # `workdir=`: OmegaConf reads an empty value as null
            why = f"no value after '='; give one, e.g. {key}=..." if key else "a setting is empty; give it a value"
        elif key and why.startswith("Key '") and " not in " in why:  # OmegaConf: "Key 'x' not in 'Config'"
            # (it names the first unknown part: `lora` of `lora.rank`; the message names the key as given)
            key = next((k for k in map(override_key, overrides) if k == key or k.startswith(key + ".")), key)
            why = _unknown_key(key)
        else:
            why = _wrong_type(why, key, given)
        raise ConfigError(f"{key or 'config'}: {why}") from None
    except (TypeError, ValueError) as e:  # the dataclasses' own checks (e.g. ModelConfig.__post_init__)
        raise ConfigError(str(e).splitlines()[0]) from None
    return cfg, tokenizer_given


def local_paths(cfg: Config) -> Config:
    """`cfg` with every path it names (work dir, checkpoints to start from, data sources, tokenizer dir, TFDS data
    dir) made absolute, `~` expanded: the run reads the same files from wherever it is started."""
    d = cfg.data
    data = dataclasses.replace(d, source=paths.prefixed(d.source, PATH_SOURCES),
                               outer_source=paths.prefixed(d.outer_source, PATH_SOURCES),
                               eval_source=paths.prefixed(d.eval_source, PATH_SOURCES),
                               tokenizer=paths.prefixed(d.tokenizer, (HF_PREFIX,)), data_dir=paths.local(d.data_dir),
                               chat_template=paths.local(d.chat_template))
    return dataclasses.replace(
        cfg, workdir=paths.local(cfg.workdir), data=data,
        inner=dataclasses.replace(cfg.inner, init_from=paths.prefixed(cfg.inner.init_from, (HF_PREFIX,), bare=True)),
        meta_model=dataclasses.replace(cfg.meta_model, init_from=paths.prefixed(cfg.meta_model.init_from,
                                                                                (HF_PREFIX,), bare=True)))


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(cfg: Config) -> dict[str, object]:
    """`{"model.d_model": 64, ...}`: every leaf field under its dotted name, in declaration order."""
    out = {}

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                out[prefix + f.name] = value

    walk(cfg, "")
    return out


def read_text(path: str) -> str | None:
    from etils import epath

    p = epath.Path(path)
    return p.read_text() if p.exists() else None


def write_text(path: str, text: str) -> None:
    """`text` at `path`, its folder made if missing. A local file is written through a temporary one
    (`paths.staged_file`), so a run killed while it rewrites its config.yaml on resume keeps the one it had; an object
    store's write (gs://...) is whole or nothing already."""
    if not paths.is_remote(path):
        with paths.staged_file(os.path.abspath(path)) as tmp, open(tmp, "w") as f:
            f.write(text)
        return
    from etils import epath

    p = epath.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
