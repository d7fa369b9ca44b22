"""Learned weights out of a finished run, and its models evaluated on any documents.

`scores(workdir, source, out)` writes one JSON line per document, `{"id", "score", "weight"}`, with the run's
final η. A document is scored alone, not packed: its tokens (up to `max_rows` rows of seq_len+1) are the
rows of a padded batch, and its score is the task's score averaged over its tokens. Its weight is the one it
gets within a batch of the run's size whose other examples have the mean exp-score of the documents scored:
w = B·e^s / (e^s + (B−1)·mean e^s') — the task's α = B·softmax(scores) with the rest of the batch typical.

`evaluate(workdir, source)` gives the next-token loss (mean over tokens) and perplexity of the run's inner
model, its uniform baseline's and, for a run started from a pretrained model, the starting model's, on the
run's validation documents by default.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator

import jax
import numpy as np

from metatrain import export as export_lib
from metatrain import paths, population, progress
from metatrain.config import Config
from metatrain.data import records
from metatrain.data.pipeline import document_source, encoder, fields, split_ids
from metatrain.data.pipeline import where as where_
from metatrain.data.sources import PATH_SOURCES
from metatrain.errors import ConfigError, DataError, MetatrainError
from metatrain.run import PRETRAIN, Run, on_one_device


def document_rows(tokens: np.ndarray, mask: np.ndarray, seq_len: int, max_rows: int) -> list[dict]:
    """One document's tokens (and loss mask) as up to `max_rows` rows of seq_len+1 (consecutive rows overlap by one
    token, so every token but the first is a target once), the last padded with segment id 0; positions restart in
    each row, as in a packed training row. `targets`: the row's targets the mask marks."""
    rows, start = [], 0
    while start < len(tokens) - 1 and len(rows) < max_rows:
        chunk, chunk_mask = tokens[start:start + seq_len + 1], mask[start:start + seq_len + 1]
        n = len(chunk)
        row, loss_mask = np.zeros(seq_len + 1, np.int32), np.zeros(seq_len + 1, np.int32)
        row[:n], loss_mask[:n] = chunk, chunk_mask
        rows.append({"tokens": row, "segment_ids": (np.arange(seq_len + 1) < n).astype(np.int32),
                     "positions": np.arange(seq_len + 1, dtype=np.int32), "loss_mask": loss_mask,
                     "targets": int(loss_mask[1:].sum())})
        start += seq_len
    return rows


FIELDS = ("tokens", "segment_ids", "positions", "loss_mask")
EMPTY_ROW = {"targets": 0}


def _stack(rows: list[dict], seq_len: int, batch: int) -> dict:
    """Rows as a batch [batch, seq+1], padded with empty rows."""
    empty = np.zeros(seq_len + 1, np.int32)
    rows = rows + [EMPTY_ROW] * (batch - len(rows))
    b = {f: np.stack([r.get(f, empty) for r in rows]) for f in FIELDS}
    b["corrupted"] = np.zeros(batch, np.int32)
    return b


def compiled_scorer(fn, params, seq_len: int, batch: int, fix: str):
    """`fn(params, batch) -> [batch]` compiled for batches of `batch` rows of seq_len+1 tokens and refused (one
    TrainingError line ending in `fix`) where its peak passes the memory here, before any batch is built."""
    from metatrain.aot import check_fits, compiled_memory

    spec = lambda shape: jax.ShapeDtypeStruct(shape, np.int32)
    rows = {f: spec((batch, seq_len + 1)) for f in FIELDS} | {"corrupted": spec((batch,))}
    compiled = jax.jit(fn).lower(params, rows).compile()
    devices = jax.tree.leaves(params)[0].sharding.device_set
    check_fits(compiled_memory(compiled), list(devices), f"scoring {batch:,} rows at a time", fix)
    return compiled


