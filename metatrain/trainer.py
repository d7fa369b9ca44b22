"""The Trainer: the one object that owns state (mesh, sharded state, the compiled outer step, data streams,
logs and checkpoints).

The outer step is `metatrain.step`'s program, compiled ahead of time once (`step.lower(program).compile()`)
and called on every step, so what `metatrain compile` and `bench memory` report is what runs here.
Every exit (the end, SIGTERM or SIGINT, a non-finite stop, an error) waits for checkpoint saves in
flight, and a stop by signal saves the state first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm

from metatrain import aot, auto, distributed, hostmem, paths, population, progress, stops
from metatrain import config as config_lib
from metatrain import step as step_lib
from metatrain import workdir as workdir_lib
from metatrain.aot import check_fits, compiled_memory
from metatrain.checkpoints import Checkpoints, WriteFailed
from metatrain.config import AUTO, Config
from metatrain.data.pipeline import Streams, device_features, to_global
from metatrain.errors import ConfigError, StoppedBySignal, TrainingError
from metatrain.models import dtype_settings, require_float64
from metatrain.sharding import abstract, batch_sharding, check_batch, make_mesh, replicated
from metatrain.tasks import validate
from metatrain.tasks.weight_eval import EvalContext
from metatrain.tracking import MetricsLog, require_wandb

AUTO_CHOICE = "mode_auto.json"  # in the log dir: metagrad `auto`'s choice, which a resumed start takes again

def data_derived(cfg: Config, streams: Streams) -> Config:
    """`cfg` as its run has it once the data is open: the model's vocabulary the tokenizer's, the data's format the
    one the sources hold (`metatrain compile --config` compiles the same program)."""
    return dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=streams.tokenizer.vocab_size),
                               data=dataclasses.replace(cfg.data, format=streams.format))


class _StoppedWaiting(BaseException):
    """A stop signal while the run waits for data (a BaseException, as KeyboardInterrupt is: no reader's `except
    Exception` keeps it from reaching `Trainer.train`)."""


class Trainer:
    """Runs meta-training for a run config: owns the mesh, the sharded state, the compiled outer step, the data
    streams, logs and checkpoints. It knows no particular task: task-specific evaluation comes from
    `Task.evaluation`.

    Args:
      cfg: the run's `Config` (`config.load`).
      show_progress: show a progress bar on process 0.
    """

    kind = "meta-train"

    def __init__(self, cfg: Config, *, show_progress: bool = True):
        require_float64(dtype_settings(cfg.model))
        self.is_main = jax.process_index() == 0
        self.lock = workdir_lib.Lock(cfg.workdir).acquire() if self.is_main else None  # before any compile
        try:
            self._setup(cfg, show_progress)
        except BaseException:
            self.release()
            raise

    def _setup(self, cfg: Config, show_progress: bool):
        if self.is_main:
            require_wandb(cfg)
        self.show_progress = show_progress and self.is_main
        self.mesh = make_mesh(cfg.mesh, population=cfg.population.size if cfg.population.axis else 0)
        check_batch(cfg.data.batch, self.mesh.shape["data"] * self.mesh.shape["fsdp"])
        self.streams = Streams(cfg.data)
        self.cfg = data_derived(cfg, self.streams)
        self._features = device_features(self.cfg.data)
        self._check_evaluation_fits()
        note = config_lib.unrolled_note(self.cfg)
        if note and self.is_main:
            tqdm.write(note, file=sys.stderr)
        self.program = self._program()
        self.task = self.program.task
        self._check_state_fits()
        self.state = step_lib.init(self.program, jax.random.key(cfg.seed))
        if cfg.inner.init_from:  # before the long compile: a checkpoint that does not fit is refused at once
            self.state = self._load_pretrained(cfg.inner.init_from)
        if cfg.meta_model.init_from:
            self.state = self._load_scorer(cfg.meta_model.init_from)
        self._check_base(record=False)  # other base weights than the adapters trained on: refused before compiling
        if self.is_main:  # seconds on a tiny model, minutes on a large one: said before, and how long after
            tqdm.write("compiling the outer step ...", file=sys.stderr)
        started = time.monotonic()
        self.program, self.compiled = self._compile(self.program)
        self.compile_seconds = time.monotonic() - started
        self.memory = compiled_memory(self.compiled)
        check_fits(self.memory, self.mesh.devices.flat)  # before the first step allocates its temporaries
        if self.is_main:
            plan = self.program.plan
            if plan is not None:
                tqdm.write(f"meta-gradient: {plan.name} (mode {self.program.method.mode}, T={cfg.data.inner_steps})",
                           file=sys.stderr)
            self._write_json("outer_step.json", {
                "mesh": dict(self.mesh.shape), **({"plan": plan.name} if plan else {}),
                **(dataclasses.asdict(self.program.method) if self.program.method else {}),
                **({"population": dataclasses.asdict(cfg.population)} if self.program.members > 1 else {}),
                **self.memory})
        self.members = self.program.members
        lead = 1 if self.members > 1 else 0  # a population's batches: one per member, stacked
        self._inner_sharding = batch_sharding(self.mesh, leading=lead + 1, members=bool(lead))
        self._member_outer_sharding = batch_sharding(self.mesh, leading=lead, members=bool(lead))
        self._outer_sharding = batch_sharding(self.mesh)
        self._replicated = replicated(self.mesh)
        # the validation loss is the task's outer loss V(θ, η, x) on held-out batches (for the built-in tasks the mean
        # next-token loss); a task that brings its own model defines no next-token loss of its own
        self._eval_loss = jax.jit(
            lambda theta, meta, frozen, b: self.task.with_frozen(frozen).outer_loss(theta, meta, b),
            out_shardings=self._replicated)
        # processes finish compiling at different times; Orbax's first sync is a Gloo collective (30 s to join)
        self.evaluation = self.task.evaluation(EvalContext(
            self.cfg, self.streams, self._outer_sharding, self._replicated,
            lambda name, payload: self._write_json(name, payload) if self.is_main else None))
        distributed.barrier("compiled")
        self.checkpoints = Checkpoints(cfg.workdir, cfg.keep_checkpoints)
        self.log = None
        self._stop_signal: signal.Signals | None = None
        self._agreed_stops = False  # whether the processes agree on the step to stop at (`train` decides)
        self.continue_hint = "run again with --resume to continue"  # after a stop by signal; callers may say theirs

    def _check_evaluation_fits(self) -> None:
        """The evaluation set (`eval_batches` batches of the validation stream, this process's share of them) is kept
        in memory for every evaluation: refused in one line where it alone passes the memory here, before anything is
        compiled. It was read at the first evaluation, after the training before it, until the process was killed for
        memory."""
        d, n = self.cfg.data, self.cfg.eval_batches
        local = [x for x in self.mesh.devices.flat if x.process_index == jax.process_index()]
        batch = aot.tree_bytes(step_lib.batch_specs(d)[1])  # an outer batch
        need = n * batch * len(local) // self.mesh.devices.size
        cpu = local[0].platform == "cpu"  # a process's CPU devices share the host's memory
        have = aot.memory_here(local[0]) if cpu else sum(aot.memory_here(x) or 0 for x in local)
        if have and need > have:
            raise ConfigError(f"eval_batches: {n:,} batches of {d.batch:,} rows of {d.seq_len + 1:,} tokens, kept in "
                              f"memory for every evaluation, take {hostmem.size(need)}, more than the "
                              f"{hostmem.size(have)} {'available on this machine' if cpu else 'of its devices'}; "
                              f"lower eval_batches")

    def _check_state_fits(self) -> None:
        """The run's state (its models' parameters and optimizer states), from its shapes: refused in one line where
        it passes the memory here, before it is allocated (a model of 100,000 layers was allocated, then the process
        killed for memory)."""
        program, inner = self.program, self.cfg.inner
        fix = ["a smaller pretrained model (inner.init_from)" if inner.init_from
               else "a smaller model (model.n_layers, model.d_model, model.d_ff)"]
        if inner.init_from and not inner.lora.rank:
            fix.append("LoRA adapters in place of training the whole model (inner.lora.rank)")
        if program.members > 1:
            fix.append("fewer population members (population.size)")
        if "base" in program.state_shapes:  # the uniform baseline's model
            fix.append("no baseline (baseline=none)")
        if self.mesh.shape["data"] > 1:  # each data shard holds a copy
            fix.append("FSDP over all the devices (mesh.fsdp=-1)")
        aot.check_state_fits(program.state_shapes, program.state_shardings, self.mesh.devices.flat,
                             "the run's state (its models' parameters and optimizer states)",
                             "use " + ", ".join(fix[:-1]) + (" or " if len(fix) > 1 else "") + fix[-1])

    # ---- the program ---------------------------------------------------------------------------
    def _program(self) -> step_lib.Program:
        """The meta-training program, its task contract checked on shapes before anything compiles."""
        program = step_lib.meta_program(self.cfg, self.mesh)
        shapes = program.state_shapes
        inner = shapes["inner"] if program.members == 1 else population.member(shapes["inner"])  # one member's
        validate(program.task, shapes["meta"], inner, step_lib.batch_specs(self.cfg.data)[1], shapes.get("frozen"))
        return program

    def _compile(self, program: step_lib.Program) -> tuple[step_lib.Program, jax.stages.Compiled]:
        """The compiled outer step; with mode / kept_states `auto` the best candidate's (the state's layout
        is the same for every candidate: they differ in how the meta-gradient is computed)."""
        if program.method is None or AUTO not in (self.cfg.metagrad.mode, self.cfg.metagrad.kept_states):
            return program, aot.compile(step_lib.lower(program))
        saved = os.path.join(workdir_lib.log_dir(self.cfg.workdir), AUTO_CHOICE)
        resumed = workdir_lib.latest_step(self.cfg.workdir) is not None  # (the run's config: checked before)
        choice = auto.earlier(saved, self.cfg, self.mesh) if resumed else None
        if choice is not None:
            program = step_lib.meta_program(self.cfg, self.mesh, choice["mode"], choice["kept_states"])
            tqdm.write(f"auto: metagrad.mode={choice['mode']} metagrad.kept_states={choice['kept_states']}, the "
                       f"choice of the run's first start ({saved})", file=sys.stderr)
            return program, aot.compile(step_lib.lower(program))
        choice, program, compiled = auto.choose(self.cfg, self.mesh)
        if self.is_main:
            tqdm.write(auto.describe(choice), file=sys.stderr)
            self._write_json(AUTO_CHOICE, choice | {"where": auto.where(self.cfg, self.mesh)})
        return program, compiled

    def _write_json(self, name: str, payload: dict) -> None:
        """A JSON file in the log dir (the work dir, or its local mirror for a remote one)."""
        paths.write_json(os.path.join(workdir_lib.log_dir(self.cfg.workdir), name), payload)

    def _load_pretrained(self, path: str):
        """The inner model (η for tasks that restart from it; the frozen base under LoRA) from pretrained parameters at
        `path`."""

        if self.task.lora is not None:
            which = lambda s: s["frozen"]
        elif self.task.resets_inner:
            which = lambda s: s["meta"]
        elif self.program.members > 1:  # one member's θ (every member starts from it)
            which = lambda s: population.member(s["inner"][0])
        else:
            which = lambda s: s["inner"][0]
        place = functools.partial(step_lib.place_pretrained, members=self.program.members)
        return self._placed(path, which, place, "inner.init_from")

    def _load_scorer(self, path: str):
        """The meta model from pretrained parameters at `path` (`meta_model.init_from`)."""
        if not self.task.uses_meta_model:
            raise ConfigError(f"meta_model.init_from: task {self.cfg.task!r} has no meta model to start from "
                              f"{path} (loss_weighting has one)")
        return self._placed(path, lambda s: self.task.scorer_body(s["meta"]["lm"]), step_lib.place_scorer,
                            "meta_model.init_from")

    def _placed(self, path: str, which, place, field: str):
        """The state with the parameters at `path`, read onto the shapes and shardings of `which(state)`, put in
        place by `place(task, meta_opt, state, params)` (state donated)."""
        from metatrain.export import load_params

        params = load_params(path, abstract(which(self.state), which(self.program.state_shardings)), field)
        put = lambda state, params: place(self.task, self.program.meta_opt, state, params)
        return jax.jit(put, donate_argnums=0, out_shardings=self.program.state_shardings)(self.state, params)

    @contextlib.contextmanager
    def _data_wait(self, positions: dict | None = None):
        """While the run waits for batches, a stop signal stops it at once (there is no step to finish); `positions`:
        the streams' positions before this read, which a save at the stop puts back (the read may be half done)."""
        self._waiting, self._positions = True, positions
        try:
            yield
        finally:
            self._waiting = False

    def _global_batches(self):
        with self._data_wait(self.streams.get_state()):
            if self.members == 1:
                inner, outer = self.streams.next()
            else:  # each member's batches, the next ones of the streams, stacked
                inner, outer = population.stacked_batches([self.streams.next() for _ in range(self.members)])
        return (to_global(inner, self._inner_sharding, self._features),
                to_global(outer, self._member_outer_sharding, self._features))

    # ---- evaluation ----------------------------------------------------------------------------
    def _evaluated(self, which: str = "inner", member: int = 0):
        """(θ, η) of the inner model (`inner`; a population's `member`) or of the uniform baseline (`base`), on the
        device."""
        part = self.state if which == "inner" else self.state["base"]
        meta = step_lib.on_device(part["meta"])
        if part["inner"] is None:
            return meta, meta
        theta = part["inner"][0]
        if which == "inner" and self.members > 1:  # sliced in a program: the members may span hosts
            if not hasattr(self, "_member_theta"):
                shardings = population.member(self.program.state_shardings["inner"][0])
                self._member_theta = jax.jit(lambda t, i: jax.tree.map(lambda x: x[i], t), out_shardings=shardings)
            theta = self._member_theta(theta, member)
        return theta, meta

    def validation_loss(self, which: str = "inner", member: int = 0) -> float:
        """The task's outer loss (the built-in tasks: mean next-token loss) of the inner model (a population's
        `member`) on held-out test documents (cfg.eval_batches batches). For tasks that restart from η (MAML) the
        inner model is η itself."""
        theta, meta = self._evaluated(which, member)
        frozen = self.state.get("frozen")
        return float(np.mean([self._eval_loss(theta, meta, frozen, b) for b in self._test_batches()]))

    def validation_losses(self) -> list[float]:
        """Each member's validation loss (one entry without a population; MAML's members share η: one)."""
        members = self.members if self.state.get("inner") is not None else 1
        return [self.validation_loss(member=i) for i in range(members)]

    def _test_batches(self):
        if not hasattr(self, "_test_cache"):
            with self._data_wait():
                self._test_cache = [to_global(b, self._outer_sharding, self._features)
                                    for b in self.streams.test_batches(self.cfg.eval_batches)]
        return self._test_cache

    def evaluate(self) -> dict:
        """Held-out evaluation: the validation loss of the learned run (and of the baseline), then the task's own
        metrics (`Task.evaluation`; loss weighting: AUC and the weights' statistics)."""
        tic = time.perf_counter()
        losses = self.validation_losses()
        out = {"step": int(self.state["step"]), "eval_validation_loss": float(np.mean(losses))}
        if len(losses) > 1:  # a population: the members' mean above, each member and their spread here
            out.update({f"eval_validation_loss/member_{i}": v for i, v in enumerate(losses)},
                       eval_validation_loss_spread=max(losses) - min(losses))
        if "base" in self.state:
            out["eval_baseline_validation_loss"] = self.validation_loss("base")
        if self.evaluation is not None:
            out.update(self.evaluation.metrics(step_lib.on_device(self.state["meta"]), out["step"]))
        out["eval_seconds"] = time.perf_counter() - tic
        return out

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self) -> None:
        """Start an async save of the state and both data streams' positions (a step saved already is skipped)."""
        step = int(self.state["step"])
        self._check_workdir_kept()
        saved = self.checkpoints.save(step, {"state": ocp.args.StandardSave(step_lib.checkpointed(self.state)),
                                             **self.streams.save_args(),
                                             "config": ocp.args.JsonSave({"yaml": config_lib.to_yaml(self.cfg)})})
        if saved and self.log is not None:
            self.log.sync()

    def _check_workdir_kept(self, settle: float = 0.0) -> None:
        """A TrainingError where the work dir was removed while the run ran (its lock file deleted: `rm -r`): what
        it writes would go with the deleted folder, and another run could take the work dir. `settle`: seconds to
        wait for the lock file to go, after a write failed in a folder that an `rm -r` in progress removed first."""
        deadline = time.monotonic() + settle
        while self.lock is not None and not self.lock.removed() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.lock is not None and self.lock.removed():
            raise TrainingError(f"workdir: {workdir_lib.log_dir(self.cfg.workdir)} was removed while the run ran (seen "
                                f"at step {int(self.state['step'])}): stopped, as its checkpoints and metrics went "
                                f"with it; start the run again, in another workdir to keep both") from None

    def restore(self) -> int:
        """The state and data positions of the newest intact checkpoint; returns its step. The frozen LoRA base is
        not in checkpoints: the one built at start-up (from `inner.init_from`) stays."""
        target = abstract(step_lib.checkpointed(self.state), step_lib.checkpointed(self.program.state_shardings))
        step, restored = self.checkpoints.restore(target, self.streams.restore_args())
        self.state = {**self.state, **restored["state"]}  # all but the frozen base come from the checkpoint
        return step

    def _check_base(self, record: bool = True) -> None:
        """A LoRA run's adapters stay on the base weights they were trained on (recorded when training starts)."""
        if "frozen" in self.state:
            if not hasattr(self, "_base_identity"):
                self._base_identity = workdir_lib.base_identity(self.state["frozen"], self.cfg.inner.init_from)
            if self.is_main:
                workdir_lib.check_base(self.cfg.workdir, self._base_identity, record)

    def release(self) -> None:
        if getattr(self, "lock", None) is not None:
            self.lock.release()

    # ---- the loop ------------------------------------------------------------------------------
    def _on_signal(self, signum, _frame):
        """SIGTERM / SIGINT / SIGHUP: save at the end of this step and stop; while waiting for data, stop at once. A
        second one stops at once. In a job of several processes (`_agreed_stops`) only SIGINT and SIGHUP come here:
        they are sent on as SIGTERM, JAX's preemption notice, so that every process stops after the same step."""
        self._stop_signal = signal.Signals(signum)
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        if getattr(self, "_waiting", False):  # no step to finish: `train` saves the last one's state and stops
            raise _StoppedWaiting
        if self._agreed_stops:
            os.kill(os.getpid(), signal.SIGTERM)

    def _stopping(self, step: int) -> bool:
        """Whether the run stops after `step` (counted from 1): a stop signal came to this process; in a job of
        several processes, all of them have reached the step JAX's preemption service agreed on after a SIGTERM to any
        of them (one process stopping alone left the others in a collective with it: a hang, then a Gloo error)."""
        if not self._agreed_stops:
            return self._stop_signal is not None
        from jax.experimental import multihost_utils

        if not multihost_utils.reached_preemption_sync_point(step):
            return False
        self._stop_signal = self._stop_signal or signal.SIGTERM
        return True

    def _stopped_waiting(self) -> str:
        """Save the state of the last finished step where it was not saved yet, with the streams' positions before
        the interrupted read (one process only: in a multi-process job a save is a collective that the other
        processes, in a step or a read of their own, may never join); returns the stop's one-line message."""
        step = int(self.state["step"])
        if step > 0 and self.checkpoints.last_saved != step and jax.process_count() == 1:
            if self._positions is not None:
                self.streams.set_state(self._positions)
            self.save()
        saved = f"checkpoint {step} saved" if self.checkpoints.last_saved == step else self._last_checkpoint()
        return (f"stopped by {self._stop_signal.name} at step {step}; {saved} (the signal came while waiting for "
                f"data), {self.continue_hint}")

    def _last_checkpoint(self) -> str:
        step = self.checkpoints.last_saved
        if step is None:
            return f"no checkpoint was saved yet (checkpoint_every={self.cfg.checkpoint_every})"
        return f"the last checkpoint, step {step} in {self.checkpoints.dir}, is intact"

    @contextlib.contextmanager
    def _running(self, caught: list, bar):
        """Around the loop: the stop signals `caught`; on the way out, whatever ended it, the progress bar closed,
        every save in flight waited for, the logs closed and the work dir's lock released. A run that failed because
        its work dir was removed says so (`_check_workdir_kept`)."""
        try:
            with stops.caught(self._on_signal, caught):
                try:
                    yield
                except _StoppedWaiting:
                    raise StoppedBySignal(self._stopped_waiting(), self._stop_signal) from None
                finally:
                    bar.close()
                    self.checkpoints.close()  # waits for every save in flight, whatever ended the loop
                    if self.log:
                        self.log.close()
        except StoppedBySignal:
            raise
        except Exception as e:  # a write that failed: the `rm -r` that cut it may still be on its way to the lock file
            self._check_workdir_kept(settle=2.0 if isinstance(e, (OSError, WriteFailed)) else 0.0)
            raise
        finally:
            self.release()

    def train(self) -> dict:
        """Run the outer steps from the current state to `cfg.steps`, evaluating, logging and checkpointing.

        Returns:
          The run's summary: start and end validation loss, seconds, skipped updates, evaluation seconds, the
          baseline's validation loss (with one) and what the task's evaluation adds.

        Raises:
          StoppedBySignal: stopped by SIGTERM or SIGINT (after saving); a `TrainingError`.
          TrainingError: stopped by `max_bad_steps` non-finite updates in a row, a checkpoint that could not be
            written, or the work dir removed while the run ran.
        """
        cfg = self.cfg
        # SIGTERM stays with JAX's preemption notifier where the processes agree on the step to stop at
        self._agreed_stops = distributed.agrees_on_stops()  # once: `_stopping` asks after every step
        caught = [s for s in stops.signals() if not (self._agreed_stops and s == signal.SIGTERM)]
        start_step = int(self.state["step"])
        bar = progress.bar(cfg.steps, self.kind, initial=start_step, disable=not self.show_progress)
        bad_in_a_row, skipped = 0, 0
        with self._running(caught, bar):
            self._check_base()
            self.log = MetricsLog(cfg, start_step) if self.is_main else None
            summary = {"start_validation_loss": float(np.mean(self.validation_losses()))}
            eval_every = cfg.eval_every or max(1, cfg.steps // 10)
            evaluation, eval_seconds = None, 0.0
            t0 = time.perf_counter()
            for step in range(start_step, cfg.steps):
                reset = population.resets_at(step, cfg.population)
                if reset and self.is_main:
                    tqdm.write(f"step {step + 1}: population member{'s' * (len(reset) > 1)} "
                               f"{', '.join(map(str, reset))} reinitialised", file=sys.stderr)
                tic = time.perf_counter()
                batches, outer_batch = self._global_batches()
                self.state, metrics = self.compiled(self.state, batches, outer_batch)
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                metrics.update(step=step + 1, step_time=time.perf_counter() - tic)
                metrics["tokens_per_s"] = batches["tokens"].size / metrics["step_time"]
                if metrics.pop("finite") < 1:
                    bad_in_a_row, skipped = bad_in_a_row + 1, skipped + 1
                    if self.is_main:
                        tqdm.write(f"step {step + 1}: non-finite loss, meta-gradient or update, update skipped "
                                   f"({bad_in_a_row} in a row)", file=sys.stderr)
                    if bad_in_a_row >= cfg.max_bad_steps:
                        updates = "update" if bad_in_a_row == 1 else "updates"
                        again = ("resume (--resume)" if self.checkpoints.last_saved is not None else
                                 "run again without --resume (the run starts over)")
                        raise TrainingError(
                            f"{bad_in_a_row} non-finite {updates} in a row at step {step + 1}; stopping. "
                            f"{self._last_checkpoint()}: lower meta_opt.lr or inner_lr and {again}")
                else:
                    bad_in_a_row = 0
                metrics["skipped_updates"] = skipped
                if cfg.population.lifetime:
                    metrics["resets"] = len(reset)
                if self.log and ((step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps):
                    self.log.write(metrics)
                bar.set_postfix(outer=f"{metrics['outer_loss']:.3f}", inner=f"{metrics['inner_loss']:.3f}",
                                refresh=False)
                bar.update(1)
                if (step + 1) % eval_every == 0 or step + 1 == cfg.steps:
                    evaluation = self.evaluate()
                    eval_seconds += evaluation["eval_seconds"]
                    if self.log:
                        self.log.write(evaluation)
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                    self.save()
                if self._stopping(step + 1):
                    self.save()
                    raise StoppedBySignal(f"stopped by {self._stop_signal.name} at step {step + 1}; checkpoint "
                                          f"{step + 1} saved, {self.continue_hint}", self._stop_signal)
            self.save()
        if evaluation is None or evaluation["step"] != int(self.state["step"]):  # e.g. resumed at the end
            evaluation = self.evaluate()
        summary.update(end_validation_loss=evaluation["eval_validation_loss"], seconds=time.perf_counter() - t0,
                       skipped_updates=skipped, eval_seconds=eval_seconds)
        if "eval_baseline_validation_loss" in evaluation:
            summary["baseline_validation_loss"] = evaluation["eval_baseline_validation_loss"]
        if self.evaluation is not None:  # every process: scoring is a collective
            summary.update(self.evaluation.summary(step_lib.on_device(self.state["meta"]), evaluation))
        return summary
