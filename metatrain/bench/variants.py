"""Variants of the meta-gradient computation, by name, and the run config a benchmark compiles.

A variant is
`MODE[+remat][+save][+sqrt|+binomial][+bf16_state][+offload_states][+offload_moments][+offload_params][+unroll]
[model options]`
(model options: +blockwise, +bf16, +chunked_ce): a meta-gradient mode, per-block rematerialisation, inner
gradients kept with the inner states, a schedule of which inner states are kept, the kept states stored in
bfloat16 and/or in host memory, the meta-optimizer's moments and η in host memory between steps, the inner steps
unrolled (straight-line code, not a loop), and model options
applied over the model it is run on. `run_config` turns a task, a model, the batch shapes
and a variant into the `Config` whose outer step (`metatrain.step`) the benchmarks compile and time.
"""

from __future__ import annotations

import dataclasses
import itertools

from metatrain import config as config_lib
from metatrain.config import Config, MetaGradConfig
from metatrain.errors import ConfigError, renamed
from metatrain.mixflow import MODES
from metatrain.models import LoRAConfig, ModelConfig
from metatrain.tasks import Task, make_task
from metatrain.unroll import KEPT_STATES, MetaGradMethod

# model options a variant name may carry, e.g. `mixflow+remat+save+sqrt+blockwise+bf16`
# (+chunked_ce: the next-token loss 512 positions at a time, no [batch, seq, vocab] logits buffer)
MODEL_OPTIONS = {"blockwise": {"attention": "blockwise"}, "bf16": {"compute_dtype": "bfloat16"},
                 "chunked_ce": {"loss_chunk": 512}}
SCHEDULES = tuple(s for s in KEPT_STATES if s != "every_step")
FORM = ("MODE[+remat][+save][+sqrt|+binomial][+bf16_state][+offload_states][+offload_moments][+offload_params]"
        "[+unroll]"
        "[+blockwise][+bf16][+chunked_ce], e.g. mixflow+remat+save+sqrt+blockwise")
BF16_STATE = "bf16_state"  # the kept inner states (θ_i, υ_i, saved ∇L_i) stored in bfloat16
OFFLOAD_STATES = "offload_states"  # ... and/or kept in host memory until the backward pass
OFFLOAD_MOMENTS = "offload_moments"  # the meta-optimizer's moments in host memory, on the device for the update only
OFFLOAD_PARAMS = "offload_params"  # η in host memory, on the device for the inner loop's start and the update
UNROLL = "unroll"  # the inner steps unrolled: each step's checkpoint its own buffer, freed once used


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to compute the meta-gradient: mode × block remat × saved inner gradients (× which inner states are
    kept, the dtype they are stored in), optionally on a changed model (`model_options`: keys of MODEL_OPTIONS,
    applied over the model given)."""

    mode: str
    remat: bool
    save: bool
    kept_states: str = "every_step"
    model_options: tuple[str, ...] = ()
    state_dtype: str = ""
    offload_states: bool = False
    unroll: bool = False
    offload_moments: bool = False
    offload_params: bool = False

    @property
    def name(self) -> str:
        schedule = "" if self.kept_states == "every_step" else "+" + self.kept_states
        return (self.mode + ("+remat" if self.remat else "") + ("+save" if self.save else "") + schedule
                + ("+" + BF16_STATE if self.state_dtype == "bfloat16" else "")
                + ("+" + OFFLOAD_STATES if self.offload_states else "")
                + ("+" + OFFLOAD_MOMENTS if self.offload_moments else "")
                + ("+" + OFFLOAD_PARAMS if self.offload_params else "")
                + ("+" + UNROLL if self.unroll else "")
                + "".join("+" + o for o in self.model_options))

    def model(self, model: ModelConfig) -> ModelConfig:
        """The model this variant runs: `model` with its block remat and model options."""
        changes = {k: v for o in self.model_options for k, v in MODEL_OPTIONS[o].items()}
        return model.replace(remat=self.remat, **changes)

    @property
    def method(self) -> MetaGradMethod:
        return MetaGradMethod(mode=self.mode, save_inner_grads=self.save, kept_states=self.kept_states,
                              state_dtype=self.state_dtype, offload_states=self.offload_states,
                              unroll=self.unroll)

    def apply(self, cfg: Config) -> Config:
        """`cfg` computing its meta-gradient this way, on this variant's model."""
        return dataclasses.replace(cfg, metagrad=MetaGradConfig(**dataclasses.asdict(self.method)),
                                   meta_opt=dataclasses.replace(cfg.meta_opt, offload_moments=self.offload_moments,
                                                                offload_params=self.offload_params),
                                   model=self.model(cfg.model))


def variants(modes=MODES, kept_states: str = "every_step") -> list[Variant]:
    return [Variant(m, r, s, kept_states) for m, r, s in itertools.product(modes, (False, True), (False, True))]


