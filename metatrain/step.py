"""The outer step: the one program the Trainer runs and every tool compiles.

`meta_program(cfg, mesh)` maps a run config to a `Program`: the task, `init(key) -> state` and
`step(state, batches, outer_batch) -> (state, metrics)` as pure functions over plain pytrees, the
mesh, and the data shapes. `lower(program)` is its single jitted and lowered form (state donated,
state FSDP-sharded by the models' logical axes, batches split over data x fsdp, metrics replicated).
The Trainer runs `lower(program).compile()`; `metatrain compile`, `bench memory`, `bench fit`, `bench
time` and `mode: auto` compile the same lowering, so every figure they print is of the program that
runs (the pattern of maxtext's `train_compile.py`).

State is a dict pytree: `step`, `meta` (η), `meta_opt`, `inner` (θ, υ) carried between outer steps
(None for tasks that restart from η), and with `baseline=uniform` a second inner state `base` trained
on the same batches with η frozen (`Task.baseline_meta`; for loss weighting: exactly uniform weights).
Under LoRA `frozen` holds the base weights: an FSDP-sharded argument of the step, returned unchanged
(donated, so aliased: no copy), never differentiated, and not written to checkpoints (`checkpointed`).
With `meta_opt.offload_moments` the meta-optimizer state's matrices live in host memory (`Program.state_shardings`)
and are copied to the device for the meta-update only; with `meta_opt.offload_params` η's matrices too, copied
in at the step's start (the inner loop starts from them) and again for the update.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from metatrain import collector, population
from metatrain.config import AUTO, Config, MetaOptConfig, meta_model_config
from metatrain.data.pipeline import DataConfig, device_features
from metatrain.models import dense
from metatrain.plan import Plan
from metatrain.plan import choose as choose_plan
from metatrain.sharding import abstract, batch_sharding, replicated, tree_shardings
from metatrain.tasks import Task, make_task
from metatrain.unroll import MetaGradMethod, meta_value_and_grad, offloadable, outer_loss

State = dict
Batches = tuple[dict, dict]  # (inner batches [T, batch, seq+1], outer batch [batch, seq+1])


def meta_optimizer(o: MetaOptConfig, steps: int) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and an optional linear warmup / warmup-cosine schedule."""
    if o.schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(0.0, o.lr, max(o.warmup_steps, 1), steps)
    else:
        lr = optax.linear_schedule(0.0, o.lr, o.warmup_steps) if o.warmup_steps else o.lr
    return optax.chain(optax.clip_by_global_norm(o.clip_norm), optax.adamw(lr, eps=o.eps, weight_decay=o.weight_decay))


def keep_if(ok: jax.Array, new, old):
    """`new` where `ok`, else `old`, leaf by leaf: a non-finite update never reaches the state."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def all_finite(tree) -> jax.Array:
    """True when every floating-point entry of the pytree is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


# ---- the meta-training program ---------------------------------------------------------------
def init_state(task: Task, meta_opt: optax.GradientTransformation, baseline: bool, key: jax.Array,
               members: int = 1, reset_to_pretrained: bool = False) -> State:
    """The state at the start of meta-training (see the module docstring).

    Args:
      task: the task.
      meta_opt: the meta-optimizer as the state holds it (`population.stack_optimizer` for one per member).
      baseline: add the uniform baseline's state.
      key: a JAX random key.
      members: the population's size: with more than one, `inner` is stacked over the members.
      reset_to_pretrained: add `reset_to`, the θ population resets go back to (`inner.init_from`'s, once placed).

    Returns:
      The state dict.
    """
    k_meta, k_inner = jax.random.split(key)
    meta = task.init_meta(k_meta)
    if task.resets_inner:
        inner = None
    else:
        inner = task.init_inner(k_inner, meta) if members == 1 else population.init_inner(task, k_inner, meta, members)
    state = {"step": jnp.zeros((), jnp.int32), "meta": meta, "meta_opt": meta_opt.init(meta), "inner": inner}
    if baseline:
        state["base"] = {"meta": task.baseline_meta(meta), "inner": task.init_inner(k_inner, meta)}
    if task.lora is not None:
        state["frozen"] = task.init_frozen(k_inner)
    if reset_to_pretrained:
        state["reset_to"] = task.init_params(k_inner)
    return state


NOT_CHECKPOINTED = ("frozen", "reset_to")  # rebuilt at start-up from inner.init_from


def checkpointed(state: State) -> State:
    """The part of the state a checkpoint holds: all but the frozen LoRA base and a population's reset weights
    (both rebuilt from `inner.init_from`)."""
    return {k: v for k, v in state.items() if k not in NOT_CHECKPOINTED}