def _batches(docs, ids, encode, seq_len: int, batch: int, max_rows: int
             ) -> Iterator[tuple[dict, np.ndarray, np.ndarray]]:
    """(batch of rows [batch, seq+1], each row's document position in `ids` (-1: padding), its target count)."""
    pending = []
    for k, i in enumerate(ids):
        pending += [(k, r) for r in document_rows(*encode(docs[int(i)], where_(docs, int(i))), seq_len,
                                                          max_rows)]
        while len(pending) >= batch or (k == len(ids) - 1 and pending):
            take, pending = pending[:batch], pending[batch:]
            pad = batch - len(take)
            yield (_stack([r for _, r in take], seq_len, batch), np.asarray([k for k, _ in take] + [-1] * pad),
                   np.asarray([r["targets"] for _, r in take] + [0] * pad))


def not_finite(where: str, score: float) -> DataError:
    """The error for a document whose score is inf or NaN: the parameters that scored it diverged."""
    return DataError(f"{where}: its score is {score}, not a finite number: the parameters that scored it diverged "
                     "(a run whose meta-training diverged; its metrics.jsonl counts the skipped updates); train again, "
                     "e.g. with a smaller meta_opt.lr")


def score_stream(fn, params, items, encode, seq_len: int, batch: int, max_rows: int):
    """Per-document means of `fn(params, batch) -> [batch]` over a stream of documents, in order and in bounded
    memory: `items` yields (record with `.doc` and `.where`, progress); yields (record, its token
    count, its mean over its target tokens (NaN without any), progress). Rows of several documents share a batch
    (padding rows at the end only). A document with targets whose mean is not finite is a DataError (`not_finite`).
    """
    pending_docs, rows = [], []  # [record, progress, tokens, total, count, rows left]; (doc slot, row)
    first = 0  # the document number of pending_docs[0]

    def run_batch(take):
        nonlocal first
        values = np.asarray(fn(params, _stack([r for _, r in take], seq_len, batch)))
        for (slot, r), v in zip(take, values):
            doc = pending_docs[slot - first]
            doc[3] += float(v) * r["targets"]
            doc[4] += r["targets"]
            doc[5] -= 1

    def finished():
        nonlocal first
        while pending_docs and pending_docs[0][5] == 0:
            rec, where, n_tokens, total, count, _ = pending_docs.pop(0)
            first += 1
            mean = total / count if count else float("nan")
            if count and not math.isfinite(mean):
                raise not_finite(rec.where, mean)
            yield rec, n_tokens, mean, where

    for rec, where in items:
        tokens, mask = encode(rec.doc, rec.where)
        doc_rows = document_rows(tokens, mask, seq_len, max_rows)
        slot = first + len(pending_docs)
        pending_docs.append([rec, where, len(tokens), 0.0, 0, len(doc_rows)])
        rows += [(slot, r) for r in doc_rows]
        while len(rows) >= batch:
            run_batch(rows[:batch])
            rows = rows[batch:]
        yield from finished()
    if rows:
        run_batch(rows)
    yield from finished()


def _per_document(fn, params, docs, ids, encode, cfg: Config, max_rows: int,
                  what: str) -> tuple[np.ndarray, np.ndarray]:
    """fn(params, batch) -> [batch] per-row means, averaged per document over its target tokens (NaN for a document
    without any); and each document's target count."""
    total, count = np.zeros(len(ids)), np.zeros(len(ids))
    with progress.bar(len(ids), what, disable=len(ids) < 2, unit="doc") as bar:
        for b, where, targets in _batches(docs, ids, encode, cfg.data.seq_len, cfg.data.batch, max_rows):
            values = np.asarray(fn(params, b))
            keep = where >= 0
            np.add.at(total, where[keep], values[keep] * targets[keep])
            np.add.at(count, where[keep], targets[keep])
            bar.update(int(where[keep].max()) + 1 - bar.n)  # documents finished so far
    if not count.any():
        raise DataError(f"{what}: none of the {len(ids):,} documents has a token to predict (empty texts, or a "
                        "document of one token); nothing to score or evaluate")
    return np.where(count > 0, total / np.maximum(count, 1), np.nan), count


