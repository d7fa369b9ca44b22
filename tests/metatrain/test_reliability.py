"""The reliability findings of the newcomer review, one test each: every bad input gives one line naming the
field or file and exit 2, and no exit path loses or damages a checkpoint."""

import asyncio
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import TINY, checkpoints, env, metatrain, one_line_error, saved_state, train

from metatrain import checkpoints as checkpoints_lib
from metatrain import cli, config, models, step
from metatrain.workdir import Lock


def _copy(shared_run, tmp_path):
    """A copy of the shared run's work dir (checkpoints 2 and 4, config.yaml), to resume or break."""
    workdir = tmp_path / "run"
    shutil.copytree(shared_run["workdir"], workdir)
    return workdir


def _train(argv, capsys):
    code = cli.main(["train", *TINY, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- 1. a non-finite stop waits for the checkpoint it reports ------------------------------------------
@pytest.mark.slow
def test_non_finite_stop_waits_for_the_checkpoint_it_names(tmp_path):
    workdir = tmp_path / "nan"
    res = metatrain("train", *TINY, "task=custom_tasks:NaNAfterSix", f"workdir={workdir}", "steps=20",
                    "checkpoint_every=5", "max_bad_steps=3", "meta_opt.lr=1e-3", "log.wandb=false")
    assert res.returncode == 2
    one_line_error(res.stderr, "3 non-finite updates in a row at step 9",
                   f"the last checkpoint, step 5 in {workdir}/checkpoints, is intact")
    assert "Event loop is closed" not in res.stderr and "cannot schedule new futures" not in res.stderr
    assert sorted(os.listdir(workdir / "checkpoints")) == ["5"]  # finished, no N.orbax-checkpoint-tmp left
    assert int(saved_state(workdir, 5)["step"]) == 5


@pytest.mark.slow
def test_a_non_finite_stop_before_any_checkpoint_says_to_run_again_not_to_resume(tmp_path, capsys):
    """With no checkpoint saved, `--resume` is refused ("no checkpoint to resume from"): the stop's line must not
    send the user there. A meta-learning rate of 1e9 makes the second step's update non-finite."""
    workdir = tmp_path / "nan"
    code, _, err = _train(["baseline=none", "meta_opt.lr=1e9", "max_bad_steps=1", "steps=4", "checkpoint_every=100",
                           f"workdir={workdir}"], capsys)
    assert code == 2
    one_line_error(err, "1 non-finite update in a row", "no checkpoint was saved yet",
                   "run again without --resume (the run starts over)")
    assert "and resume" not in err and not checkpoints(workdir)


# ---- 2. the guard covers the updated state; meta-optimizer settings are checked ------------------------
def _tiny_maml_program():
    from metatrain import config as config_lib
    from metatrain.sharding import make_mesh

    cfg = config_lib.load(None, ["task=maml", "model.d_model=16", "model.n_heads=2", "model.d_ff=32",
                                 "model.vocab_size=64", "data.seq_len=8", "data.batch=2"])
    return cfg, step.meta_program(cfg, make_mesh(cfg.mesh))


@pytest.mark.slow
@pytest.mark.parametrize("update, finite", [(optax.sgd(1e-3), True), (optax.scale(jnp.nan), False)])
def test_a_non_finite_update_never_reaches_the_state(update, finite):
    """A meta-optimizer whose update is NaN (the loss and meta-gradient are finite): the state is kept."""
    import functools

    cfg, program = _tiny_maml_program()
    state = jax.jit(functools.partial(step.init_state, program.task, update, False))(jax.random.key(0))
    batches = step.random_batches(cfg.data, 64, jax.random.key(1))
    new, metrics = jax.jit(functools.partial(step.outer_step, program.task, program.method, update))(state, *batches)
    assert bool(metrics["finite"]) is finite and bool(jnp.isfinite(metrics["meta_grad_norm"]))
    same = [bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(new["meta"]), jax.tree.leaves(state["meta"]))]
    assert all(same) is not finite and int(new["step"]) == 1


@pytest.mark.parametrize("override, message", [
    ("meta_opt.lr=nan", "meta_opt.lr: must be a finite number > 0, got nan"),
    ("meta_opt.lr=-1", "meta_opt.lr: must be a finite number > 0, got -1"),
    ("meta_opt.clip_norm=0", "meta_opt.clip_norm: must be a finite number > 0"),
    ("meta_opt.eps=inf", "meta_opt.eps: must be a finite number > 0"),
    ("meta_opt.weight_decay=-0.1", "meta_opt.weight_decay: must be a finite number >= 0"),
    ("meta_opt.warmup_steps=-5", "meta_opt.warmup_steps: must be >= 0"),
    ("inner_lr=nan", "inner_lr: must be a finite number > 0"),
    # 4. every numeric field is range-checked before anything is built
    ("keep_checkpoints=0", "keep_checkpoints: must be >= 1, got 0"),
    ("checkpoint_every=-1", "checkpoint_every: must be >= 0"),
    ("log_every=0", "log_every: must be >= 1"),
    ("max_bad_steps=0", "max_bad_steps: must be >= 1"),
    ("eval_batches=0", "eval_batches: must be >= 1"),
    ("steps=0", "steps: must be >= 1"),
    # and the earlier ones
    # an unknown key names the one it most likely meant (OmegaConf's "Key 'dmodel' not in 'ModelConfig'" before)
    ("model.dmodel=3", "model.dmodel: no such setting; did you mean model.d_model?"),
    ("state_dtype=bfloat16", "state_dtype: no such setting; did you mean metagrad.state_dtype?"),
    ("lora.rank=4", "lora.rank: no such setting; did you mean inner.lora.rank?"),
    ("data.shuffle=8", "data.shuffle: no such setting; did you mean data.shuffle_window?"),
    ("nosuch.key=1", "nosuch.key: no such setting; `python -m metatrain.reference` lists every key "
                     "(docs/configuration.md)"),
    # a value of the wrong type, said as what the key takes (OmegaConf's "Value 'abc' of type 'str' could not be
    # converted to Integer" before; for 1e3: "Value '1000.0' of type 'float' ...")
    ("steps=abc", "steps: 'abc' is not a whole number; write it in digits, without a decimal point or exponent"),
    ("steps=1e3", "steps: 1e3 is not a whole number; write it in digits"),
    ("inner_lr=1,2", "inner_lr: '1,2' is not a number"),
    ("log.wandb=maybe", "log.wandb: 'maybe' is not true or false; write log.wandb=true or log.wandb=false"),
    ("task=nowhere.module:Task", "task: task 'nowhere.module:Task': cannot import module"),
    ("metagrad.mode=fast", "metagrad.mode: 'fast' is not one of"),
    ("data.seq_len=0", "data.seq_len must be > 0"),
    # LoRA and the separate scorer
    ("inner.lora.rank=-2", "inner.lora.rank must be >= 0"),
    ("inner.lora.targets=q,wq", "inner.lora.targets: wq is not among q,k,v,o,up,gate,down"),
    ("inner.lora.alpha=0", "inner.lora.alpha must be a finite number > 0"),
    ("meta_model.preset=huge", "meta_model.preset: unknown model preset 'huge'"),
    ("meta_model.init_from=/nonexistent", "meta_model.init_from: '/nonexistent' is not a `metatrain export`"),
    ("meta_model.d_model=30", "meta_model: RoPE needs an even per-head size, got 15"),
    ("meta_model.causal=false", "meta_model.causal=false needs meta_model.head=score"),
    ("meta_model.head=rater", "meta_model.head must be one of ('lm', 'score')"),
    ("model.causal=false", "model.causal=false needs model.head=score"),
    # numbers past what JAX, numpy or Grain take: tracebacks from deep inside them, or an abort, before
    ("seed=99999999999999999999", "seed: must be at most 2147483647 (a 32-bit integer), got 99999999999999999999"),
    ("model.n_layers=2147483648", "model.n_layers: must be at most 2147483647 (a 32-bit integer)"),
    ("data.inner_steps=99999999999999999999", "data.inner_steps: must be at most 2147483647"),
    ("seed=-99999999999999999999", "seed: must be at least -2147483648 (a 32-bit integer)"),
    ("data.seed=-1", "data.seed must be >= 0, got -1"),
    ("model.norm_eps=inf", "model.rope_base and model.norm_eps must be finite numbers > 0, got 10000.0, inf"),
    ("model.rope_base=inf", "model.rope_base and model.norm_eps must be finite numbers > 0, got inf"),
    # a switch given a count: OmegaConf read any whole number as true
    ("model.remat=5", "model.remat: 5 is not true or false; write model.remat=true or model.remat=false"),
    ("meta_opt.offload_moments=-1", "meta_opt.offload_moments: -1 is not true or false; write "
                                    "meta_opt.offload_moments=true or meta_opt.offload_moments=false"),
    # float64 without JAX's 64-bit mode (off in the test processes): JAX made every array float32, and the run
    # trained and saved float32 parameters without a word
    ("model.param_dtype=float64", "model.param_dtype=float64 needs JAX's 64-bit mode, which is off: run with "
                                  "JAX_ENABLE_X64=1"),
    ("model.compute_dtype=float64", "model.compute_dtype=float64 needs JAX's 64-bit mode"),
])
def test_bad_settings_are_one_line_errors_before_anything_runs(tmp_path, capsys, override, message):
    code, _, err = _train([f"workdir={tmp_path / 'run'}", override], capsys)
    assert code == 2
    one_line_error(err, message)
    assert not (tmp_path / "run").exists()  # refused before the run started


def test_an_evaluation_set_past_the_memory_here_is_refused_before_compiling(tmp_path, capsys, monkeypatch):
    """eval_batches=10^6 was read at the first evaluation, after the training before it, until the process was killed
    for memory. The set's bytes (int32 rows of tokens, segment ids and positions, and a flag per row: 1.5 GiB) are held
    against the memory here."""
    from metatrain import hostmem

    monkeypatch.setattr(hostmem, "available", lambda: 2**30)
    code, _, err = _train([f"workdir={tmp_path / 'run'}", "eval_batches=1000000"], capsys)
    assert code == 2
    one_line_error(err, "eval_batches: 1,000,000 batches of 8 rows of 17 tokens, kept in memory for every evaluation, "
                        "take 1.5 GiB, more than the 1.0 GiB available on this machine; lower eval_batches")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_state_past_the_memory_here_is_refused_before_it_is_allocated(tmp_path, capsys, monkeypatch):
    """model.n_layers=100000 was allocated (367 GiB on the main job's two CPU devices), then the process was killed
    for memory after 50 s. The state's bytes, from its shapes, are held against the memory here before anything is
    allocated or compiled; the error names what would shrink it."""
    from metatrain import hostmem

    monkeypatch.setattr(hostmem, "available", lambda: 2**30)
    monkeypatch.chdir(tmp_path)  # a first run in runs/a, as the README's: neither folder is left behind
    code, _, err = _train(["workdir=runs/a", "model.n_layers=100000", "baseline=uniform"], capsys)
    assert code == 2
    one_line_error(err, "the run's state (its models' parameters and optimizer states) takes ",
                   "more than the 1.0 GiB available on this machine; use a smaller model (model.n_layers, "
                   "model.d_model, model.d_ff) or no baseline (baseline=none)")
    assert os.listdir(tmp_path) == []
    # its size: ten float32 copies of the model's parameters (η, the meta-optimizer's two moments, θ and the inner
    # Adam's two moments, the baseline's θ, moments and uniform η), counted from the model config, to the 0.1 GiB said
    model = config.load(None, [*TINY, "model.n_layers=100000", "workdir=x"]).model
    gib = float(err.split(" takes ")[1].split(" GiB")[0].replace(",", ""))
    assert abs(gib - 10 * 4 * models.param_count(model) / 2**30) <= 0.05, gib


@pytest.mark.parametrize("argv, message", [
    (["train", "--heartbeat-timeout", "0"], "argument --heartbeat-timeout: must be >= 1, got 0"),
    (["train", "--num-processes", "-2"], "argument --num-processes: must be >= 1, got -2"),
    (["train", "--process-id", "-1"], "argument --process-id: must be >= 0, got -1"),
    (["data", "stats", "--max-docs", "-1"], "argument --max-docs: must be >= 0, got -1"),
    (["data", "bench", "--seconds", "-1"], "argument --seconds: must be a finite number > 0, got -1"),
    (["check-grads", "--seed", "-3"], "argument --seed: must be >= 0, got -3"),
    (["generate", "run", "--prompt", "hi", "--temperature", "-1"], "argument --temperature: must be a finite number >= "
                                                                   "0, got -1"),
    (["generate", "run", "--prompt", "hi", "--temperature", "inf"], "argument --temperature: must be a finite "
                                                                    "number >= 0, got inf"),
    (["generate", "run", "--prompt", "hi", "--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
    (["generate", "run", "--prompt", "hi", "--top-p", "nan"], "argument --top-p: must be in (0, 1], got nan"),
    # and above: seeds and sizes past a 32-bit integer were tracebacks from JAX, numpy or Grain
    (["generate", "run", "--prompt", "hi", "--seed", "99999999999999999999"],
     "argument --seed: must be at most 2147483647 (a 32-bit integer), got 99999999999999999999"),
    (["check-grads", "--inner-steps", "2147483648"], "argument --inner-steps: must be at most 2147483647"),
    (["bench", "memory", "--seq-len", "99999999999999999999"], "argument --seq-len: must be at most 2147483647"),
    (["bench", "memory", "--layers", "2,99999999999999999999"],
     "argument --layers: must be whole numbers at most 2147483647 (a 32-bit integer)"),
    (["compile", "--fsdp", "99999999999999999999"], "argument --fsdp: must be at most 2147483647"),
])
def test_a_flag_out_of_its_range_is_refused(capsys, argv, message):
    """Each was taken: a heartbeat timeout of 0 s, -1 documents, -1 s of benchmark ("0 tokens/s")."""
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (b"task: [maml\n", "preset: my.yaml is not valid YAML (line 2, column 1: expected ',' or ']'"),
    # a traceback from OmegaConf's YAML loader before (PyYAML's takes the last)
    (b"steps: 1\nmodel:\n  n_layers: 1\n  n_layers: 2\n",
     "preset: my.yaml is not valid YAML (line 4, column 3: found duplicate key n_layers)"),
    (b"- 1\n- 2\n", "preset: my.yaml holds a list, not a mapping of settings"),
    (b"\xff\xfe task: maml", "preset: my.yaml is not UTF-8 text (byte 0xff at position 0)"),
    (b"nosuch: 3\n", "nosuch in my.yaml: no such setting; `python -m metatrain.reference` lists every key "
                    "(docs/configuration.md)"),
    (b"lora:\n  rank: 2\n", "lora.rank in my.yaml: no such setting; did you mean inner.lora.rank?"),
    (b"model: 3\n", "model in my.yaml: a group of settings, not a value; set its keys, e.g. model.vocab_size=..."),
    (b"inner:\n  lora: 4\n", "inner.lora in my.yaml: a group of settings, not a value"),
    (b"steps:\n", "steps in my.yaml: no value; write one after the colon (`steps: ...`)"),
    (b"steps: 1e3\n", "steps in my.yaml: 1000.0 is not a whole number; write it in digits, without a decimal point "
                     "or exponent"),
    (b"log:\n  wandb: maybe\n", "log.wandb in my.yaml: 'maybe' is not true or false; write `wandb: true` or "
                               "`wandb: false`"),
    (None, "preset: my.yaml: no such file"),
])
def test_a_bad_preset_file_is_a_one_line_error_naming_it(tmp_path, capsys, monkeypatch, content, message):
    monkeypatch.chdir(tmp_path)
    if content is not None:
        (tmp_path / "my.yaml").write_bytes(content)
    code = cli.main(["train", "my.yaml", *TINY, "workdir=run"])
    assert code == 2
    one_line_error(capsys.readouterr().err, message)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, message", [
    ("model=1", "model: a group of settings, not a value; set its keys, e.g. model.vocab_size=..."),
    ("inner.lora=4", "inner.lora: a group of settings, not a value; set its keys, e.g. inner.lora.rank=..."),
    ("workdir=", "workdir: no value after '='; give one, e.g. workdir=..."),
    ("steps=", "steps: no value after '='; give one, e.g. steps=..."),
    # OmegaConf's "config: Key '' not in 'Config'" before
    ("=5", "override '=5': write overrides as key=value, e.g. steps=100"),
    # a preset after an override: `metatrain train inner_lr=1e-3 maml`
    ("maml", "override 'maml': write overrides as key=value, e.g. steps=100 (a preset goes first, before the "
             "overrides)"),
])
def test_a_value_for_a_whole_group_names_its_keys(tmp_path, capsys, override, message):
    code, _, err = _train([f"workdir={tmp_path / 'run'}", override], capsys)
    assert code == 2
    one_line_error(err, message)


