"""The one outer-step program: its batch spec is what the data pipeline yields, and test batches follow it."""

import jax
import numpy as np

from metatrain import step
from metatrain.data.pipeline import DEVICE_FEATURES, DataConfig, Streams


def test_batch_specs_are_what_the_pipeline_yields():
    """The Trainer runs a program compiled for `batch_specs`: the real batches must have its keys, shapes, dtypes."""
    data = DataConfig(vocab_size=300, seq_len=16, batch=4, inner_steps=3, corrupt_fraction=0.3, shuffle_window=64)
    specs = step.batch_specs(data)
    real = Streams(data, 0, 1).next()
    for spec, batch in zip(specs, real):
        assert set(spec) == set(DEVICE_FEATURES) and set(batch) == set(DEVICE_FEATURES) | {"doc"}  # doc: host-side
        for k in spec:
            got = jax.numpy.asarray(batch[k])
            assert (got.shape, got.dtype) == (spec[k].shape, spec[k].dtype), k
    fake = step.random_batches(data, 300, jax.random.key(0))
    assert jax.tree.structure(fake) == jax.tree.structure(specs)
    assert all(f.shape == s.shape and f.dtype == s.dtype for f, s in zip(jax.tree.leaves(fake), jax.tree.leaves(specs)))
    inner = fake[0]
    assert int(inner["tokens"].max()) < 300 and not np.asarray(inner["corrupted"]).any()
    np.testing.assert_array_equal(inner["positions"][1, 2], np.arange(17))


def test_batch_specs_carry_the_meshs_shardings():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp"))
    inner, outer = step.batch_specs(DataConfig(seq_len=8, batch=2), mesh)
    assert inner["tokens"].sharding.spec == jax.sharding.PartitionSpec(None, ("data", "fsdp"))
    assert outer["tokens"].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
