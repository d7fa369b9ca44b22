"""A population of inner models: its meta-gradient is its members' mean, `reduce=update` averages per-member
meta-Adam updates, and resets give fresh members on a staggered schedule.

Everything runs in float64 (`jax.enable_x64`). The population's members run inside one `lax.scan`; the
references run each member alone through `meta_value_and_grad`, a program compiled separately, so the two
differ by the order of float64 operations only: for these tiny models (outer losses ~5, meta-gradients
~1e-2..1) that is ~1e-15 relative, and 1e-12 leaves three orders of magnitude for any x86 machine's
reassociation, while a member dropped or counted twice changes the mean by ~30%.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from metatrain import population
from metatrain.bench.variants import build_task
from metatrain.config import MetaOptConfig, PopulationConfig
from metatrain.data.pipeline import DataConfig
from metatrain.models import ModelConfig
from metatrain.step import all_finite, keep_if, meta_optimizer, random_batches
from metatrain.unroll import MetaGradMethod, meta_value_and_grad

MODEL = ModelConfig(d_model=8, n_heads=2, d_ff=16, n_layers=1, vocab_size=32, param_dtype="float64")
DATA = DataConfig(seq_len=4, batch=2, inner_steps=2)
N = 3


def members_setup(task_name, key=0):
    task = build_task(task_name, MODEL, remat=False)
    k_meta, k_inner, k_data, k_noise = jax.random.split(jax.random.key(key), 4)
    flat, unravel = ravel_pytree(task.init_meta(k_meta))
    meta = unravel(flat + 0.05 * jax.random.normal(k_noise, flat.shape, flat.dtype))  # every path exercised
    inner = None if task.resets_inner else population.init_inner(task, k_inner, meta, N)
    batches, outer = random_batches(DATA, MODEL.vocab_size, k_data, members=N)
    return task, meta, inner, batches, outer


def rel(a, b) -> float:
    a, b = ravel_pytree(a)[0], ravel_pytree(b)[0]
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.slow
@pytest.mark.parametrize("task_name,mode", [("loss_weighting", "mixflow"), ("maml", "revfwd")])
def test_the_meta_gradient_is_the_mean_of_the_members_meta_gradients(task_name, mode):
    """N=3, reduce=grad: the population's meta-gradient against the mean of three one-member meta-gradients, each
    member on its own batches (a task that carries inner state and one that restarts from η; the members' loop
    does not depend on the mode: `metatrain check-grads population.size=3` runs every mode of every task)."""
    with jax.enable_x64(True):
        task, meta, inner, batches, outer = members_setup(task_name)
        method = MetaGradMethod(mode)
        got = jax.jit(lambda m, i, b, o: population.run_members(task, method, PopulationConfig(size=N), 0, 0, m, i,
                                                                b, o))(meta, inner, batches, outer)
        alone = jax.jit(lambda m, i, b, o: meta_value_and_grad(task, method)(m, i, b, o))
        grads, values = [], []
        for k in range(N):
            (value, _), grad = alone(meta, population.member(inner, k), population.member(batches, k),
                                     population.member(outer, k))
            grads.append(grad)
            values.append(value)
        mean = jax.tree.map(lambda *g: sum(g) / N, *grads)
        assert rel(got.grad, mean) < 1e-12
        np.testing.assert_allclose(got.values, values, rtol=1e-12)
        assert rel(grads[0], mean) > 1e-3  # the members differ: one member's meta-gradient would fail


@pytest.mark.slow
def test_reduce_update_averages_three_meta_adam_updates_and_resets_start_fresh():
    """reduce=update with N=3, lifetime=3: two outer steps of the population's step against three meta-Adam states
    updated by hand from one-member meta-gradients, their updates averaged, the inner states carried; at step 1
    member 1 is reset, and its inner loop runs from a fresh init (`task.init_inner` of its reset key, a fresh inner
    Adam), not from what it carried."""
    with jax.enable_x64(True):
        task, meta, inner, _, _ = members_setup("loss_weighting")
        pop = PopulationConfig(size=N, reduce="update", lifetime=3)
        assert [population.resets_at(s, pop) for s in (0, 1)] == [[], [1]]
        method = MetaGradMethod("mixflow")
        opt = meta_optimizer(MetaOptConfig(lr=0.05), steps=10)
        state = {"step": jnp.zeros((), jnp.int32), "meta": meta, "inner": inner,
                 "meta_opt": population.stack_optimizer(opt, N).init(meta)}
        step = jax.jit(lambda s, b, o: population.step(task, method, opt, pop, 7, s, b, o, keep_if=keep_if,
                                                       all_finite=all_finite))
        alone = jax.jit(lambda m, i, b, o: meta_value_and_grad(task, method)(m, i, b, o))
        hand_meta, hand_inner = meta, [population.member(inner, k) for k in range(N)]
        hand_opt = [opt.init(meta) for _ in range(N)]
        for t in range(2):
            batches, outer = random_batches(DATA, MODEL.vocab_size, jax.random.key(10 + t), members=N)
            state, metrics = step(state, batches, outer)
            assert bool(metrics["finite"])
            updates = []
            for k in range(N):
                if k in population.resets_at(t, pop):
                    fresh = task.init_inner(population.reset_key(7, t, k), meta=hand_meta)
                    assert rel(fresh[0], hand_inner[k][0]) > 1e-2  # not what it carried
                    hand_inner[k] = fresh
                (_, aux), grad = alone(hand_meta, hand_inner[k], population.member(batches, k),
                                       population.member(outer, k))
                update, hand_opt[k] = opt.update(grad, hand_opt[k], hand_meta)
                updates.append(update)
                hand_inner[k] = aux.inner
            hand_meta = optax.apply_updates(hand_meta, jax.tree.map(lambda *u: sum(u) / N, *updates))
        assert rel(state["meta"], hand_meta) < 1e-12
        assert rel(state["meta"], meta) > 1e-3  # two steps moved η
        for k in range(N):
            assert rel(population.member(state["meta_opt"], k), hand_opt[k]) < 1e-12
            assert rel(population.member(state["inner"], k), hand_inner[k]) < 1e-12


def test_resets_are_staggered_over_the_lifetime():
    """N=4, L=8: member i's resets are at the steps s > 0 with s = 2i (mod 8)."""
    pop = PopulationConfig(size=4, lifetime=8)
    table = {s: population.resets_at(s, pop) for s in range(17)}
    assert table == {0: [], 1: [], 2: [1], 3: [], 4: [2], 5: [], 6: [3], 7: [], 8: [0], 9: [], 10: [1], 11: [],
                     12: [2], 13: [], 14: [3], 15: [], 16: [0]}
    assert population.resets_at(5, PopulationConfig(size=4)) == []  # lifetime 0: never