@pytest.mark.parametrize("command,says", [
    (["compile"], "(a run config goes after --config: a preset, a YAML file or a work dir; else the model and shapes "
                  "come from the flags, see --help)"),
    (["check-grads"], "(this command takes no preset or run dir: the model and shapes come from its flags, see "
                      "--help)"),
    (["bench", "memory"], "(this command takes no preset or run dir"),
])
def test_a_bare_word_where_no_preset_is_taken_says_the_flags_give_the_model(capsys, command, says):
    """`metatrain compile runs/mine` was told that a preset goes first, which these commands do not take."""
    assert cli.main([*command, "runs/mine"]) == 2
    one_line_error(capsys.readouterr().err, "override 'runs/mine': write overrides as key=value, e.g. steps=100 "
                   + says)


# ---- 3. one run per work dir --------------------------------------------------------------------------
def test_a_second_run_in_a_busy_workdir_is_refused_and_a_dead_one_leaves_no_lock(tmp_path, capsys):
    workdir = tmp_path / "run"
    with Lock(str(workdir)):
        code, _, err = _train([f"workdir={workdir}"], capsys)
    assert code == 2
    one_line_error(err, f"workdir: {workdir} is in use by another run (pid {os.getpid()} on ")
    hold = (f"from metatrain.workdir import Lock; held = Lock({str(workdir)!r}).acquire(); print('locked', "
            "flush=True); import time; time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", hold],
                              env=env(), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(Exception, match=f"pid {holder.pid} on"):
        Lock(str(workdir)).acquire()
    holder.kill()
    holder.wait()
    Lock(str(workdir)).acquire().release()  # the killed process's lock went with it