def batch_weights(scores: np.ndarray, batch: int) -> np.ndarray:
    """w = B·e^s / (e^s + (B−1)·mean e^s'): each document's weight in a batch of B otherwise typical examples."""
    finite = scores[np.isfinite(scores)]
    log_mean = np.log(np.mean(np.exp(finite - finite.max()))) + finite.max()
    return batch / (1 + (batch - 1) * np.exp(log_mean - scores))


def _inputs(run: Run, spec: str) -> list[str]:
    """The files `scores` reads: the run's own and the documents' (a JSONL or Parquet glob's matches)."""
    found = [os.path.join(run.workdir, name) for name in ("config.yaml", "metrics.jsonl")]
    if spec.startswith(tuple(records.FORMATS)):
        kind, pattern = records.input_format(spec)
        with contextlib.suppress(MetatrainError):  # no match: said when the documents are read
            found += records.files(kind, pattern)
    return found


def scores(workdir: str, source: str | None = None, out: str | None = None, max_rows: int = 4,
           overwrite: bool = False, text_field: str | None = None) -> tuple[str, int]:
    """Write `out` (default WORKDIR/scores.jsonl): {"id", "score", "weight"} per document of `source` (default:
    the run's data.source). Returns (the path, the number of documents).

    OUT is checked before any scoring (`paths.output`): one of the inputs, a directory, or an existing file
    without `overwrite` is refused; it is written through OUT.tmp, removed on any error or signal. The scores of a
    JSONL or Parquet source stopped by Ctrl-C or SIGTERM (or killed) are kept in OUT.scores.tmp, and the same
    command goes on from them. `text_field`: the field or column of the documents' text (default: the run's
    data.text_field)."""
    run = Run.open(workdir).meta_training().reading(text_field)  # metadata only: OUT is checked before any scoring
    source = paths.prefixed(source, PATH_SOURCES)
    spec = source or run.cfg.data.source
    out = paths.output(out or os.path.join(paths.local(workdir), "scores.jsonl"), "scores --out",
                       inputs=_inputs(run, spec), overwrite=overwrite)
    if not hasattr(run.task, "scores"):
        raise ConfigError(f"scores: task {run.cfg.task!r} of {workdir} has no per-example scores (loss_weighting "
                          f"has)")
    encode = encoder(run.cfg.data, run.tokenizer())
    fn = jax.jit(run.task.scores)
    if spec.startswith(tuple(records.FORMATS)):  # streamed: bounded memory whatever the file's size
        return _scores_streamed(run, spec, out, encode, fn, max_rows)
    docs = document_source(run.cfg.data, spec)
    values, count = _per_document(fn, run.restored("meta"), docs, np.arange(len(docs)), encode, run.cfg, max_rows,
                                  "scoring")
    bad = np.flatnonzero((count > 0) & ~np.isfinite(values))
    if bad.size:
        raise not_finite(f"{spec} document {docs.doc_id(int(bad[0]))}", float(values[bad[0]]))
    weights = batch_weights(values, run.cfg.data.batch)
    with paths.staged_file(out) as tmp, open(tmp, "w") as f:
        for i in range(len(docs)):
            score = float(values[i]) if np.isfinite(values[i]) else None  # an empty document has no score
            weight = float(weights[i]) if np.isfinite(weights[i]) else None
            f.write(json.dumps({"id": docs.doc_id(i), "score": score, "weight": weight}) + "\n")
    return out, len(docs)