def host_placed(shardings, shapes):
    """`shardings` with the leaves that `offloadable` picks (matrices and up) in host memory (pinned_host)."""
    return jax.tree.map(lambda s, x: s.with_memory_kind("pinned_host") if offloadable(x) else s, shardings, shapes)


def to_device(tree):
    """The tree's host-memory leaves copied to the device (inside a jitted program; a no-op for the others)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if offloadable(x) else x, tree)


def on_device(tree):
    """The tree with its host-memory leaves (`meta_opt.offload_params`' η) copied to device memory, outside a jitted
    program: for the programs that compute on them (evaluation, scoring)."""
    host = lambda x: getattr(getattr(x, "sharding", None), "memory_kind", None) == "pinned_host"
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")) if host(x) else x, tree)


def outer_step(task: Task, method: MetaGradMethod, meta_opt: optax.GradientTransformation, state: State,
               batches: dict, outer_batch: dict, offload_moments: bool = False,
               offload_params: bool = False) -> tuple[State, dict]:
    """T inner steps, the outer loss, its meta-gradient and the meta-update. The update is kept only when the
    loss, the meta-gradient and the updated η and meta-optimizer state are all finite. `offload_moments`: the
    meta-optimizer state arrives in host memory and is brought to the device for the update only (`lower`'s
    shardings send the new one back); `offload_params`: η's matrices too, brought in for the inner loop and again
    for the update."""
    task = task.with_frozen(state.get("frozen"))
    meta = to_device(state["meta"]) if offload_params else state["meta"]
    (value, aux), grad = meta_value_and_grad(task, method)(meta, state["inner"], batches, outer_batch)
    grad_norm = optax.tree.norm(grad)
    opt_state = state["meta_opt"]
    # Host-memory state comes in inside a conditional on the meta-gradient: the compiler may not start the copy
    # before the backward pass is done (as a plain transfer, the TPU compiler starts it at the program's start and
    # holds it throughout). η's first copy is freed once the forward pass no longer reads it, unless the backward
    # pass keeps it.
    if offload_moments:
        opt_state = jax.lax.cond(jnp.isfinite(grad_norm), to_device, to_device, opt_state)
    if offload_params:
        meta = jax.lax.cond(jnp.isfinite(grad_norm), to_device, to_device, state["meta"])
    updates, new_opt = meta_opt.update(grad, opt_state, meta)
    new_meta = optax.apply_updates(meta, updates)
    ok = jnp.isfinite(value) & jnp.isfinite(grad_norm) & all_finite(new_meta) & all_finite(new_opt)
    new = {"step": state["step"] + 1, "meta": keep_if(ok, new_meta, meta),
           "meta_opt": keep_if(ok, new_opt, opt_state),
           "inner": None if task.resets_inner else keep_if(ok, aux.inner, state["inner"])}
    if "frozen" in state:
        new["frozen"] = state["frozen"]
    metrics = {"outer_loss": value, "inner_loss": aux.inner_losses.mean(), "meta_grad_norm": grad_norm, "finite": ok}
    if "base" in state:
        base = state["base"]
        base_value, base_aux = outer_loss(task.baseline_task(), method)(base["meta"], base["inner"], batches,
                                                                        outer_batch)
        new["base"] = {"meta": base["meta"], "inner": base_aux.inner}
        metrics.update(baseline_outer_loss=base_value, baseline_inner_loss=base_aux.inner_losses.mean())
    return new, metrics


def place_pretrained(task: Task, meta_opt: optax.GradientTransformation, state: State, params,
                     members: int = 1) -> State:
    """The state with pretrained inner-model parameters in place (`inner.init_from`): under LoRA the frozen base,
    else see `Task.place_pretrained`; every member of a population (`members` > 1) starts from them."""
    if task.lora is not None:
        return dict(state, frozen=params)
    meta, inner = task.place_pretrained(params, state["meta"], state["inner"])
    if members > 1 and not task.resets_inner:  # every member starts from the pretrained weights
        inner = population.stacked([task.place_pretrained(params, meta, None)[1]] * members)
    new = dict(state, meta=meta, inner=inner, meta_opt=meta_opt.init(meta))
    if "reset_to" in state:
        new["reset_to"] = params
    if "base" in state:
        new["base"] = {"meta": task.baseline_meta(meta),
                       "inner": task.place_pretrained(params, meta, state["base"]["inner"])[1]}
    return new


def place_scorer(task: Task, meta_opt: optax.GradientTransformation, state: State, params) -> State:
    """The state with a pretrained meta model in η (`meta_model.init_from`); see `LossWeighting.place_scorer`."""
    meta = task.place_scorer(params, state["meta"])
    new = dict(state, meta=meta, meta_opt=meta_opt.init(meta))
    if "base" in state:
        new["base"] = dict(state["base"], meta=task.baseline_meta(meta))
    return new


# ---- a program: what to lower, and where ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Program:
    """One run's outer step, ready to lower: pure functions over plain pytrees and the mesh they run on."""

    task: Task
    init: Callable[[jax.Array], State]  # key -> state
    step: Callable[[State, dict, dict], tuple[State, dict]]  # (state, batches, outer batch) -> (state, metrics)
    mesh: jax.sharding.Mesh
    data: DataConfig
    meta_opt: optax.GradientTransformation | None = None  # as the state holds it; None for plain (pre)training
    method: MetaGradMethod | None = None
    offload_moments: bool = False  # the meta-optimizer state's matrices live in host memory between steps
    offload_params: bool = False  # and η's
    members: int = 1  # the population's size: the inner state is stacked over the members
    stacked_meta_opt: bool = False  # and the meta-optimizer state too (population.reduce=update)

    @property
    def plan(self) -> Plan | None:
        """The inner-loop program its meta-gradient is computed with (`plan.choose`); None for plain training."""
        return None if self.method is None else choose_plan(self.method, self.data.inner_steps, self.task.model)

    @functools.cached_property
    def state_shapes(self) -> State:
        return jax.eval_shape(self.init, jax.random.key(0))

    @functools.cached_property
    def state_shardings(self) -> State:
        shapes = self.state_shapes
        if self.members > 1:  # the members' leading axis unsplit; each member as a one-member state is sharded
            one = population.member
            shapes = dict(shapes, inner=one(shapes["inner"]),
                          meta_opt=one(shapes["meta_opt"]) if self.stacked_meta_opt else shapes["meta_opt"])
        shardings = tree_shardings(shapes, self.mesh)
        if self.members > 1:
            shardings["inner"] = population.member_shardings(shardings["inner"])
            if self.stacked_meta_opt:
                shardings["meta_opt"] = population.member_shardings(shardings["meta_opt"])
        if self.offload_moments:
            shardings["meta_opt"] = host_placed(shardings["meta_opt"], self.state_shapes["meta_opt"])
        if self.offload_params:
            shardings["meta"] = host_placed(shardings["meta"], self.state_shapes["meta"])
        return shardings


def meta_program(cfg: Config, mesh: jax.sharding.Mesh, mode: str | None = None,
                 kept_states: str | None = None) -> Program:
    """The meta-training program of a run config: the one place config becomes task, optimizer and method.

    Args:
      cfg: the run's `Config` (`cfg.model` is used as given).
      mesh: the device mesh (`data` x `fsdp`) the program runs on.
      mode: a meta-gradient mode overriding `cfg.metagrad.mode` (`metagrad.mode=auto` tries each).
      kept_states: overrides `cfg.metagrad.kept_states` likewise.

    Returns:
      A `Program`: task, init and step functions, mesh, shapes; `program.plan` names its inner-loop program.
    """
    task = make_task(cfg.task, **task_arguments(cfg))
    meta_opt = meta_optimizer(cfg.meta_opt, cfg.steps)
    g = cfg.metagrad  # the same fields as MetaGradMethod's, where `auto` may stand until overridden here; where it
    # is not (the state's shapes of an `auto` run), a candidate stands in: the state is the same for every candidate
    method = MetaGradMethod(**dataclasses.asdict(g) | {
        "mode": mode or ("mixflow" if g.mode == AUTO else g.mode),
        "kept_states": kept_states or ("every_step" if g.kept_states == AUTO else g.kept_states)})
    o, pop = cfg.meta_opt, cfg.population
    stacked = pop.size > 1 and pop.reduce == "update"
    held_opt = population.stack_optimizer(meta_opt, pop.size) if stacked else meta_opt
    init = functools.partial(init_state, task, held_opt, cfg.baseline == "uniform", members=pop.size,
                             reset_to_pretrained=resets_to_pretrained(cfg))
    if pop.size > 1:
        step = functools.partial(population.step, task, method, meta_opt, pop, cfg.seed, keep_if=keep_if,
                                 all_finite=all_finite)
    else:
        step = functools.partial(outer_step, task, method, meta_opt, offload_moments=o.offload_moments,
                                 offload_params=o.offload_params)
    return Program(task=task, init=init, step=step, mesh=mesh, data=cfg.data, meta_opt=held_opt, method=method,
                   offload_moments=o.offload_moments, offload_params=o.offload_params, members=pop.size,
                   stacked_meta_opt=stacked)


def resets_to_pretrained(cfg: Config) -> bool:
    """Population resets go back to `inner.init_from`'s weights (kept in the state as `reset_to`): with resets, a
    pretrained inner model, and θ the whole model (under LoRA fresh adapters are the base model already)."""
    return bool(cfg.population.lifetime and cfg.inner.init_from and cfg.inner.lora.rank == 0)


def task_arguments(cfg: Config) -> dict:
    """The task's constructor arguments: the model and inner_lr; a separate meta model and LoRA only when asked for
    (a user's task that does not take them is not given them)."""
    args = {"model": cfg.model, "inner_lr": cfg.inner_lr}
    meta_model = meta_model_config(cfg)
    if meta_model is not None:
        args["meta_model"] = meta_model
    if cfg.inner.lora.rank > 0:
        args["lora"] = cfg.inner.lora
    return args


def batch_specs(data: DataConfig, mesh: jax.sharding.Mesh | None = None, members: int = 1) -> Batches:
    """ShapeDtypeStructs of one outer step's batches: inner [T, batch, seq+1], outer [batch, seq+1] (token ids,
    segment ids, positions, conversations' loss mask; a per-example `corrupted` flag), split over data x fsdp when
    a mesh is given; with a population (`members` > 1) each member's, stacked: [members, T, batch, seq+1] and
    [members, batch, seq+1]."""
    def batch(shape, sharding):
        seq = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
               for k in device_features(data) if k != "corrupted"}
        return seq | {"corrupted": jax.ShapeDtypeStruct(shape[:-1], jnp.int32, sharding=sharding)}

    lead = (members,) if members > 1 else ()
    on = members > 1  # the members' axis over the mesh's population axis, where it has one
    inner_sharding, outer_sharding = ((batch_sharding(mesh, leading=len(lead) + 1, members=on),
                                       batch_sharding(mesh, leading=len(lead), members=on)) if mesh is not None
                                      else (None, None))
    return (batch((*lead, data.inner_steps, data.batch, data.seq_len + 1), inner_sharding),
            batch((*lead, data.batch, data.seq_len + 1), outer_sharding))