@pytest.mark.slow
@pytest.mark.parametrize("race", [False, True], ids=["removed-before-a-save", "removed-during-a-save"])
def test_a_workdir_removed_while_the_run_runs_stops_it_in_one_line(tmp_path, capsys, monkeypatch, race):
    """`rm -r WORKDIR` during a run: it trained on to its last step writing into the deleted folder, then failed
    with "has no metrics.jsonl: is it a metatrain work dir?" (or, its save in flight cut, "make room there"). The
    next save sees the lock file gone and stops; a save that an `rm -r` in progress cut (ENOENT) is said the same."""
    from metatrain import trainer

    workdir, save = tmp_path / "run", trainer.Trainer.save

    def removed_at_step_4(self):
        if int(self.state["step"]) != 4:
            return save(self)
        if not race:
            shutil.rmtree(workdir)
            return save(self)
        # the save fails as the rm removes its folder; the rm reaches the lock file a moment later
        threading.Timer(0.5, shutil.rmtree, [workdir]).start()
        raise checkpoints_lib.WriteFailed(f"checkpoint 4 could not be written in {workdir}/checkpoints "
                                          f"(FileNotFoundError: [Errno 2] No such file or directory: "
                                          f"'{workdir}/checkpoints/4.orbax-checkpoint-tmp')")

    monkeypatch.setattr(trainer.Trainer, "save", removed_at_step_4)
    code, _, err = _train([f"workdir={workdir}", "steps=8", "checkpoint_every=2"], capsys)
    assert code == 2
    one_line_error(err, f"workdir: {workdir} was removed while the run ran (seen at step 4): stopped, as its "
                        "checkpoints and metrics went with it; start the run again")
    assert not (workdir / "checkpoints" / "4").exists() and not (workdir / "checkpoints" / "6").exists()