def _scores_streamed(run: Run, spec: str, out: str, encode, fn, max_rows: int) -> tuple[str, int]:
    """`scores` of a JSONL or Parquet source, streamed: one pass scores every document into OUT.scores.tmp (and the
    log-mean of e^score the weights need), a second writes OUT with the weights. Stopped by Ctrl-C or SIGTERM once
    documents are scored (or killed outright), it keeps OUT.scores.tmp, and the same command goes on from it."""
    kind, pattern = records.input_format(spec)
    files = records.files(kind, pattern)
    mine = records.share(kind, files, 0, 1)
    tmp = f"{out}.scores.tmp"  # the first pass's; OUT itself is written through OUT.tmp
    d = run.cfg.data
    key = {"run": os.path.realpath(run.workdir), "step": run.step, "format": kind, "files": records.fingerprint(files),
           "batch": d.batch, "max_rows": max_rows, "id_field": d.id_field,
           "text_field": d.text_field}  # what the first pass's scores are of
    folder, kept = paths.first_missing(os.path.dirname(out)), False
    try:  # from the making of OUT's folder on: a signal at any point takes it away, unless scores are kept in it
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with paths.staged_file(out) as final:
            n = _two_passes(run, spec, kind, files, mine, encode, fn, max_rows, tmp, key, final)
        return out, n
    except KeyboardInterrupt:
        n = _lines(tmp) - 1  # after what the scores are of
        if n > 0:
            kept = True
            print(f"scores: the scores of the {n:,} documents scored so far are kept in {tmp}: the same command goes "
                  "on from them (or remove it)", file=sys.stderr)
        raise
    finally:
        if not kept:
            paths.remove(tmp)
            if folder and not os.path.exists(out):
                paths.remove(folder)


