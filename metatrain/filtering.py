"""`metatrain filter`: curated data out of a loss-weighting run: drop a fraction ρ of a corpus by the run's scores.

Two rules (DataRater, Calian et al. 2025):

- `topk`: documents in groups of G = B/(1−ρ), drawn at random (a seeded permutation within windows of the input
  order), keep the best B of each group: exactly B per full group (the last, partial group keeps its share,
  rounded);
- `p_accept`: keep each document independently with probability P_accept(p) = Σ_{s<K} C(B−1, s) (1−p)^s
  p^(B−1−s), K = B(1−ρ), where p is the document's place in the scores' empirical CDF: the chance it would be
  in the top K of a batch of B. A fractional K interpolates between ⌊K⌋ and ⌈K⌉, so the kept fraction's
  expectation is 1−ρ exactly. The coin of each document comes from a hash of the seed and its key.

Three passes over the input, each streamed (memory is bounded whatever the corpus size): score every document
(written to a scores file of 24 bytes per document under OUT/.parts), decide (the CDF from the scores, or a
sample of at most `cdf_sample` of them), write the kept records unchanged (JSONL lines as read, Parquet rows of
the same schema). Across processes (the multi-host start-up of `train`), process k scores and writes its share
(`data.records.share`) as OUT/part-0000k.*; the decisions depend on document keys and global positions only, so
they are the same whatever the number of processes; process 0 writes OUT/manifest.json. OUT must be one
directory every process sees (a shared file system).

Stopped by Ctrl-C or SIGTERM once documents are scored (or killed outright), a filter leaves OUT holding only
OUT/.parts: the same command, run again, scores only the documents after those and finishes. Anything else there
(other documents, another checkpoint, other settings) starts again; an error takes OUT away.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time

import numpy as np

from metatrain import distributed, paths, progress
from metatrain.data import pipeline, records
from metatrain.errors import ConfigError, DataError
from metatrain.run import Run

METHODS = ("topk", "p_accept")
SCORE_DTYPE = np.dtype([("file", "<i4"), ("offset", "<i8"), ("score", "<f8"), ("tokens", "<i4")])
WINDOW_GROUPS = 64  # topk: groups are drawn within windows of this many groups of the input order
RESUME = "resume.json"  # in OUT/.parts: what the scores there are of (`_scores_key`)
DECIDE_CHUNK = 1 << 20  # documents decided at a time (whole topk windows)
QUANTILES = (0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


# ---- the rules ---------------------------------------------------------------------------------
def p_accept(p: np.ndarray, batch: int, drop: float) -> np.ndarray:
    """P(a document at CDF position p is among the top K = batch·(1−drop) of a batch of `batch`): fewer than K of
    the other batch−1 score higher, each with probability 1−p; ⌊K⌋ and ⌈K⌉ interpolated."""
    from scipy.stats import binom

    k = batch * (1 - drop)
    lo = math.floor(k)
    below = lambda kk: binom.cdf(kk - 1, batch - 1, 1 - p) if kk > 0 else np.zeros_like(p)
    return below(lo) + (k - lo) * (below(lo + 1) - below(lo))


def cdf_positions(scores: np.ndarray, sample: np.ndarray) -> np.ndarray:
    """Each score's place in the sample's empirical CDF: the fraction of the sample below it, ties counted half.
    A NaN score (a document without a token to predict) is at 0: dropped first."""
    lo = np.searchsorted(sample, scores, side="left")
    hi = np.searchsorted(sample, scores, side="right")
    return np.where(np.isnan(scores), 0.0, (lo + hi) / (2 * len(sample)))


def uniforms(seed: int, file: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """A uniform [0, 1) number per document key, from a splitmix64 hash of (seed, file, offset)."""
    with np.errstate(over="ignore"):
        x = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + file.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
             + offset.astype(np.uint64))
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            x = (x ^ (x >> np.uint64(shift))) * np.uint64(mult)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def topk_keep(scores: np.ndarray, start: int, batch: int, drop: float, seed: int, total: int) -> np.ndarray:
    """topk's decisions for the documents at global positions [start, start + len(scores)), which must be whole
    windows (or end at `total`): each window's documents permuted (seeded by the window's number), cut into
    groups of G = round(batch / (1 − drop)), the best `batch` of each kept (a NaN score is lowest; ties: the
    earlier document); a last, partial group keeps round(its size · batch / G)."""
    group = round(batch / (1 - drop))
    window = group * WINDOW_GROUPS
    keep = np.zeros(len(scores), bool)
    for w0 in range(0, len(scores), window):
        n = min(window, len(scores) - w0)
        order = w0 + np.random.default_rng([seed, (start + w0) // window]).permutation(n)
        full = n // group * group
        for members, k in ((order[:full].reshape(-1, group), batch),
                           (order[full:].reshape(1, -1), round((n - full) * batch / group))):
            if members.size == 0 or k == 0:
                continue
            s = np.nan_to_num(scores[members], nan=-np.inf)
            best = np.lexsort((members, -s), axis=-1)[:, :k]  # by score, descending; then by position
            keep[np.take_along_axis(members, best, axis=-1).ravel()] = True
    return keep


# ---- the passes --------------------------------------------------------------------------------
def _score_pass(run, kind, files, mine, fields, out_path, score_batch, max_rows, show) -> tuple[int, int, int]:
    """Score the share's documents in order; append (file, offset, score, tokens) records to `out_path`, after the
    whole records an interrupted filter left there (those documents are not scored again). Returns (documents,
    tokens), those included, and how many documents were scored before."""
    from metatrain.data.pipeline import encoder
    from metatrain.scores import compiled_scorer, score_stream

    encode = encoder(run.cfg.data, run.tokenizer())
    meta = run.restored("meta")
    fn = compiled_scorer(run.task.scores, meta, run.cfg.data.seq_len, score_batch, "lower --score-batch (rows per "
                         "scoring call)")
    saved = _saved_scores(out_path)
    docs, tokens = len(saved), int(saved["tokens"].sum(dtype=np.int64))
    last = (int(saved["file"][-1]), int(saved["offset"][-1])) if docs else None
    new = new_tokens = 0  # scored in this run
    tic = time.perf_counter()
    unit = "B" if kind == "jsonl" else " docs"
    bar = progress.bar(mine.size, "scoring", disable=not show, unit=unit, unit_scale=kind == "jsonl")
    items = records.after(records.read(kind, files, mine, fields), docs, last, os.path.dirname(out_path),
                          on_skip=lambda where: bar.update(where - bar.n))
    with paths.naming(out_path), open(out_path, "ab") as f, bar:
        buffer = []
        try:
            for rec, n_tokens, score, where in score_stream(fn, meta, items, encode, run.cfg.data.seq_len,
                                                            score_batch, max_rows):
                buffer.append((rec.file, rec.offset, score, n_tokens))
                docs, tokens, new, new_tokens = docs + 1, tokens + n_tokens, new + 1, new_tokens + n_tokens
                if len(buffer) >= 4096:
                    f.write(np.asarray(buffer, SCORE_DTYPE).tobytes())
                    buffer.clear()
                    seconds = max(time.perf_counter() - tic, 1e-9)
                    rate = f"{new_tokens / seconds:,.0f} tokens/s"  # documents/s: the bar's own rate for Parquet
                    bar.set_postfix_str(f"{new / seconds:,.0f} docs/s, {rate}" if kind == "jsonl" else rate,
                                        refresh=False)
                bar.update(where - bar.n)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what was scored is kept for the next run
            if buffer:
                f.write(np.asarray(buffer, SCORE_DTYPE).tobytes())
            raise
        if buffer:
            f.write(np.asarray(buffer, SCORE_DTYPE).tobytes())
        bar.update(mine.size - bar.n)
    return docs, tokens, docs - new


def _saved_scores(path: str) -> np.ndarray:
    """The whole (file, offset, score, tokens) records of a scores file (memory-mapped; none if there is no file);
    a last record cut short (a kill mid-write) is cut off the file."""
    size = os.path.getsize(path) if os.path.exists(path) else 0
    whole = size // SCORE_DTYPE.itemsize * SCORE_DTYPE.itemsize
    if whole < size:
        os.truncate(path, whole)
    return np.memmap(path, SCORE_DTYPE, mode="r") if whole else np.zeros(0, SCORE_DTYPE)


class AllScores:
    """The scores files of every process, read as one array in input order (memory-mapped, a slice at a time)."""

    def __init__(self, paths_: list[str]):
        self.parts = [np.memmap(p, SCORE_DTYPE, mode="r") if os.path.getsize(p) else np.zeros(0, SCORE_DTYPE)
                      for p in paths_]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        self.total = int(self.starts[-1])

    def slice(self, a: int, b: int) -> np.ndarray:
        out = []
        for k, part in enumerate(self.parts):
            lo, hi = max(a, self.starts[k]), min(b, self.starts[k + 1])
            if lo < hi:
                out.append(np.asarray(part[lo - self.starts[k]:hi - self.starts[k]]))
        return np.concatenate(out) if out else np.zeros(0, SCORE_DTYPE)

    def chunks(self, size: int = 1 << 20):
        for a in range(0, self.total, size):
            yield self.slice(a, min(a + size, self.total))

    def sample(self, limit: int, seed: int) -> np.ndarray:
        """The sorted finite scores of every document, or of a hash-chosen subset of about `limit` of them."""
        rate = min(1.0, limit / max(self.total, 1))
        picked = []
        for chunk in self.chunks():
            s = chunk["score"]
            keep = np.isfinite(s)
            if rate < 1:
                keep &= uniforms(seed + 1, chunk["file"], chunk["offset"]) < rate
            picked.append(s[keep])
        return np.sort(np.concatenate(picked)) if picked else np.zeros(0)


def _decide(all_scores: AllScores, a: int, b: int, method: str, drop: float, batch: int, seed: int,
            sample: np.ndarray | None) -> np.ndarray:
    """Keep decisions for the documents at global positions [a, b)."""
    if method == "p_accept":
        mine = all_scores.slice(a, b)
        prob = p_accept(cdf_positions(mine["score"], sample), batch, drop)
        return uniforms(seed, mine["file"], mine["offset"]) < prob
    window = round(batch / (1 - drop)) * WINDOW_GROUPS
    w_a, w_b = a // window * window, min(-(-b // window) * window, all_scores.total)
    scores = all_scores.slice(w_a, w_b)["score"]
    return topk_keep(scores, w_a, batch, drop, seed, all_scores.total)[a - w_a:b - w_a]


def _write_pass(kind, files, mine, keep: np.ndarray, out: str, part: int, fields) -> str | None:
    """Write the share's kept records unchanged to OUT/part-0000k.jsonl|parquet (`keep`: a decision per record of
    the share, in order); returns the file's name."""
    name = f"part-{part:05d}.{kind}"
    path = os.path.join(out, name)
    if kind == "jsonl":
        with paths.naming(path), open(path, "wb") as f:
            for i, (rec, _) in enumerate(records.read(kind, files, mine, fields)):
                if keep[i]:
                    f.write(rec.raw if rec.raw.endswith(b"\n") else rec.raw + b"\n")
        return name
    import pyarrow.parquet as pq

    writer, i = None, 0
    with paths.naming(path):
        try:
            for k, g in mine.spans:
                table = pq.ParquetFile(files[k]).read_row_group(g)
                take = np.flatnonzero(keep[i:i + table.num_rows])
                i += table.num_rows
                if len(take):
                    writer = writer or pq.ParquetWriter(path, table.schema)
                    writer.write_table(table.take(take))
        finally:
            if writer is not None:
                writer.close()
    return name