# ---- 5. a damaged latest checkpoint -----------------------------------------------------------------
def _data_files(workdir, step):
    root = workdir / "checkpoints" / str(step) / "state"
    return sorted((p for p in root.rglob("*") if p.is_file() and "/d/" in str(p)), key=lambda p: p.stat().st_size)


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_set_aside_and_the_newest_intact_one_used(tmp_path):
    """As a user sees it, in a subprocess: one line naming the damaged checkpoint, no traceback. The model is the
    default preset's size: with more arrays per checkpoint, TensorStore's other reads of the damaged one were still
    in flight when the first failed, and their errors came out as tracebacks (about 16 of them)."""
    workdir = tmp_path / "run"
    model = ("model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.d_ff=256", "data.seq_len=32")
    train(workdir, *model, "steps=4", "checkpoint_every=2")
    biggest = _data_files(workdir, 4)[-1]
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])  # truncated
    res = metatrain("train", *TINY, *model, f"workdir={workdir}", "steps=5")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "exception was never retrieved" not in res.stderr, res.stderr[-3000:]
    damaged = [line for line in res.stderr.splitlines() if "is damaged" in line]
    assert len(damaged) == 1 and damaged[0].startswith("checkpoint 4 in ") and "moved to damaged-4" in damaged[0]
    assert "resuming from checkpoint 2, the newest intact one" in res.stderr
    assert "resuming the run in" in res.stdout and "from step 2" in res.stdout
    # a fresh checkpoint 4 could be saved: the damaged one is out of the way
    assert checkpoints(workdir) == [2, 4, 5] and (workdir / "checkpoints" / "damaged-4").is_dir()