def _lines(path: str) -> int:
    """The whole lines of a file (0 if there is none)."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def _first_pass_state(tmp: str, key: dict) -> tuple[int, int, float, tuple[int, int] | None]:
    """(documents, finite scores, log-sum of e^score, the last document's file and offset) of the first pass's file
    `tmp` when its scores are of `key` (its first line), else nothing scored; a last line cut short (a kill) is cut
    off the file."""
    n, finite, log_sum, last = 0, 0, -math.inf, None
    try:
        with open(tmp, "rb") as f:
            if json.loads(f.readline()) != key:
                return 0, 0, -math.inf, None
            end = f.tell()
            for line in f:
                if not line.endswith(b"\n"):
                    break
                _, score, file, offset = json.loads(line)
                n, end, last = n + 1, end + len(line), (file, offset)
                if score is not None:
                    finite, log_sum = finite + 1, np.logaddexp(log_sum, score)
    except (OSError, ValueError):
        return 0, 0, -math.inf, None
    if end < os.path.getsize(tmp):
        os.truncate(tmp, end)
    return n, finite, log_sum, last


def _two_passes(run, spec, kind, files, mine, encode, fn, max_rows, tmp, key, final) -> int:
    """Scores into `tmp` (and the log-mean of e^score), going on after the documents it holds scores of (`key`:
    what they must be of), then the lines with weights into `final`; the count."""
    d = run.cfg.data
    n, finite, log_sum, last = _first_pass_state(tmp, key)
    if n:
        print(f"scores: going on from the {n:,} documents in {tmp} that a stopped run scored", file=sys.stderr)
    else:
        with open(tmp, "w") as f:
            f.write(json.dumps(key) + "\n")
    with open(tmp, "a") as f, progress.bar(mine.size, "scoring", unit="B" if kind == "jsonl" else " docs",
                                           unit_scale=kind == "jsonl") as bar:
        items = records.after(records.read(kind, files, mine, fields(d), d.id_field), n, last, tmp,
                              on_skip=lambda where: bar.update(where - bar.n))
        for rec, _, score, where in score_stream(fn, run.restored("meta"), items, encode, d.seq_len, d.batch,
                                                 max_rows):
            f.write(json.dumps([rec.id, score if math.isfinite(score) else None, rec.file, rec.offset]) + "\n")
            n += 1
            if math.isfinite(score):
                finite += 1
                log_sum = np.logaddexp(log_sum, score)
            bar.update(where - bar.n)
    if not n:
        raise DataError(f"scores: {spec} holds no documents")
    if not finite:
        raise DataError(f"scoring: none of the {n:,} documents has a token to predict (empty texts, or a document of "
                        "one token); nothing to score")
    log_mean = log_sum - math.log(finite)
    with open(tmp) as f, open(final, "w") as g:
        f.readline()  # what the scores are of
        for line in f:
            doc_id, score, _, _ = json.loads(line)
            weight = None if score is None else d.batch / (1 + (d.batch - 1) * math.exp(log_mean - score))
            g.write(json.dumps({"id": doc_id, "score": score, "weight": weight}) + "\n")
    return n


def evaluate(workdir: str, source: str | None = None, max_docs: int = 0, max_rows: int = 16,
             text_field: str | None = None) -> list[tuple[str, float]]:
    """[(which model, mean next-token loss)] on `source` (all its documents) or, by default, the run's validation
    documents (data.eval_source, or the held-out share of data.outer_source, or of data.source), their text in
    `text_field` (default: the run's data.text_field). A pretrain run's one model is "model"."""
    run = Run.open(workdir).reading(text_field)
    cfg = run.cfg
    if run.task.model is None:
        raise ConfigError(f"eval: task {cfg.task!r} of {workdir} brings its own model, not a language model; eval "
                          "measures next-token loss (the run's validation loss is in its metrics.jsonl)")
    source = paths.prefixed(source, PATH_SOURCES)
    if source:
        docs = document_source(cfg.data, source)
        ids = np.arange(len(docs))
    elif cfg.data.eval_source:
        docs = document_source(cfg.data, cfg.data.eval_source)
        ids = np.arange(len(docs))
    elif cfg.data.outer_source:
        docs = document_source(cfg.data, cfg.data.outer_source)
        ids = split_ids(len(docs), cfg.data.outer_every, with_outer=False)[2]
    else:
        docs = document_source(cfg.data)
        ids = split_ids(len(docs), cfg.data.outer_every)[2]
    if max_docs:
        ids = ids[:max_docs]
    encode = encoder(cfg.data, run.tokenizer())
    frozen = export_lib.lora_base(cfg, run.model) if run.task.lora is not None else None
    per_example = jax.jit(lambda theta, fr, b: run.task.with_frozen(fr).example_losses(theta, b))
    loss = lambda theta, b: per_example(theta, frozen, b)  # the base weights an argument, not a constant
    if run.kind == PRETRAIN:
        theta_shapes = run.shapes["params"]
        models = [("model", lambda: run.restored("params"))]
    elif run.task.resets_inner:
        theta_shapes = run.shapes["meta"]
        models = [("inner model (fine-tuned)", lambda: run.restored("meta"))]
    elif run.cfg.population.size > 1:  # a population: member 0, as exported
        theta_shapes = population.member(run.shapes["inner"][0])
        models = [("inner model (fine-tuned)", lambda: population.member(run.restored("inner")[0]))]
    else:
        theta_shapes = run.shapes["inner"][0]
        models = [("inner model (fine-tuned)", lambda: run.restored("inner")[0])]
    if run.saved.get("base") is not None:
        models.append(("uniform baseline", lambda: run.restored("base")["inner"][0]))
    if cfg.inner.init_from and run.task.lora is not None:  # fresh adapters (B = 0): the base model itself
        models.append(("starting model", lambda: run.task.init_params(jax.random.key(0))))
    elif cfg.inner.init_from:
        target = on_one_device(theta_shapes)
        models.append(("starting model", lambda: export_lib.load_params(cfg.inner.init_from, target)))
    results = []
    for name, params in models:
        per_doc, counts = _per_document(loss, params(), docs, ids, encode, cfg, max_rows, name)
        ok = counts > 0  # the mean over tokens: each document weighted by its target count
        results.append((name, float(np.sum(per_doc[ok] * counts[ok]) / max(counts[ok].sum(), 1))))
    return results


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf

