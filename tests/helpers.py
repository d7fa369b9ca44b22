"""Helpers shared by the tests: reading a run's saved state and comparing parameters."""

import os

import numpy as np
import orbax.checkpoint as ocp

# a tiny loss-weighting run: seconds per step on CPU
TINY = ["task=loss_weighting", "model.d_model=16", "model.n_heads=2", "model.d_ff=32", "data.vocab_size=300",
        "data.seq_len=16", "data.batch=8", "data.shuffle_window=1024", "data.corrupt_fraction=0.3",
        "eval_batches=1", "log_every=1", "inner_lr=0.01"]


def saved_state(workdir, step):
    """The saved state on this process's one device, whatever mesh wrote it."""
    import jax

    path = os.path.abspath(os.path.join(workdir, "checkpoints", str(step), "state"))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path).item_metadata.tree
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
        return ckptr.restore(path, target)


def leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_same_params(a, b):
    """Relative error ||a - b|| / ||a|| <= 1e-5 over all parameters (float32). Not the max over entries:
    Adam turns a gradient entry that cancels to ~0 into a step of about ±lr whose sign follows the
    reduction order, so on 1 vs 8 devices a handful of such entries legitimately differ by ~lr. We
    check that they stay a handful (<= 0.1% of entries off by more than 1e-5 of the largest)."""
    x, y = (np.concatenate([v.ravel() for v in leaves(s)]) for s in (a, b))
    assert np.linalg.norm(x - y) / np.linalg.norm(x) <= 1e-5
    assert (np.abs(x - y) > 1e-5 * np.abs(x).max()).mean() <= 1e-3