def filter_corpus(workdir: str, source: str, out: str, drop: float, method: str = "topk", batch: int = 256,
                  seed: int = 0, cdf_sample: int = 1_000_000, score_batch: int = 64, max_rows: int = 4,
                  text_field: str | None = None) -> dict:
    """Keep 1−`drop` of the documents of `source` by the run's scores; write them and OUT/manifest.json.

    Args:
      workdir: a loss-weighting run's work dir (its final η scores the documents).
      source: `jsonl:PATH_OR_GLOB` or `parquet:PATH_OR_GLOB`.
      out: the output directory; it must not exist.
      drop: ρ, the fraction to drop, in (0, 1).
      method: `topk` or `p_accept`.
      batch: B: topk keeps B of every B/(1−ρ); p_accept's batch size.
      seed: the topk groups' and p_accept's coins.
      cdf_sample: p_accept: the CDF from all scores up to this many documents, else from about this many.
      score_batch: rows per jitted scoring call.
      max_rows: a document is scored by its first this many rows of seq_len+1 tokens.
      text_field: the field (JSONL) or column (Parquet) of the documents' text; None: the run's data.text_field.

    Returns:
      The manifest (on every process; process 0 writes it).
    """
    import jax

    if not 0 < drop < 1:
        raise ConfigError(f"--drop {drop}: the fraction to drop must be in (0, 1), e.g. 0.3")
    if method not in METHODS:
        raise ConfigError(f"--method {method!r}: choose one of {METHODS}")
    if batch < 2:
        raise ConfigError(f"--batch {batch}: must be >= 2")
    if method == "topk" and round(batch / (1 - drop)) <= batch:
        raise ConfigError(f"--batch {batch} with --drop {drop}: a group of round(B/(1−ρ)) = {round(batch / (1 - drop))}"
                          " drops nothing; raise --batch")
    source = paths.prefixed(source, tuple(records.FORMATS))
    kind, pattern = records.input_format(source)
    run = Run.open(workdir).meta_training().reading(text_field)
    if not hasattr(run.task, "scores"):
        raise ConfigError(f"{workdir} is a {run.cfg.task!r} run: filtering needs a loss-weighting run's scores "
                          "(task=loss_weighting)")
    files = records.files(kind, pattern)
    out = paths.local(out)
    staging = os.path.join(out, ".parts")
    part, parts = jax.process_index(), jax.process_count()
    main = part == 0
    key = _scores_key(run, kind, files, score_batch, max_rows, parts)
    # an interrupted filter leaves OUT holding only its staging: its scores are gone on with when they are of the
    # same documents, run and settings (Ctrl-C, SIGTERM, also SIGKILL or a lost machine), else it starts again
    stranded = os.path.isdir(out) and os.listdir(out) == [".parts"]
    made = stranded or not os.path.exists(out)
    if not stranded:  # filter never writes over earlier output
        paths.output(out, "filter --out", directory=True, inputs=[*files, os.path.join(run.workdir, "config.yaml")])
    records.check_not_empty(kind, files, source)
    distributed.barrier("filter:checked")  # every process has checked OUT before process 0 makes it
    tic = time.perf_counter()
    try:  # from the making of OUT on: a signal at any point (the barrier below starts JAX) takes it away
        if main:
            if stranded and _kept_key(staging) == key:
                for name in os.listdir(staging):  # all but the scores (the counts and decisions are made again)
                    if not name.startswith("scores-") and name != RESUME:
                        paths.remove(os.path.join(staging, name))
                n = _scored(staging, parts)
                print(f"filter: going on in {out} from the {n:,} documents an interrupted filter scored",
                      file=sys.stderr)
            else:
                if stranded:
                    print(f"filter: starting again in {out}, which an interrupted filter left unfinished (its scores"
                          " are of other documents, another run or other settings)", file=sys.stderr)
                    shutil.rmtree(staging)
                os.makedirs(staging)
                paths.write_json(os.path.join(staging, RESUME), key)
        distributed.barrier("filter:made")
        mine = records.share(kind, files, part, parts)
        score_file = os.path.join(staging, f"scores-{part:05d}.bin")
        docs, tokens, before = _score_pass(run, kind, files, mine, pipeline.fields(run.cfg.data), score_file,
                                           score_batch, max_rows, show=main)
        paths.write_json(os.path.join(staging, f"count-{part:05d}.json"),
                         {"documents": docs, "tokens": tokens, "scored_before": before})
        distributed.barrier("filter:scored")
        all_scores = AllScores([os.path.join(staging, f"scores-{k:05d}.bin") for k in range(parts)])
        if all_scores.total == 0:
            raise DataError(f"--data {source}: no documents")
        sample = all_scores.sample(cdf_sample, seed)
        if not len(sample):
            raise DataError(f"--data {source}: none of the {all_scores.total:,} documents has a token to predict")
        a, b = int(all_scores.starts[part]), int(all_scores.starts[part + 1])
        keep = np.memmap(os.path.join(staging, f"keep-{part:05d}.bin"), bool, mode="w+", shape=(max(b - a, 1),))
        kept_docs = kept_tokens = 0
        chunk = round(batch / (1 - drop)) * WINDOW_GROUPS * max(1, DECIDE_CHUNK // (round(batch / (1 - drop))
                                                                                   * WINDOW_GROUPS))
        for lo in range(a, b, chunk):  # whole topk windows at a time, bounded memory
            hi = min(lo + chunk, b)
            decided = _decide(all_scores, lo, hi, method, drop, batch, seed, sample if method == "p_accept" else None)
            keep[lo - a:hi - a] = decided
            kept_docs += int(decided.sum())
            kept_tokens += int(all_scores.slice(lo, hi)["tokens"][decided].sum())
        keep.flush()
        name = _write_pass(kind, files, mine, keep, out, part, pipeline.fields(run.cfg.data)) if kept_docs else None
        paths.write_json(os.path.join(staging, f"kept-{part:05d}.json"),
                    {"documents": kept_docs, "tokens": kept_tokens, "output": name})
        distributed.barrier("filter:written")
        manifest = _manifest(run, workdir, source, kind, method, drop, batch, seed, staging, parts, sample,
                             cdf_sample, time.perf_counter() - tic)
        distributed.barrier("filter:read")
        if main:
            paths.write_json(os.path.join(out, "manifest.json"), manifest)
            shutil.rmtree(staging)
        return manifest
    except BaseException as e:  # an error, Ctrl-C or SIGTERM (`metatrain.cli` raises it as a KeyboardInterrupt)
        if main and isinstance(e, KeyboardInterrupt) and _keep_scores(out, staging, parts):
            raise
        if main:  # nothing half-written is left behind: OUT goes, or what went into a folder the user made
            for name in os.listdir(out) if os.path.isdir(out) and not made else []:
                paths.remove(os.path.join(out, name))
            if made:
                shutil.rmtree(out, ignore_errors=True)
        raise


