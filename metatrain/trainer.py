"""The Trainer: the one object that owns state (mesh, sharded state, jitted outer step, meta-optimizer,
data streams, logs and checkpoints).

State is a dict pytree: `step`, `meta` (η), `meta_opt`, `inner` (θ, υ) carried between outer steps
(None for tasks that restart from η), and with `baseline=uniform` a second inner state `base` trained on
the same batches with η frozen at its initial value (for loss weighting: exactly uniform weights).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from data.pipeline import Streams, to_global
from metatrain import config as config_lib
from metatrain.config import Config
from metatrain.sharding import abstract, batch_sharding, make_mesh, tree_shardings
from metatrain.tasks import make_task
from metatrain.unroll import Unroll, meta_value_and_grad, outer_loss


class TrainingError(RuntimeError):
    """A run that cannot go on; the message says why and what is intact."""


def meta_optimizer(cfg: Config) -> optax.GradientTransformation:
    o = cfg.meta_opt
    if o.schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(0.0, o.lr, max(o.warmup_steps, 1), cfg.steps)
    else:
        lr = optax.linear_schedule(0.0, o.lr, o.warmup_steps) if o.warmup_steps else o.lr
    return optax.chain(optax.clip_by_global_norm(o.clip_norm), optax.adamw(lr, eps=o.eps, weight_decay=o.weight_decay))


def keep_if(ok: jax.Array, new, old):
    """`new` where `ok`, else `old`, leaf by leaf: a non-finite update never reaches the state."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def progress_bar(total: int, initial: int, desc: str, disable: bool) -> tqdm:
    """A tqdm bar on stderr; where stderr is not a terminal (a log file) it writes a line every 30 s."""
    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, disable=disable, file=sys.stderr, dynamic_ncols=tty,
                mininterval=0.1 if tty else 30.0, ascii=not tty)


class MetricsLog:
    """Metrics as JSON lines (`metrics.jsonl`) and TensorBoard event files (`tensorboard/`) in the work dir."""

    def __init__(self, workdir: str):
        from tensorboardX import SummaryWriter

        self.jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
        self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, metrics: dict):
        self.jsonl.write(json.dumps(metrics) + "\n")
        self.jsonl.flush()
        for k, v in metrics.items():
            if k != "step":
                self.tb.add_scalar(k, v, metrics["step"])
        self.tb.flush()

    def close(self):
        self.jsonl.close()
        self.tb.close()


