"""The task interface: a user's own task by import path, and clear errors for broken contracts."""

import json

import jax
import jax.numpy as jnp
import pytest
from helpers import TINY, metatrain, one_line_error

from metatrain import checkgrads, models, step
from metatrain.bench.variants import parse_variant
from metatrain.data.pipeline import DataConfig
from metatrain.tasks import MAML, Task, TaskError, batch_mean, make_task, task_class, validate


class LearnedWeightDecay(Task):
    """A custom task: η is a log weight-decay coefficient added to the inner loss."""

    name = "learned_weight_decay"

    def init_meta(self, key):
        return {"log_decay": jnp.full((), -2.0, self.model.dtype)}

    def inner_loss(self, theta, meta, batch):
        l2 = sum(jnp.sum(p**2) for p in jax.tree.leaves(theta))
        return batch_mean(self.example_losses(theta, batch), batch) + jnp.exp(meta["log_decay"]) * l2


class NonScalarLoss(MAML):
    def inner_loss(self, theta, meta, batch):
        return self.example_losses(theta, batch)  # [batch]: forgot the .mean()


class IntegerMeta(Task):
    def init_meta(self, key):
        return {"steps": jnp.arange(3)}


class ShapeChangingUpdate(MAML):
    def update(self, grads, theta, opt_state, meta):
        return jax.tree.map(lambda p: p[..., :1], theta), opt_state


class NotATask:
    pass


class NoisyStart(Task):
    """Overrides inner_start but carries its inner state (it perturbs the carried θ): not a resetting task."""

    def init_meta(self, key):
        return {"scale": jnp.zeros((), self.model.dtype)}

    def inner_start(self, meta, inner):
        theta, opt = inner
        return jax.tree.map(lambda p: p * (1 + meta["scale"]), theta), opt


class VagueReset(MAML):
    resets_inner = "yes"


CFG = models.preset("tiny")
SHAPES = DataConfig(inner_steps=2, batch=2, seq_len=8)


def _setup(task):
    meta = task.init_meta(jax.random.key(0))
    inner = task.init_inner(jax.random.key(1), meta)
    return meta, inner, step.random_batches(SHAPES, CFG.vocab_size, jax.random.key(2))[1]


@pytest.mark.slow
def test_custom_task_by_import_path_passes_check_grads():
    task = make_task(f"{__name__}:LearnedWeightDecay", model=CFG)
    assert isinstance(task, LearnedWeightDecay) and not task.resets_inner
    results = checkgrads.check_grads(f"{__name__}:LearnedWeightDecay", CFG, SHAPES,
                                     only=[parse_variant("mixflow+remat+save")])
    assert len(results) == 2
    for r in results:
        assert r.ok, r
        assert r.rel_err <= 1e-10 and r.fd_err <= 1e-6


def test_builtin_names_and_reset_flags():
    assert task_class("maml") is MAML
    assert make_task("maml", model=CFG).resets_inner
    assert not make_task("learned_lr", model=CFG).resets_inner
    assert not make_task("loss_weighting", model=CFG).resets_inner


def test_a_task_that_overrides_inner_start_keeps_its_carried_state():
    """resets_inner is a declared class attribute, not read off which methods a task overrides."""
    import optax

    task = make_task(f"{__name__}:NoisyStart", model=CFG)
    assert not task.resets_inner
    state = jax.eval_shape(lambda k: step.init_state(task, optax.sgd(1.0), False, k), jax.random.key(0))
    assert state["inner"] is not None
    validate(task, *_setup(task))
    with pytest.raises(TaskError, match="resets_inner must be a class attribute True or False"):
        validate(make_task(f"{__name__}:VagueReset", model=CFG), *_setup(make_task("maml", model=CFG)))


@pytest.mark.parametrize("cls, message", [
    ("NonScalarLoss", "inner_loss must return a floating-point scalar"),
    ("IntegerMeta", "meta-parameters must be floating point"),
    ("ShapeChangingUpdate", "update changed theta"),
])
def test_broken_contract_names_task_and_problem(cls, message):
    task = make_task(f"{__name__}:{cls}", model=CFG)
    with pytest.raises(TaskError, match=message) as err:
        validate(task, *_setup(task))
    assert cls in str(err.value)


@pytest.mark.parametrize("name, message", [
    ("mamll", "unknown task 'mamll'"),
    ("no_such_module_xyz:Task", "cannot import module 'no_such_module_xyz'"),
    (f"{__name__}:Missing", "has no attribute 'Missing'"),
    (f"{__name__}:NotATask", "not a subclass"),
])
def test_bad_task_names(name, message):
    with pytest.raises(TaskError, match=message):
        task_class(name)


@pytest.mark.slow
def test_a_task_that_brings_its_own_model_trains_checks_and_compiles(tmp_path):
    """`custom_tasks:OwnModel` has no transformer and an `__init__` of its own that takes no model config: the
    engine reads none of the attributes `Task.__init__` sets. Each command as a user runs it, in a subprocess."""
    task = "task=custom_tasks:OwnModel"
    res = metatrain("train", *TINY, task, "steps=2", "baseline=uniform", f"workdir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-3000:]
    start, end = (float(x) for x in res.stdout.split("\nvalidation loss: ")[-1].split()[:3:2])
    assert 0.3 < start < 1.5 and 0.3 < end < 1.5  # binary cross-entropy of the task's own model, not a token loss
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    decay = [r["eval_decay"] for r in rows if "eval_decay" in r]  # the task's own evaluation hook, logged
    assert decay and 0.1 < decay[-1] < 0.2, rows  # exp(-2) = 0.135, moved a little by two meta-steps
    res = metatrain("check-grads", "--task", "custom_tasks:OwnModel", "--variants", "mixflow+remat+save,revfwd")
    assert res.returncode == 0 and "all 3 variants within tolerance" in res.stdout, res.stdout + res.stderr[-3000:]
    res = metatrain("compile", "--task", "custom_tasks:OwnModel", "--model", "tiny", "--batch", "2", "--seq-len", "16")
    assert res.returncode == 0 and "per-device memory" in res.stdout, res.stderr[-3000:]
    assert "on CPU there is no device memory to fit in" in res.stdout, res.stdout  # no fits line there
    res = metatrain("eval", tmp_path / "run")
    assert res.returncode == 2, res.stderr[-3000:]
    one_line_error(res.stderr, "brings its own model, not a language model")


@pytest.mark.parametrize("batch", [4, 3])
def test_the_loss_weighting_baseline_skips_the_meta_model_and_weighs_uniformly(batch):
    task = make_task("loss_weighting", model=CFG)
    meta = task.init_meta(jax.random.key(0))
    theta = task.init_inner(jax.random.key(1), meta)[0]
    b = step.random_batches(DataConfig(inner_steps=1, batch=batch, seq_len=8), CFG.vocab_size, jax.random.key(2))[0]
    b = jax.tree.map(lambda x: x[0], b)
    frozen_meta = task.baseline_meta(meta)
    uniform = task.baseline_task()
    assert not task.uniform and uniform.uniform
    assert jnp.array_equal(uniform.weights(frozen_meta, b), jnp.ones(batch))
    # η's meta model is not part of the baseline's computation: its gradient is exactly zero
    d_meta = jax.grad(lambda m: uniform.inner_loss(theta, m, b))(frozen_meta)
    assert all(not jnp.any(g) for g in jax.tree.leaves(d_meta))
    # the frozen η's weights are B · softmax(0) = 1 up to rounding (exactly 1 for a power of two)
    value, grads = jax.value_and_grad(task.inner_loss)(theta, frozen_meta, b)
    value_u, grads_u = jax.value_and_grad(uniform.inner_loss)(theta, frozen_meta, b)
    tol = 0 if batch == 4 else 4e-7  # B · fl(1/B) is within 2 float32 ulps of 1 for B=3
    assert abs(float(value - value_u)) <= tol * abs(float(value))
    for g, gu in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_u), strict=True):
        assert jnp.allclose(g, gu, rtol=tol, atol=tol * float(jnp.abs(g).max()) + 1e-30)


