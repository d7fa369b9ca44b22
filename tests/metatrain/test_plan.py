"""`plan.choose`: the one decision of which inner-loop program runs, enumerated over the options that change it, and
`outer_loss` running the plan it names."""

import itertools

import jax
import pytest

from metatrain import plan, two_steps, unroll
from metatrain.bench.variants import build_task
from metatrain.data.pipeline import DataConfig
from metatrain.models import preset
from metatrain.step import random_batches
from metatrain.unroll import MetaGradMethod

SEEDED_MODEL = preset("tiny").replace(remat=True)
PLAIN_MODEL = preset("tiny").replace(remat=False)


def expected(mode, save, schedule, dtype, offload, unroll_, n, model):
    """The table, written out from the rules the engine pages state."""
    if schedule == "every_step" or n <= 2:
        loop = "unrolled" if unroll_ else ("peeled" if not offload and n >= 2 else "scan")
    else:
        loop = schedule
    if n == 2 and loop == "peeled" and mode == "mixflow" and save and not dtype:
        step = "two_steps"
    elif mode == "mixflow" or dtype or offload:
        step = "stored"
    else:
        step = "checkpointed"
    return step, loop, mode == "mixflow" and model is SEEDED_MODEL


ROWS = [row for row in itertools.product(("autodiff", "mixflow", "revfwd"), (True, False),
                                         ("every_step", "sqrt", "binomial"), ("", "bfloat16"), (False, True),
                                         (False, True), (1, 2, 5), (SEEDED_MODEL, PLAIN_MODEL, None))
        if not (row[3] and not row[1])]  # a bfloat16 checkpoint needs saved inner gradients (refused)


def test_plan_table():
    """Every combination of the options that change the plan (972 rows)."""
    for row in ROWS:
        mode, save, schedule, dtype, offload, unroll_, n, model = row
        got = plan.choose(MetaGradMethod(mode, save, schedule, dtype, offload, unroll_), n, model)
        assert (got.step, got.loop, got.seeded) == expected(*row), row
        assert got.step in plan.STEPS and got.loop in plan.LOOPS
        assert got.name == "+".join([got.step, got.loop] + ["seeded"] * got.seeded)
    assert len(ROWS) == 972


def test_named_plans():
    assert plan.choose(MetaGradMethod(), 2, SEEDED_MODEL).name == "two_steps+peeled+seeded"
    assert plan.choose(MetaGradMethod(), 4, PLAIN_MODEL).name == "stored+peeled"
    assert plan.choose(MetaGradMethod("autodiff"), 4, SEEDED_MODEL).name == "checkpointed+peeled"
    assert plan.choose(MetaGradMethod(kept_states="sqrt"), 9, SEEDED_MODEL).name == "stored+sqrt+seeded"
    assert plan.choose(MetaGradMethod(offload_states=True), 2, SEEDED_MODEL).name == "stored+scan+seeded"


@pytest.mark.parametrize("method, n, step", [
    (MetaGradMethod(), 2, "two_steps"),
    (MetaGradMethod(), 3, "stored"),
    (MetaGradMethod(mode="autodiff"), 2, "checkpointed"),
    (MetaGradMethod(mode="revfwd", state_dtype="bfloat16"), 2, "stored"),
])
def test_outer_loss_runs_the_plan(method, n, step, monkeypatch):
    """`outer_loss` traces exactly the step the plan names."""
    calls = []
    for module, name in ((two_steps, "run"), (unroll, "stored_step"), (unroll, "checkpointed_step")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    model = preset("tiny")
    task = build_task("maml", model, remat=True)
    meta = task.init_meta(jax.random.key(0))
    inner = task.init_inner(jax.random.key(1), meta)
    batches, outer_batch = random_batches(DataConfig(seq_len=8, batch=2, inner_steps=n), model.vocab_size,
                                          jax.random.key(2))
    jax.eval_shape(lambda m: unroll.outer_loss(task, method)(m, inner, batches, outer_batch), meta)
    assert calls == [{"two_steps": "run", "stored": "stored_step", "checkpointed": "checkpointed_step"}[step]]
