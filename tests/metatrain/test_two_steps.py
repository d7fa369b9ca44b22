"""`two_steps`: at T=2 (mixflow, saved gradients) both inner steps and the outer loss share one backward pass. It must
be the one `outer_loss` takes there, and give autodiff's derivatives for every output: the outer value, the inner
losses and the final inner state (θ_2, υ_2), whose cotangents the meta-gradient alone leaves zero; with θ̄_2
recomputed after the last HVP (a seeded plan) or kept."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from metatrain import two_steps
from metatrain.bench.variants import build_task
from metatrain.data.pipeline import DataConfig
from metatrain.models import preset
from metatrain.step import random_batches
from metatrain.unroll import MetaGradMethod, outer_loss


@pytest.mark.slow
# learned_lr: the inner update depends on η; without block remat the plan is not seeded and θ̄_2 is kept, not recomputed
@pytest.mark.parametrize("task_name, remat", [("learned_lr", True), ("maml", True), ("learned_lr", False)])
def test_all_outputs_differentiate_as_autodiff(task_name, remat, monkeypatch):
    calls = []
    run = two_steps.run
    monkeypatch.setattr(two_steps, "run", lambda *args: calls.append(args) or run(*args))
    with jax.enable_x64(True):
        model = preset("tiny").replace(param_dtype="float64", compute_dtype="")
        task = build_task(task_name, model, remat=remat)
        meta = task.init_meta(jax.random.key(0))
        inner = task.init_inner(jax.random.key(1), meta)
        batches, outer_batch = random_batches(DataConfig(seq_len=8, batch=2, inner_steps=2), model.vocab_size,
                                              jax.random.key(2))
        floats = lambda tree: [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]

        def objective(method):
            def f(meta):
                value, aux = outer_loss(task, method)(meta, inner, batches, outer_batch)
                state = ravel_pytree(floats(aux.inner))[0]  # θ_2 and υ_2's float leaves
                weights = jax.random.normal(jax.random.key(4), state.shape, state.dtype)
                return value + 0.3 * aux.inner_losses @ jnp.array([1.0, -2.0]) + 1e-2 * state @ weights
            return jax.jit(jax.value_and_grad(f))

        ref_value, ref = objective(MetaGradMethod(mode="autodiff"))(meta)
        assert not calls
        value, got = objective(MetaGradMethod(mode="mixflow", save_inner_grads=True))(meta)
        assert len(calls) == 1 and calls[0][2] == remat  # seeded
        got, ref = ravel_pytree(got)[0], ravel_pytree(ref)[0]  # in float64: outside x64, jnp would make them float32
    assert got.dtype == ref.dtype == np.float64
    np.testing.assert_allclose(value, ref_value, rtol=1e-13)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12 * float(np.max(np.abs(ref))))