def test_late_errors_of_a_damaged_checkpoints_reads_are_dropped(tmp_path, monkeypatch, caplog):
    """TensorStore's other reads of a damaged checkpoint fail after the first, some once training has resumed, each
    an asyncio "exception was never retrieved" record or an unraisable exception: dropped when they name a file of
    the damaged checkpoint (whatever their first words), kept for any other checkpoint (40 is not 4)."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(u.exc_value))  # what it wraps
    monkeypatch.setattr(checkpoints_lib, "_DAMAGED", set())
    asyncio_log = logging.getLogger("asyncio")
    monkeypatch.setattr(asyncio_log, "filters", list(asyncio_log.filters))
    root = tmp_path / "checkpoints"
    checkpoints_lib.silence_failed_reads(str(root / "4"))
    late = 'OUT_OF_RANGE: Error reading "w_out/0.0.0" in OCDBT database at local file "{}/state/": byte range'
    mine, other = ValueError(late.format(root / "4")), ValueError(late.format(root / "40"))

    def never_retrieved(error):
        loop = asyncio.new_event_loop()
        future = loop.create_future()
        future.set_exception(error)
        del future
        gc.collect()
        loop.close()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        never_retrieved(mine)
        never_retrieved(other)
    assert [r.exc_info[1] for r in caplog.records if r.exc_info] == [other]
    for error in (mine, other):
        sys.unraisablehook(type("Unraisable", (), dict(exc_type=ValueError, exc_value=error, exc_traceback=None,
                                                         err_msg="Exception ignored in", object=None))())
    assert unraisable == [other]


def test_a_late_read_reporting_to_a_closed_loop_before_the_failure_is_dropped(shared_run, tmp_path, monkeypatch):
    """TensorStore's other reads of a damaged checkpoint can finish after Orbax closed their event loop but before the
    failed restore's exception reaches us (under load): their "Event loop is closed" goes to `sys.unraisablehook` then,
    and must be dropped too. Simulated with a TensorStore future awaited on a loop that is closed, then completed from
    another thread, inside the read that fails."""
    import threading

    import tensorstore as ts

    from metatrain import run as run_lib

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(u.exc_value))  # what it wraps
    monkeypatch.setattr(checkpoints_lib, "_DAMAGED", set())
    workdir = _copy(shared_run, tmp_path)
    saved_tree = run_lib.saved_tree

    def damaged_read(state_dir):
        if not state_dir.endswith(os.path.join("4", "state")):
            return saved_tree(state_dir)
        promise, future = ts.Promise.new()

        async def read():
            asyncio.ensure_future(future)  # a TensorStore read, awaited on this loop
            await asyncio.sleep(0)

        loop = asyncio.new_event_loop()
        loop.run_until_complete(read())
        loop.close()  # the restore failed: its loop is gone, the read still runs
        done = threading.Thread(target=lambda: promise.set_result(0))
        done.start()
        done.join()
        raise ValueError("Encountered error while reading array index")

    monkeypatch.setattr(run_lib, "saved_tree", damaged_read)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Task was destroyed but it is pending!" of the simulated read
        assert run_lib.Checkpoint.latest(str(workdir), say=lambda line: None).step == 2
    assert unraisable == []


@pytest.mark.slow
def test_no_intact_checkpoint_is_one_line(shared_run, tmp_path, capsys):
    workdir = _copy(shared_run, tmp_path)
    (workdir / "checkpoints" / "4" / "state" / "_METADATA").unlink()  # metadata gone
    zeroed = _data_files(workdir, 2)[-1]
    zeroed.write_bytes(bytes(zeroed.stat().st_size))  # data zeroed
    code, _, err = _train([f"workdir={workdir}", "steps=5", "log.wandb=false"], capsys)
    assert code == 2
    one_line_error(err, "no intact checkpoint in ", "4: ", "2: ", "start a new run in another workdir")


def test_reading_a_run_skips_a_damaged_latest_checkpoint_and_says_so(shared_run, tmp_path, capsys):
    """`export` (as `eval`, `scores`, `filter`, `generate`: they open runs alike) reads the newest checkpoint whose
    metadata reads, naming the damaged one, and changes nothing in the run; none intact is one line."""
    workdir = _copy(shared_run, tmp_path)
    (workdir / "checkpoints" / "4" / "state" / "_METADATA").unlink()
    assert cli.main(["export", str(workdir), "--out", str(tmp_path / "e")]) == 0
    err = capsys.readouterr().err
    assert f"{workdir}: reading checkpoint 2, the newest intact one (damaged: 4: no metadata in " in err, err[-2000:]
    assert "Traceback" not in err and "Failed to get item metadata" not in err
    assert json.loads((tmp_path / "e" / "export.json").read_text())["step"] == 2
    assert checkpoints(workdir) == [2, 4]
    (workdir / "checkpoints" / "2" / "state" / "_METADATA").unlink()
    assert cli.main(["export", str(workdir), "--out", str(tmp_path / "e2")]) == 2
    one_line_error(capsys.readouterr().err, f"{workdir}: no intact checkpoint (4: no metadata in ", "; 2: no metadata")
    assert not (tmp_path / "e2").exists()


# ---- 6. resuming with another configuration, or nothing left to do ---------------------------------------
@pytest.mark.parametrize("argv, says", [
    ([*TINY, "model.d_model=32"], "first difference: model.d_model: 16 -> 32"),
    ([*TINY, "task=maml"], "first difference: task: 'loss_weighting' -> 'maml'"),
    (["learned_lr"], "first difference: task: 'loss_weighting' -> 'learned_lr'"),  # another preset named
    ([*TINY, "steps=4"], "steps: the run in "),
    ([*TINY, "inner.lora.rank=4"], "first difference: inner.lora.rank: 0 -> 4"),
    ([*TINY, "meta_model.n_layers=1"], "first difference: meta_model.n_layers: 0 -> 1"),
    ([*TINY, "steps=3"], "is already at step 4 (steps=3); set steps above 4"),
])
def test_resuming_with_another_configuration_or_too_few_steps(shared_run, tmp_path, capsys, argv, says):
    workdir = _copy(shared_run, tmp_path)
    saved = (workdir / "config.yaml").read_text()
    assert cli.main(["train", *argv, f"workdir={workdir}"]) == 2
    one_line_error(capsys.readouterr().err, says)
    assert (workdir / "config.yaml").read_text() == saved  # untouched


# ---- 6b, 7. SIGTERM, SIGINT and SIGHUP save and stop cleanly, also right after a periodic save -----------
@pytest.mark.slow
@pytest.mark.parametrize("sig, readers_gone", [(signal.SIGTERM, False), (signal.SIGHUP, False),
                                               (signal.SIGINT, True)])
def test_a_signal_saves_and_stops_with_one_line(tmp_path, sig, readers_gone):
    """`readers_gone`: the pipes of its stdout and stderr have no reader any more when the signal comes (Ctrl-C to
    `metatrain train ... 2>&1 | tee log` stops tee too; an ssh connection drops): the first write after it, the
    progress bar's in the clean-up, raised BrokenPipeError, and the checkpoint being saved was left a tmp dir.
    SIGHUP (a terminal closed) killed the run without a save."""
    workdir = tmp_path / "run"
    proc = metatrain("train", *TINY, f"workdir={workdir}", "steps=100000", "checkpoint_every=1", background=True)
    metrics, deadline = workdir / "metrics.jsonl", time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "no steps within 300 s"
        time.sleep(0.1)
    if readers_gone:
        proc.stdout.close(), proc.stderr.close()
    proc.send_signal(sig)
    if readers_gone:
        proc.wait(timeout=120)
    else:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, "" if readers_gone else err[-3000:]  # it was 2, a bad input's
    step = checkpoints(workdir)[-1]
    assert not [n for n in os.listdir(workdir / "checkpoints") if "tmp" in n]
    if not readers_gone:
        one_line_error(err, f"metatrain train: stopped by {sig.name} at step {step}; checkpoint {step} saved")
        assert "already exists" not in err and "KeyboardInterrupt" not in err
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] <= step  # no step after the last save


SLOW_DATA = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1)  # the test asks for every thread's stack where the run does not stop
from metatrain import cli
from metatrain.data import pipeline

next_, calls = pipeline.Streams.next, []


def stuck(self):  # from step 3 on the outer batch never comes (a source that packs nothing, a dead mount)
    calls.append(1)
    if len(calls) > 2:
        [next(it) for it in self.inner]  # the inner streams' batches are read: the read is half done
        print("waiting for data", file=sys.stderr, flush=True)
        time.sleep(600)
    return next_(self)


pipeline.Streams.next = stuck
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_signal_stops_a_run_waiting_for_data_at_once_and_saves_the_last_step(tmp_path, shared_run):
    """A run stuck waiting for data finished no step, so one SIGTERM stops it at once (it used to wait for the step),
    saving the last finished step where no checkpoint holds it yet (it used to keep only the previous checkpoint,
    losing the steps since), with the data positions of that step (not those of the half-done read): those an
    uninterrupted run saves there."""
    workdir, err_path = tmp_path / "run", tmp_path / "err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", SLOW_DATA, "train", *TINY, f"workdir={workdir}", "steps=10",
                                 "checkpoint_every=3"], env=env(), stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            deadline = time.time() + 300
            while "waiting for data" not in err_path.read_text():
                assert proc.poll() is None and time.time() < deadline, err_path.read_text()[-3000:]
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGUSR1)
                time.sleep(2)
                stacks = err_path.read_text()[-6000:]
                raise AssertionError(f"no exit 60 s after SIGTERM; its threads:\n{stacks}") from None
        finally:
            proc.kill()
    text = err_path.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    one_line_error(text, "metatrain train: stopped by SIGTERM at step 2; checkpoint 2 saved (the signal came while "
                   "waiting for data)")
    assert checkpoints(workdir) == [2]
    # the shared run reads the same streams (TINY's data) and saved step 2 at its end
    for stream in ("inner_data", "outer_data"):
        saved, reference = (json.loads((Path(d) / "checkpoints" / "2" / stream / "process_0-of-1.json").read_text())
                            for d in (workdir, shared_run["workdir"]))
        assert saved == reference, stream


# ---- 9. messages that name the thing to fix ---------------------------------------------------------
def test_export_of_a_missing_or_foreign_dir(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path / "missing")]) == 2
    one_line_error(capsys.readouterr().err, f"{tmp_path / 'missing'}: no such directory")
    (tmp_path / "empty").mkdir()
    assert cli.main(["export", str(tmp_path / "empty")]) == 2
    one_line_error(capsys.readouterr().err, f"{tmp_path / 'empty'} is not a metatrain run: it has no checkpoint")


def test_a_folder_as_data_source_points_to_data_build(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    code, _, err = _train([f"workdir={tmp_path / 'run'}", f"data.source={tmp_path / 'docs'}"], capsys)
    assert code == 2
    one_line_error(err, "data source", "is a path, not a dataset", f"write dir:{tmp_path / 'docs'}",
                   f"metatrain data build {tmp_path / 'docs'}")


def test_a_task_module_that_fails_to_import_is_named(tmp_path, capsys, monkeypatch):
    (tmp_path / "broken_tasks.py").write_text("import math\n\nRATE = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = _train([f"workdir={tmp_path / 'run'}", "task=broken_tasks:Mine"], capsys)
    assert code == 2
    one_line_error(err, "importing module 'broken_tasks' raised ZeroDivisionError at ",
                   f"{tmp_path / 'broken_tasks.py'}:3")


def test_a_workdir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    code, _, err = _train([f"workdir={tmp_path / 'afile'}"], capsys)
    assert code == 2
    one_line_error(err, f"workdir: '{tmp_path / 'afile'}' is a file")


def test_a_workdir_below_a_file_or_that_cannot_be_made_is_one_line(tmp_path, capsys, monkeypatch):
    """Both ended in a traceback (NotADirectoryError, FileNotFoundError) from making the folder. (Checked where the
    work dir is made, not in the config: the commands that read a run never write its work dir.)"""
    (tmp_path / "afile").write_text("x")
    code, _, err = _train([f"workdir={tmp_path / 'afile' / 'run'}"], capsys)
    assert code == 2
    one_line_error(err, f"workdir: {tmp_path / 'afile' / 'run'} cannot be made (Not a directory: ",
                   "give a folder you can write")

    def refused(path, exist_ok=False):  # a file system that refuses the folder (read-only, /proc, ...)
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(os, "makedirs", refused)
    code, _, err = _train([f"workdir={tmp_path / 'run'}"], capsys)
    assert code == 2
    one_line_error(err, f"workdir: {tmp_path / 'run'} cannot be made (No such file or directory: ")


@pytest.mark.slow
def test_a_checkpoint_that_cannot_be_written_is_one_line_and_the_run_resumes(shared_run, tmp_path):
    """A full disk while a checkpoint was written gave about a thousand lines of Orbax, asyncio and TensorStore
    tracebacks. Here a file size limit stands in for it (its writes fail alike, without root or a small file system):
    one line naming the newest intact checkpoint, the half-written one removed, and the run resumes from it."""
    workdir = _copy(shared_run, tmp_path)
    run = ["train", *TINY, f"workdir={workdir}", "log.wandb=false", "steps=6"]
    limited = metatrain(*run, "checkpoint_every=1", "--resume", file_limit_kib=16)  # files of at most 16 KiB
    assert limited.returncode == 2, limited.stderr[-3000:]
    one_line_error(limited.stderr, "checkpoint 5 could not be written in", "(File too large)",
                   "checkpoint 4 is the newest intact one", "run again with --resume")
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    res = metatrain(*run, "--resume")
    assert res.returncode == 0 and checkpoints(workdir)[-1] == 6, res.stderr[-3000:]


@pytest.mark.slow
def test_metrics_the_disk_refuses_are_one_line_naming_the_folder(tmp_path):
    """A full disk while metrics were logged gave tensorboardX's tracebacks (from its thread, its close and its exit
    hook) and "writing a file failed". A file size limit stands in for the full disk (writes fail alike, without
    root); the TensorBoard events file (about 60 bytes a row's scalar) passes it first."""
    workdir = tmp_path / "run"
    res = metatrain("train", *TINY, f"workdir={workdir}", "steps=200", "checkpoint_every=100000", file_limit_kib=6)
    assert res.returncode == 2, res.stderr[-3000:]
    one_line_error(res.stderr, f"metatrain train: error: writing {workdir}/tensorboard failed (File too large)")
    assert "Exception ignored" not in res.stderr and "Exception in thread" not in res.stderr, res.stderr[-3000:]


def test_a_metrics_row_the_disk_refuses_names_metrics_jsonl(tmp_path):
    """Python's error for a write to an open file names none ("writing a file failed"); /dev/full refuses every
    write as a full disk does."""
    import errno

    from metatrain import config as config_lib
    from metatrain.tracking import MetricsLog

    log = MetricsLog(config_lib.load(None, [*TINY, f"workdir={tmp_path / 'run'}"]))
    log.jsonl.close()
    log.jsonl = open("/dev/full", "a")
    with pytest.raises(OSError) as e:
        log.write({"step": 1, "outer_loss": 1.0})
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, "/dev/full")
    log.jsonl = open(os.devnull, "a")
    log.close()
