"""Held-out evaluation of learned per-example weights (loss weighting's `Task.evaluation`).

Every evaluation: the ROC AUC of the meta model's scores for clean vs corrupted held-out examples (with
`data.corrupt_fraction > 0`), the mean weight of clean and of corrupted examples, and the effective sample size as
a fraction of the batch; the last weights go to `eval_weights.json` for the run report. At the end of the run: the
lowest- and highest-weighted held-out documents. All but the effective sample size leave out the examples without a
target to train on (`trained_examples`: weight 0, a score that says nothing of the document).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from metatrain.data.formats import preview
from metatrain.data.pipeline import device_features, to_global
from metatrain.tasks.base import trained_examples


def roc_auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties counted half (Mann-Whitney U)."""
    pos, neg = scores[positive.astype(bool)], scores[~positive.astype(bool)]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


@dataclasses.dataclass
class EvalContext:
    """What a task's evaluation may use of the run: its config, data streams and shardings.

    Args:
      cfg: the run's `Config`.
      streams: the run's `data.pipeline.Streams` (held-out batches, the documents' ids and texts).
      batch_sharding: the sharding of an outer batch.
      replicated: a sharding that replicates an output on every device.
      write_json: `write_json(name, payload)` writes a JSON file into the run's log dir (process 0 only).
    """

    cfg: Any
    streams: Any
    batch_sharding: jax.sharding.Sharding
    replicated: jax.sharding.Sharding
    write_json: Callable[[str, dict], None]


class WeightEvaluation:
    """Scores and weights of a task with `scores(meta, batch)` and `weights(meta, batch)` on held-out examples."""

    def __init__(self, task, run: EvalContext, max_batches: int = 64):
        self.task, self.run, self.max_batches = task, run, max_batches
        self.flagged = run.cfg.data.corrupt_fraction > 0
        self._fn = jax.jit(lambda meta, b: (task.scores(meta, b), b["corrupted"], task.weights(meta, b), b["doc"],
                                            trained_examples(b)), out_shardings=run.replicated)
        self._batches = None

    def _scored(self, meta) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
        """(scores, weights, corrupted flags or None, document indices, which have a target to train on) on held-out
        examples of the inner source, gathered on every host. With corruption flags: at least `eval_batches` (and 8)
        flagged batches, more while one class is missing among the trained examples; without: `eval_batches` batches;
        chosen at the first call and kept."""
        cfg = self.run.cfg
        results = []
        if self._batches is None:
            n = max(cfg.eval_batches, 8) if self.flagged else cfg.eval_batches
            batches = self.run.streams.test_batches(self.max_batches if self.flagged else n,
                                                    cfg.data.corrupt_fraction, seed=777, of="held_out")
            kept = []
            for b in batches:
                if len(results) >= n and (not self.flagged or
                                          len(np.unique(np.concatenate([r[1][r[4]] for r in results]))) == 2):
                    break
                kept.append(to_global(b, self.run.batch_sharding, (*device_features(cfg.data), "doc")))
                results.append(jax.device_get(self._fn(meta, kept[-1])))
            self._batches = kept
        else:
            results = [jax.device_get(self._fn(meta, b)) for b in self._batches]
        scores, flags, weights, docs, trained = (np.concatenate(x) for x in zip(*results))
        return scores, weights, flags if self.flagged else None, docs, trained

    def metrics(self, meta, step: int) -> dict:
        """`eval_auc` (with both kinds of example), `eval_weight_ess`, `eval_weight_clean`, `eval_weight_corrupted`;
        writes `eval_weights.json`."""
        scores, weights, flags, _, trained = self._scored(meta)
        out = {}
        batch = self.run.cfg.data.batch
        p = weights.reshape(-1, batch)
        p = p[p.sum(-1) > 0]  # a batch of rows without a target (prompts only) weighs nothing: no sample to size
        p = p / p.sum(-1, keepdims=True)
        out["eval_weight_ess"] = float(np.mean(1 / (p * p).sum(-1)) / batch) if len(p) else float("nan")
        scores, weights, flags = scores[trained], weights[trained], None if flags is None else flags[trained]
        both = flags is not None and 0 < flags.sum() < len(flags)  # AUC and the split need both kinds
        if both:
            out["eval_auc"] = roc_auc(scores, 1 - flags)
            out["eval_weight_clean"] = float(weights[flags == 0].mean())
            out["eval_weight_corrupted"] = float(weights[flags == 1].mean())
        self.run.write_json("eval_weights.json", {"step": step, "weights": weights.tolist(),
                                                  "corrupted": None if flags is None else flags.astype(int).tolist()})
        return out

    def summary(self, meta, last: dict) -> dict:
        """The end of the run: `corrupted_auc` (from the last evaluation; NaN if the sample kept one class) and
        `weight_extremes`."""
        return {"corrupted_auc": last.get("eval_auc", float("nan")) if self.flagged else None,
                "weight_extremes": self.extremes(meta)}

    def extremes(self, meta, k: int = 5) -> tuple[list[dict], list[dict]]:
        """The k lowest- and highest-weighted held-out documents (a document's weight: the mean over its examples) as
        {id, weight, text} with the text's first 80 characters (fewer when fewer than 2k documents were scored)."""
        _, weights, _, docs, trained = self._scored(meta)
        weights, docs = weights[trained], docs[trained]
        unique, inverse = np.unique(docs, return_inverse=True)
        mean = np.bincount(inverse, weights) / np.bincount(inverse)
        order, k = np.argsort(mean, kind="stable"), min(k, len(unique) // 2)  # two disjoint lists
        source = self.run.streams.docs

        def row(j):
            text = preview(source[int(unique[j])])
            return {"id": source.doc_id(int(unique[j])), "weight": float(mean[j]), "text": text[:80]}

        return [row(j) for j in order[:k]], [row(j) for j in order[::-1][:k]]