def _scores_key(run, kind, files, score_batch, max_rows, parts) -> dict:
    """What a filter's scores are of: the run's checkpoint, the input's files as they are now (size and time of last
    change), the settings that change a score and how the documents are shared between processes."""
    return {"workdir": os.path.realpath(run.workdir), "step": run.step, "format": kind,
            "files": records.fingerprint(files),
            "text_field": run.cfg.data.text_field, "score_batch": score_batch, "max_rows": max_rows,
            "processes": parts}


def _kept_key(staging: str) -> dict | None:
    """What the scores kept in `staging` are of (`_scores_key`); None where none is written or it is unreadable."""
    try:
        return paths.read_json(os.path.join(staging, RESUME), "filter's resume file")
    except (OSError, DataError):
        return None


def _scored(staging: str, parts: int) -> int:
    """The whole records in every process's scores file (read, not cut: another process may be writing its own)."""
    size = lambda k: os.path.getsize(p) if os.path.exists(p := os.path.join(staging, f"scores-{k:05d}.bin")) else 0
    return sum(size(k) // SCORE_DTYPE.itemsize for k in range(parts))


def _keep_scores(out: str, staging: str, parts: int) -> bool:
    """After Ctrl-C or SIGTERM: when documents were scored, OUT is left holding only its staging, whose scores the
    same command goes on from (said on stderr); else nothing is kept."""
    n = _scored(staging, parts)
    if not n or not os.path.exists(os.path.join(staging, RESUME)):
        return False
    for name in os.listdir(out):
        if name != ".parts":
            paths.remove(os.path.join(out, name))
    print(f"filter: the scores of the {n:,} documents scored so far are kept in {staging}: the same command goes on "
          f"from them (or remove {out})", file=sys.stderr)
    return True


def _manifest(run, workdir, source, kind, method, drop, batch, seed, staging, parts, sample, cdf_sample,
              seconds) -> dict:
    read = lambda name: [paths.read_json(os.path.join(staging, f"{name}-{k:05d}.json"), "filter's count")
                         for k in range(parts)]
    counts, kept = read("count"), read("kept")
    n_in, n_kept = sum(c["documents"] for c in counts), sum(c["documents"] for c in kept)
    before = sum(c["scored_before"] for c in counts)  # by an interrupted filter into OUT
    t_in, t_kept = sum(c["tokens"] for c in counts), sum(c["tokens"] for c in kept)
    if method == "topk":
        group = round(batch / (1 - drop))
        rule = {"method": "topk", "group": group, "keep_per_group": batch,
                "description": f"documents in groups of {group} drawn at random (windows of {WINDOW_GROUPS} "
                               f"groups of the input order), the best {batch} of each kept"}
    else:
        rule = {"method": "p_accept", "batch": batch, "k": batch * (1 - drop), "cdf_documents": int(len(sample)),
                "cdf": "all scores" if len(sample) < cdf_sample else f"a hash sample of about {cdf_sample}",
                "description": "keep with probability P(fewer than K of batch-1 others score higher), p = the "
                               "document's place in the scores' empirical CDF"}
    return {"run": paths.local(workdir), "step": run.step, "input": source, "format": kind,
            "text_field": run.cfg.data.text_field, "drop": drop,
            "seed": seed, "rule": rule, "documents": {"in": n_in, "kept": n_kept, "kept_fraction": n_kept / n_in},
            "tokens": {"in": t_in, "kept": t_kept},
            "score_quantiles": {str(q): float(np.quantile(sample, q)) for q in QUANTILES},
            "outputs": [k["output"] for k in kept if k["output"]], "processes": parts, "seconds": seconds,
            "documents_scored_before": before, "documents_per_second": (n_in - before) / max(seconds, 1e-9)}