def random_batches(data: DataConfig, vocab: int, key: jax.Array, members: int = 1) -> Batches:
    """Batches of `batch_specs`' structure filled with random tokens: one document per row, none corrupted."""
    def fill(spec, k):
        return {"tokens": jax.random.randint(k, spec["tokens"].shape, 0, vocab, jnp.int32),
                "segment_ids": jnp.ones(spec["segment_ids"].shape, jnp.int32),
                "positions": jnp.broadcast_to(jnp.arange(data.seq_len + 1, dtype=jnp.int32),
                                              spec["positions"].shape),
                "corrupted": jnp.zeros(spec["corrupted"].shape, jnp.int32)} | (
            {"loss_mask": jnp.ones(spec["loss_mask"].shape, jnp.int32)} if "loss_mask" in spec else {})

    k1, k2 = jax.random.split(key)
    inner, outer = batch_specs(data, members=members)
    return fill(inner, k1), fill(outer, k2)


def lower(program: Program) -> jax.stages.Lowered:
    """The program's outer step, jitted (state donated) and lowered with abstract, sharded inputs.

    Args:
      program: a `Program` (`meta_program` or plain pretraining).

    Returns:
      The `jax.stages.Lowered` step that the Trainer runs and every tool compiles.
    """
    step = jax.jit(program.step, donate_argnums=0,
                   out_shardings=(program.state_shardings, replicated(program.mesh)))
    # the model splits its activations over the mesh as the batch (batch_sharded); on CPU its widening products'
    # weight gradients transpose the narrower operand (models.dense)
    with jax.set_mesh(program.mesh), dense.cpu_products(_on_cpu(program)), collector.paused():
        return step.lower(abstract(program.state_shapes, program.state_shardings),
                          *batch_specs(program.data, program.mesh, program.members))


def init(program: Program, key: jax.Array) -> State:
    """The initial state, allocated with its shardings. It runs once: on CPU it is compiled without LLVM's
    optimisations (the main job's: 4.5 s -> 2.4 s to compile; its values may differ by one float32 ulp).

    Args:
      program: a `Program`.
      key: a JAX random key.

    Returns:
      The state dict (step, η, meta-optimizer state, inner state, ...), placed on the program's mesh.
    """
    lowered = jax.jit(program.init, out_shardings=program.state_shardings).lower(key)
    return lowered.compile(compiler_options={"xla_backend_optimization_level": 0} if _on_cpu(program) else None)(key)


def _on_cpu(program: Program) -> bool:
    return program.mesh.devices.flat[0].platform == "cpu"