def test_the_documented_task_leaves_out_a_row_without_a_token_to_train_on():
    """The task module of the README and of docs/writing-a-task.md, run as written, on a packed row of conversations
    that holds no assistant token (loss 0): its loss is the mean over the other rows, as the built-in tasks'. A plain
    `.mean()` counted the empty row and halved the loss here, on any chat data a user copied the example onto."""
    import re
    from pathlib import Path

    import numpy as np

    root = Path(__file__).resolve().parents[2]
    b = step.random_batches(DataConfig(inner_steps=1, batch=2, seq_len=8), CFG.vocab_size, jax.random.key(2))[0]
    b = jax.tree.map(lambda x: x[0], b)
    b = dict(b, loss_mask=jnp.asarray(np.array([[0] * 9, [0] * 5 + [1] * 4], np.int32)))  # row 0: prompt only
    for page in ("README.md", "docs/writing-a-task.md"):
        code = next(c for c in re.findall(r"```python\n(.*?)```", (root / page).read_text(), re.S)
                    if "class LearnedWeightDecay(Task)" in c)
        space = {}
        exec(compile(code, page, "exec"), space)
        task = space["LearnedWeightDecay"](model=CFG)
        meta = task.init_meta(jax.random.key(0))
        theta = task.init_inner(jax.random.key(1), meta)[0]
        losses = np.asarray(task.example_losses(theta, b), np.float64)
        assert losses[0] == 0 < losses[1]
        l2 = sum(float(np.sum(np.asarray(p, np.float64) ** 2)) for p in jax.tree.leaves(theta))
        expected = losses[1] + np.exp(-2.0) * l2  # the row with a target alone; float64 from float32 parts
        assert np.isclose(float(task.inner_loss(theta, meta, b)), expected, rtol=1e-5), page


def test_an_example_without_a_token_to_train_on_takes_no_weight():
    """A packed row of conversations holding no assistant token has loss 0. The likelihood readout (a mean over no
    token: 0) rated it above every other row, and the softmax gave such rows nearly all the weight: a chat run's
    weighted inner loss was 0.03 beside the uniform baseline's 2.7, and its inner model barely trained."""
    import numpy as np

    task = make_task("loss_weighting", model=CFG)
    meta = dict(task.init_meta(jax.random.key(0)), log_temperature=jnp.asarray(2.0))  # a sharp softmax
    theta = task.init_inner(jax.random.key(1), meta)[0]
    b = step.random_batches(DataConfig(inner_steps=1, batch=4, seq_len=8), CFG.vocab_size, jax.random.key(2))[0]
    b = jax.tree.map(lambda x: x[0], b)
    trained = np.array([False, True, False, True])
    mask = np.zeros((4, 9), np.int32)
    mask[trained, 5:] = 1  # rows 1 and 3: their last four targets (an assistant turn); rows 0 and 2: none
    b = dict(b, loss_mask=jnp.asarray(mask))
    scores = np.asarray(task.scores(meta, b), np.float64)
    assert scores[0] == scores[2] == 0 and (scores[trained] < 0).all()  # the empty rows rate highest
    # float64 reference: n · softmax over the rows with a target (n = 2), 0 for the others
    e = np.exp(scores[trained] - scores[trained].max())
    expected = np.zeros(4)
    expected[trained] = 2 * e / e.sum()
    weights = np.asarray(task.weights(meta, b))
    assert (weights[~trained] == 0).all() and np.allclose(weights, expected, rtol=1e-6, atol=0), (weights, expected)
    losses = np.asarray(task.example_losses(theta, b))
    assert (losses[~trained] == 0).all() and (losses[trained] > 0).all()
    # the losses are means over the two rows with a target: rows of loss 0 would pull them down
    assert np.isclose(float(task.inner_loss(theta, meta, b)), np.sum(expected * losses) / 2, rtol=1e-6)
    maml = make_task("maml", model=CFG)
    for loss in (maml.inner_loss, maml.outer_loss):
        assert np.isclose(float(loss(theta, None, b)), losses[trained].mean(), rtol=1e-6)
    # a batch without any: every weight 0, the loss 0, finite (zero) meta-gradients
    empty = dict(b, loss_mask=jnp.zeros_like(b["loss_mask"]))
    assert jnp.array_equal(task.weights(meta, empty), jnp.zeros(4)) and float(task.inner_loss(theta, meta, empty)) == 0
    grads = jax.grad(lambda m: task.inner_loss(theta, m, empty))(meta)
    assert all(bool(jnp.all(g == 0)) for g in jax.tree.leaves(grads))
    # forward over reverse (MixFlow's products through the weights): finite with and without such rows
    for batch in (b, empty):
        tangent = jax.tree.map(jnp.ones_like, meta)
        _, hvp = jax.jvp(jax.grad(lambda m, x=batch: task.inner_loss(theta, m, x)), (meta,), (tangent,))
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(hvp))
