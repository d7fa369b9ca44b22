"""bfloat16 compute: parameters, optimizer states and meta-gradients stay float32; results near float32's.

Tolerances, and what they mean: bfloat16 keeps 8 significant bits, so every activation is off by up to
2^-9 ≈ 2e-3 relative. The outer loss (a mean over many tokens) must stay within 1e-3 relative of
float32's, the inner parameters after T Adam steps within 2e-2. Single meta-gradient entries can be off
by much more (sums that nearly cancel), so for the meta-gradient we ask for its direction: cosine >= 0.95.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.flatten_util import ravel_pytree

from metatrain import models
from metatrain.bench.variants import build_task, parse_variant
from metatrain.data.pipeline import DataConfig
from metatrain.step import random_batches
from metatrain.unroll import meta_value_and_grad


def _run(compute_dtype):
    model = models.preset("small").replace(compute_dtype=compute_dtype)
    task = build_task("learned_lr", model, remat=True)
    meta = task.init_meta(jax.random.key(0))
    inner = task.init_inner(jax.random.key(1), meta)
    batches, outer_batch = random_batches(DataConfig(inner_steps=2, batch=4, seq_len=32), model.vocab_size,
                                          jax.random.key(2))
    (value, aux), grad = jax.jit(meta_value_and_grad(task, parse_variant("mixflow+remat+save").method))(
        meta, inner, batches, outer_batch)
    return value, aux.inner, grad


@pytest.mark.slow
def test_bfloat16_compute_close_to_float32():
    v32, (theta32, _), g32 = _run("float32")
    v16, (theta16, opt16), g16 = _run("bfloat16")
    floats = [x for x in jax.tree.leaves((theta16, opt16, g16, v16)) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert all(x.dtype == jnp.float32 for x in floats)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))
    assert abs(float(v16 - v32)) <= 1e-3 * abs(float(v32))
    assert rel(ravel_pytree(theta32)[0], ravel_pytree(theta16)[0]) <= 2e-2
    a, b = ravel_pytree(g32)[0], ravel_pytree(g16)[0]
    assert float(a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b))) >= 0.95