def test_members_start_from_their_own_keys_in_a_program_that_does_not_grow_with_them():
    """Member 0 is a one-member run's init (from the key itself), member i the init from fold_in(key, i); and the
    init program has as many lines for 300 members as for 3 (one init per member made 200 members' start-up compile
    for more than 10 minutes, a stop signal unheard until it ended). The same float32 draws, compiled in two
    programs, may differ by an ulp or two (1e-6 relative); another key's draws differ by O(1)."""
    task = build_task("learned_lr", MODEL.replace(param_dtype="float32"), remat=False)
    key, meta = jax.random.key(7), task.init_meta(jax.random.key(8))
    got = population.init_inner(task, key, meta, N)
    for i, k in enumerate([key, jax.random.fold_in(key, 1), jax.random.fold_in(key, 2)]):
        alone = jax.jit(task.init_inner)(k, meta)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), population.member(got, i),
                     alone)

    def lines(n):
        return len(jax.jit(lambda k, m: population.init_inner(task, k, m, n)).lower(key, meta).as_text().splitlines())

    few, many = lines(3), lines(300)
    assert few == many, (few, many)


def test_a_reset_to_pretrained_weights_is_them_with_a_fresh_inner_adam():
    task = build_task("learned_lr", MODEL.replace(param_dtype="float32"), remat=False)
    theta = task.init_params(jax.random.key(3))
    meta = task.init_meta(jax.random.key(4))
    fresh_theta, fresh_opt = population.fresh(task, meta, jax.random.key(5), theta)
    assert rel(fresh_theta, theta) == 0
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), fresh_opt, task.inner_opt.init(theta)))


def test_population_config_refusals():
    from metatrain import config as config_lib
    from metatrain.errors import ConfigError

    for overrides, message in ((["population.size=0"], "population.size: must be >= 1"),
                               (["population.reduce=median"], "population.reduce: 'median' is not grad or update"),
                               (["population.lifetime=4"], "resets need a population"),
                               (["population.size=4", "population.lifetime=2"], "shorter than the population"),
                               (["task=maml", "population.size=2", "population.lifetime=4"], "carry no inner state"),
                               (["population.size=2", "population.reduce=update", "meta_opt.offload_moments=true"],
                                "reduce=grad with meta_opt.offload_moments")):
        with pytest.raises(ConfigError, match=message):
            config_lib.load(None, overrides)
    assert dataclasses.asdict(config_lib.load(None, ["population.size=2"]).population) == {
        "size": 2, "reduce": "grad", "lifetime": 0, "axis": False}


SIDE_BY_SIDE = """
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
from metatrain import config as config_lib, step
from metatrain.sharding import make_mesh
base = ["model.d_model=8", "model.n_heads=2", "model.d_ff=16", "model.n_layers=1", "model.vocab_size=32",
        "model.param_dtype=float64", "data.seq_len=4", "data.batch=2", "population.size=2", "population.lifetime=2",
        "population.reduce=update"]
states = {}
for axis in (False, True):
    cfg = config_lib.load(None, base + [f"population.axis={str(axis).lower()}"])
    mesh = make_mesh(cfg.mesh, jax.devices() if axis else jax.devices()[:1], population=2 if axis else 0)
    program = step.meta_program(cfg, mesh)
    state, compiled = step.init(program, jax.random.key(0)), step.lower(program).compile()
    specs = step.batch_specs(cfg.data, mesh, 2)
    for k in range(2):
        batches = step.random_batches(cfg.data, 32, jax.random.key(k + 1), members=2)
        state, _ = compiled(state, *jax.tree.map(lambda x, s: jax.device_put(x, s.sharding), batches, specs))
    spec = jax.tree.leaves(state["inner"])[0].sharding.spec
    assert (spec[0] == "population") == axis, spec
    states[axis] = jax.device_get(state)
for key in ("meta", "inner", "meta_opt"):
    for x, y in zip(jax.tree.leaves(states[False][key]), jax.tree.leaves(states[True][key])):
        np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-12)
"""


@pytest.mark.slow
def test_members_side_by_side_over_a_population_axis_match_one_after_another():
    """population.axis=true on 4 devices (2 members x 2 data shards each; vmap, the members' sums all-reduced)
    against the members one after another on one device: two outer steps of reduce=update with a reset agree in
    float64 up to the order of reductions (1e-9 relative: the data-parallel split sums each
    member's batch in two halves; float64 rounding is ~1e-16 per operation)."""
    import subprocess
    import sys

    from helpers import env

    res = subprocess.run([sys.executable, "-c", SIDE_BY_SIDE], env=env(devices=4), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
