"""Loss weighting's held-out evaluation (`metatrain.tasks.weight_eval`) on batches with rows that have no target."""

import types

import jax
import jax.numpy as jnp
import numpy as np

from metatrain import models, step
from metatrain.data.pipeline import DataConfig
from metatrain.tasks import make_task
from metatrain.tasks.weight_eval import WeightEvaluation, roc_auc

CFG = models.preset("tiny")


def test_examples_without_a_target_are_left_out_of_the_auc_the_means_and_the_weights_file():
    """Rows of conversations holding no assistant token weigh 0 and score 0 (a mean over no token): counted, they
    pulled the clean and corrupted mean weights down and ranked as the cleanest examples in the AUC."""
    task = make_task("loss_weighting", model=CFG)
    meta = dict(task.init_meta(jax.random.key(0)), log_temperature=jnp.asarray(2.0))
    data = DataConfig(inner_steps=1, batch=4, seq_len=8)
    # which rows have a target, batch by batch: two patterns, and a last batch without any
    trained = [np.array([False, True, False, True]), np.array([True, True, False, True])] * 3 + [
        np.array([False, True, False, True]), np.zeros(4, bool)]
    batches = []
    for i in range(8):
        b = {k: np.asarray(v[0]) for k, v in step.random_batches(data, CFG.vocab_size, jax.random.key(i))[0].items()}
        rows = trained[i]
        mask = np.zeros((4, 9), np.int32)
        mask[rows, 4:] = 1
        b.update(loss_mask=mask, corrupted=np.array([1, 0, 0, 1], np.int32), doc=np.arange(4 * i, 4 * i + 4))
        batches.append(b)
    written = {}
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    run = types.SimpleNamespace(
        cfg=types.SimpleNamespace(data=types.SimpleNamespace(batch=4, corrupt_fraction=0.3, format="chat"),
                                  eval_batches=1),
        streams=types.SimpleNamespace(test_batches=lambda n, *a, **k: iter(batches[:n])),
        batch_sharding=device, replicated=device, write_json=lambda name, payload: written.update({name: payload}))
    metrics = WeightEvaluation(task, run).metrics(meta, step=1)
    # the reference: the same task's scores and weights, batch by batch, on the rows with a target only
    keep = np.concatenate(trained)
    scores = np.concatenate([np.asarray(task.scores(meta, b)) for b in batches])[keep]
    weights = np.concatenate([np.asarray(task.weights(meta, b)) for b in batches])
    flags = np.concatenate([b["corrupted"] for b in batches])[keep]
    assert (weights[~keep] == 0).all() and (weights[keep] > 0).all()
    saved = written["eval_weights.json"]
    assert np.allclose(saved["weights"], weights[keep], rtol=1e-6) and saved["corrupted"] == flags.tolist()
    assert metrics["eval_auc"] == roc_auc(scores, 1 - flags)
    assert np.isclose(metrics["eval_weight_clean"], weights[keep][flags == 0].mean(), rtol=1e-6)
    assert np.isclose(metrics["eval_weight_corrupted"], weights[keep][flags == 1].mean(), rtol=1e-6)
    # the effective sample size: of the batches that weigh anything (the last weighs nothing: 0/0)
    p = weights.reshape(8, 4)[:7]
    p = p / p.sum(-1, keepdims=True)
    assert np.isclose(metrics["eval_weight_ess"], np.mean(1 / (p * p).sum(-1)) / 4, rtol=1e-6)