def roc_auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties counted half (Mann-Whitney U)."""
    pos, neg = scores[positive.astype(bool)], scores[~positive.astype(bool)]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


class Trainer:
    kind = "meta-train"

    def __init__(self, cfg: Config, *, show_progress: bool = True):
        self.cfg = cfg
        self.is_main = jax.process_index() == 0
        self.show_progress = show_progress and self.is_main
        self.mesh = make_mesh(cfg.mesh)
        n_batch_shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        if cfg.data.batch % n_batch_shards:
            raise config_lib.ConfigError(f"data.batch: {cfg.data.batch} does not divide over the {n_batch_shards} "
                                         f"data x fsdp devices; use a multiple of {n_batch_shards}")
        self.streams = Streams(cfg.data)
        model = cfg.model.replace(vocab_size=self.streams.tokenizer.vocab_size)  # the model follows the tokenizer
        self.task = self._make_task(model)
        self.meta_opt = meta_optimizer(cfg)

        shapes = jax.eval_shape(self._init_state, jax.random.key(cfg.seed))
        self.state_shardings = tree_shardings(shapes, self.mesh)
        self.state = jax.jit(self._init_state, out_shardings=self.state_shardings)(jax.random.key(cfg.seed))
        if cfg.inner.init_from:
            self.state = self._start_from(cfg.inner.init_from)
        self._inner_sharding = batch_sharding(self.mesh, leading=1)
        self._outer_sharding = batch_sharding(self.mesh)
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())  # readable on every host
        if "auto" in (cfg.mode, cfg.inner_checkpoint):
            choice = self._choose_auto(replicated)
            mode, schedule = choice["mode"], choice["inner_checkpoint"]
        else:
            mode, schedule = cfg.mode, cfg.inner_checkpoint
        self.unroll = Unroll(mode, cfg.save_inner_grads, schedule)
        self._step = jax.jit(self._outer_step, donate_argnums=0, out_shardings=(self.state_shardings, replicated))
        self._eval_loss = jax.jit(lambda theta, b: self.task.example_losses(theta, b).mean(),
                                  out_shardings=replicated)
        self._replicated = replicated

        if self.is_main:
            os.makedirs(config_lib.log_dir(cfg.workdir), exist_ok=True)
        self.checkpoints = ocp.CheckpointManager(
            config_lib.checkpoint_dir(cfg.workdir),
            options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints, enable_async_checkpointing=True))
        self._stop_requested = False

    # ---- state and the outer step ------------------------------------------------------------
    def _make_task(self, model):
        return make_task(self.cfg.task, model=model, inner_lr=self.cfg.inner_lr)

    def _start_from(self, path: str):
        """The inner model (η for tasks that restart from it) from pretrained parameters at `path`."""
        from metatrain.export import load_params

        which = (lambda s: s["meta"]) if self.task.resets_inner else (lambda s: s["inner"][0])
        target = abstract(which(self.state), which(self.state_shardings))
        try:
            params = load_params(path, target)
        except ValueError as e:
            why = str(e).splitlines()[0].split(". ")[0]
            raise config_lib.ConfigError(
                f"inner.init_from: {path} does not hold parameters of this run's model ({why}); "
                f"pretrain with the same model.* and data.vocab_size settings") from None

        def place(state, params):
            meta, inner = self.task.start_from(params, state["meta"], state["inner"])
            new = dict(state, meta=meta, inner=inner, meta_opt=self.meta_opt.init(meta))
            if "base" in state:
                new["base"] = {"meta": meta, "inner": self.task.start_from(params, meta, state["base"]["inner"])[1]}
            return new

        return jax.jit(place, donate_argnums=0, out_shardings=self.state_shardings)(self.state, params)

    def _init_state(self, key):
        k_meta, k_inner = jax.random.split(key)
        meta = self.task.init_meta(k_meta)
        inner = None if self.task.resets_inner else self.task.init_inner(k_inner, meta)
        state = {"step": jnp.zeros((), jnp.int32), "meta": meta, "meta_opt": self.meta_opt.init(meta),
                 "inner": inner}
        if self.cfg.baseline == "uniform":
            state["base"] = {"meta": meta, "inner": self.task.init_inner(k_inner, meta)}
        return state

    def _outer_step(self, state, batches, outer_batch):
        (value, aux), grad = meta_value_and_grad(self.task, self.unroll)(
            state["meta"], state["inner"], batches, outer_batch)
        grad_norm = optax.tree.norm(grad)
        ok = jnp.isfinite(value) & jnp.isfinite(grad_norm)
        updates, meta_opt = self.meta_opt.update(grad, state["meta_opt"], state["meta"])
        new = {"step": state["step"] + 1,
               "meta": keep_if(ok, optax.apply_updates(state["meta"], updates), state["meta"]),
               "meta_opt": keep_if(ok, meta_opt, state["meta_opt"]),
               "inner": None if self.task.resets_inner else keep_if(ok, aux.inner, state["inner"])}
        metrics = {"outer_loss": value, "inner_loss": aux.inner_losses.mean(), "meta_grad_norm": grad_norm,
                   "finite": ok}
        if "base" in state:
            base_value, base_aux = outer_loss(self.task, self.unroll)(
                state["base"]["meta"], state["base"]["inner"], batches, outer_batch)
            new["base"] = {"meta": state["base"]["meta"], "inner": base_aux.inner}
            metrics.update(baseline_outer_loss=base_value, baseline_inner_loss=base_aux.inner_losses.mean())
        return new, metrics

    def abstract_batches(self):
        """ShapeDtypeStructs of one step's (inner batches [T, batch, seq+1], outer batch), sharded as in training."""
        d = self.cfg.data

        def batch(shape, sharding):
            seq = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
                   for k in ("tokens", "segment_ids", "positions")}
            seq["corrupted"] = jax.ShapeDtypeStruct(shape[:-1], jnp.int32, sharding=sharding)
            return seq

        return (batch((d.inner_steps, d.batch, d.seq_len + 1), batch_sharding(self.mesh, leading=1)),
                batch((d.batch, d.seq_len + 1), batch_sharding(self.mesh)))

    def _choose_auto(self, replicated) -> dict:
        """mode=auto and/or inner_checkpoint=auto: compile the outer step ahead of time for every candidate (each
        mode; every_step and sqrt) and keep the one with the lowest peak memory; candidates within 1% of the
        lowest peak count as tied and the fewest FLOPs wins among them. All candidates compute the same
        meta-gradient (check-grads), so the choice changes memory and time only."""
        from metatrain.memory import compiled_memory
        from metatrain.mixflow import MODES

        modes = MODES if self.cfg.mode == "auto" else (self.cfg.mode,)
        schedules = ("every_step", "sqrt") if self.cfg.inner_checkpoint == "auto" else (self.cfg.inner_checkpoint,)
        state = abstract(self.state, self.state_shardings)
        figures = {}
        for mode, schedule in itertools.product(modes, schedules):
            self.unroll = Unroll(mode, self.cfg.save_inner_grads, schedule)
            compiled = jax.jit(self._outer_step, donate_argnums=0, out_shardings=(self.state_shardings, replicated)
                               ).lower(state, *self.abstract_batches()).compile()
            m = compiled_memory(compiled)
            figures[mode if len(schedules) == 1 else f"{mode}+{schedule}"] = {
                "mode": mode, "inner_checkpoint": schedule, "peak_bytes": m["peak_bytes"], "flops": m["flops"]}
        lowest = min(f["peak_bytes"] for f in figures.values())
        tied = [name for name, f in figures.items() if f["peak_bytes"] <= 1.01 * lowest]
        best = min(tied, key=lambda name: figures[name]["flops"])
        choice = {"mode": figures[best]["mode"], "inner_checkpoint": figures[best]["inner_checkpoint"],
                  "candidates": figures}
        if self.is_main:
            tqdm.write("auto: " + "; ".join(f"{n} peak {f['peak_bytes'] / 2**20:,.1f} MiB, "
                                            f"{f['flops'] / 1e9:,.2f} GFLOPs" for n, f in figures.items())
                       + f" -> mode={choice['mode']} inner_checkpoint={choice['inner_checkpoint']}", file=sys.stderr)
            os.makedirs(config_lib.log_dir(self.cfg.workdir), exist_ok=True)
            with open(os.path.join(config_lib.log_dir(self.cfg.workdir), "mode_auto.json"), "w") as f:
                json.dump(choice, f, indent=1)
        return choice

    def _global_batches(self):
        inner, outer = self.streams.next()
        return to_global(inner, self._inner_sharding), to_global(outer, self._outer_sharding)

    # ---- evaluation ----------------------------------------------------------------------------
    def _theta(self, which: str = "inner"):
        part = self.state if which == "inner" else self.state["base"]
        return part["meta"] if part["inner"] is None else part["inner"][0]

    def validation_loss(self, which: str = "inner") -> float:
        """Mean next-token loss of the inner model on held-out test documents (cfg.eval_batches batches).
        For tasks that restart from η (MAML) the inner model is η itself."""
        batches = self._test_batches()
        return float(np.mean([self._eval_loss(self._theta(which), b) for b in batches]))

    def _test_batches(self):
        if not hasattr(self, "_test_cache"):
            self._test_cache = [to_global(b, self._outer_sharding)
                                for b in self.streams.test_batches(self.cfg.eval_batches)]
        return self._test_cache

    def corrupted_auc(self, max_batches: int = 64) -> float | None:
        """ROC AUC of the meta model's scores for clean (positive) vs corrupted test examples, over at least
        `eval_batches` (and 8) held-out batches, more while one class is missing; NaN if it stays missing."""
        if not hasattr(self.task, "scores") or self.cfg.data.corrupt_fraction <= 0:
            return None
        # scores and flags of the global batch, gathered onto every host
        score = jax.jit(lambda meta, b: (self.task.scores(meta, b), b["corrupted"]), out_shardings=self._replicated)
        n = max(self.cfg.eval_batches, 8)
        batches = [to_global(b, self._outer_sharding) for b in
                   self.streams.test_batches(max_batches, self.cfg.data.corrupt_fraction, seed=777)]
        results = [jax.device_get(score(self.state["meta"], b)) for b in batches[:n]]
        while n < len(batches) and len(np.unique(np.concatenate([f for _, f in results]))) < 2:
            results.append(jax.device_get(score(self.state["meta"], batches[n])))
            n += 1
        scores, flags = (np.concatenate(x) for x in zip(*results))
        return roc_auc(scores, 1 - flags)

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self, force: bool = False):
        step = int(self.state["step"])
        self.checkpoints.save(step, force=force, args=ocp.args.Composite(
            state=ocp.args.StandardSave(self.state), **self.streams.save_args(),
            config=ocp.args.JsonSave({"yaml": config_lib.to_yaml(self.cfg)})))

    def restore(self) -> bool:
        step = self.checkpoints.latest_step()
        if step is None:
            return False
        target = abstract(self.state, self.state_shardings)
        restored = self.checkpoints.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), **self.streams.restore_args()))
        self.state = restored["state"]
        return True

    # ---- the loop ------------------------------------------------------------------------------
    def _on_sigterm(self, *_):
        self._stop_requested = True

    def train(self) -> dict:
        cfg = self.cfg
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)  # every process saves, then stops
        log = MetricsLog(config_lib.log_dir(cfg.workdir)) if self.is_main else None
        start_step = int(self.state["step"])
        summary = {"start_validation_loss": self.validation_loss()}
        bad_in_a_row, skipped = 0, 0
        bar = progress_bar(cfg.steps, start_step, self.kind, disable=not self.show_progress)
        t0 = time.perf_counter()
        try:
            for step in range(start_step, cfg.steps):
                tic = time.perf_counter()
                batches, outer_batch = self._global_batches()
                self.state, metrics = self._step(self.state, batches, outer_batch)
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                metrics.update(step=step + 1, step_time=time.perf_counter() - tic)
                metrics["tokens_per_s"] = batches["tokens"].size / metrics["step_time"]
                if metrics.pop("finite") < 1:
                    bad_in_a_row, skipped = bad_in_a_row + 1, skipped + 1
                    if self.is_main:
                        tqdm.write(f"step {step + 1}: non-finite gradient or loss, update skipped "
                                   f"({bad_in_a_row} in a row)", file=sys.stderr)
                    if bad_in_a_row >= cfg.max_bad_steps:
                        raise TrainingError(
                            f"{bad_in_a_row} non-finite gradients or losses in a row at step {step + 1}; stopping. The "
                            f"last good checkpoint in {cfg.workdir}/checkpoints is intact: lower meta_opt.lr or "
                            f"inner_lr and resume")
                else:
                    bad_in_a_row = 0
                metrics["skipped_updates"] = skipped
                if log and ((step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps):
                    log.write(metrics)
                bar.set_postfix(outer=f"{metrics['outer_loss']:.3f}", inner=f"{metrics['inner_loss']:.3f}",
                                refresh=False)
                bar.update(1)
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                    self.save()
                if self._stop_requested:
                    self.save(force=True)
                    self.checkpoints.wait_until_finished()
                    raise TrainingError(f"stopped by SIGTERM at step {step + 1}; checkpoint saved, "
                                        "run again with --resume to continue")
            self.save(force=True)
            self.checkpoints.wait_until_finished()
        finally:
            bar.close()
            if log:
                log.close()
            signal.signal(signal.SIGTERM, previous)
        summary.update(end_validation_loss=self.validation_loss(), seconds=time.perf_counter() - t0,
                       skipped_updates=skipped)
        if "base" in self.state:
            summary["baseline_validation_loss"] = self.validation_loss("base")
        summary["corrupted_auc"] = self.corrupted_auc()
        return summary