def parse_variant(name: str, kept_states: str = "every_step") -> Variant:
    """A variant by name; a schedule in the name wins over `kept_states`, model options apply over the
    model the variant is run on. Options may come in any order; `.name` gives them in the canonical one."""
    tokens = name.strip().split("+")
    if any(t in OLD_TOKENS for t in tokens):  # a name of an earlier version: read under today's, with a warning
        now = "+".join(OLD_TOKENS.get(t, t) for t in tokens)
        renamed(f"variant {name.strip()}", now)
        tokens = now.split("+")
    mode, *opts = tokens
    if mode not in MODES:
        raise ConfigError(f"variant {name!r}: unknown mode {mode!r} ({' | '.join(MODES)}); use {FORM}")
    unknown = set(opts) - {"remat", "save", BF16_STATE, OFFLOAD_STATES, OFFLOAD_MOMENTS, OFFLOAD_PARAMS, UNROLL,
                           *SCHEDULES, *MODEL_OPTIONS}
    if unknown:
        raise ConfigError(f"variant {name!r}: unknown option(s) {sorted(unknown)}; use {FORM}")
    schedules = [o for o in opts if o in SCHEDULES]
    if len(schedules) > 1:
        raise ConfigError(f"variant {name!r}: one kept-states schedule at most; use {FORM}")
    if BF16_STATE in opts and "save" not in opts:
        raise ConfigError(f"variant {name!r}: +{BF16_STATE} needs +save (a gradient recomputed from rounded "
                          f"parameters is not the one the inner update used); use {FORM}")
    options = tuple(o for o in MODEL_OPTIONS if o in opts)
    return Variant(mode, "remat" in opts, "save" in opts, (schedules or [kept_states])[0], options,
                   "bfloat16" if BF16_STATE in opts else "", OFFLOAD_STATES in opts, UNROLL in opts,
                   OFFLOAD_MOMENTS in opts, OFFLOAD_PARAMS in opts)


# names of earlier versions: variant tokens (in rows and in names given, read with a RenamedWarning) and row keys
OLD_TOKENS = {"default": "autodiff", "offload": OFFLOAD_STATES, "offload_opt": OFFLOAD_MOMENTS}
OLD_KEYS = {"inner_checkpoint": "kept_states", "checkpoint_dtype": "state_dtype",
            "checkpoint_offload": "offload_states", "meta_opt_offload": "offload_moments",
            "meta_opt_offload_params": "offload_params", "checkpoint_bytes": "kept_bytes",
            "checkpoint_live_bytes": "kept_live_bytes"}


def upgrade_row(row: dict) -> dict:
    """A benchmark row written by an earlier version, under today's names (`autodiff` was `default`, ...)."""
    row = {OLD_KEYS.get(k, k): v for k, v in row.items()}
    if isinstance(row.get("variant"), str):
        row["variant"] = "+".join(OLD_TOKENS.get(t, t) for t in row["variant"].split("+"))
    if row.get("mode") == "default":
        row["mode"] = "autodiff"
    return row


def run_config(task: str, model: ModelConfig, seq_len: int, batch: int, inner_steps: int,
               overrides: list[str] = (), variant: Variant | None = None) -> Config:
    """The run config of a benchmark: `task` on `model` with these batch shapes (and `key=value` overrides, e.g.
    `mesh.fsdp=-1`), computing its meta-gradient as `variant` does."""
    config_lib.check_syntax(overrides, config_lib.NO_PRESET)
    if "metagrad.kept_states=auto" in overrides or "metagrad.mode=auto" in overrides:
        raise ConfigError("metagrad.mode / metagrad.kept_states: `auto` is for training runs; name the variants to "
                          "compare instead, e.g. mixflow+remat+save,mixflow+remat+save+sqrt")
    shadowed = [o for o in overrides if config_lib.override_key(o).startswith("model.")
                or config_lib.override_key(o) in ("task", "data.seq_len", "data.batch", "data.inner_steps")]
    if shadowed:
        raise ConfigError(f"{', '.join(shadowed)}: the model, task and batch shapes come from flags here "
                          "(--model, --d-model, --n-layers, ..., --task, --seq-len, --batch, --inner-steps); "
                          "give them as flags")
    cfg = config_lib.load(None, [f"task={task}", f"data.seq_len={seq_len}", f"data.batch={batch}",
                                 f"data.inner_steps={inner_steps}", *overrides])
    cfg = dataclasses.replace(cfg, model=model)
    return variant.apply(cfg) if variant else cfg


def build_task(task: str, model: ModelConfig, remat: bool, inner_lr: float = 1e-2, lora: LoRAConfig | None = None,
               meta_model: ModelConfig | None = None) -> Task:
    """The task with block remat set on the inner model and on its meta model alike (LoRA adapters on the inner
    model when `lora.rank > 0`; the meta model is the inner model's architecture unless given)."""
    extra = {"lora": lora} if lora is not None and lora.rank > 0 else {}
    return make_task(task, model=model.replace(remat=remat), inner_lr=inner_lr,
                     meta_model=(meta_model or model).replace(remat=remat), **extra)
