"""Grain next-token pipelines: an inner (train) and an outer (validation) stream over disjoint documents.

documents → [this process's shard] → shuffle(seed), repeat → encode (text: tokens + end-of-text;
conversations: the chat template's tokens and a loss mask on the assistant's, see `formats`; optionally
corrupt a fraction of inner documents) → concatenate-then-split into rows of seq_len+1 (with segment
ids, positions and the loss mask, so attention never crosses documents) → batch. The inner stream yields
`[T, batch, seq_len+1]` per outer step, the outer stream `[batch, seq_len+1]` (batch = per process).

With `data.outer_source` (a trusted set) the outer stream and the validation set come from it instead, and
every document of `data.source` but its held-out share feeds the inner stream. Each example carries `doc`, the
index of the document that gave it most tokens, so learned weights map back to documents.

The documents are split into `data.shards` logical shards (default: one per process), each with its
own pipeline; a process reads a contiguous run of them and the global batch is the shards' rows in
shard order. With `data.shards` fixed, 1 process and N processes see exactly the same global batches.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from metatrain import hostmem
from metatrain.data.formats import FORMATS, TRAIN_ON, Encoder, Fields
from metatrain.data.shuffle import EpochShuffleMapDataset
from metatrain.data.sources import Tfds, missing_path, open_source
from metatrain.data.tokenizer import DEFAULT_ENCODING, Tokenizer, load_tokenizer
from metatrain.errors import ConfigError, DataError

SEQ_FEATURES = ("tokens", "loss_mask", "corrupted", "doc")
DEVICE_FEATURES = ("tokens", "segment_ids", "positions", "corrupted")  # what the outer step reads; not `doc`
MASKED = ("chat", "prompt_completion")  # formats whose loss mask is not all ones: the step reads `loss_mask` too


SOURCE_FIELDS = ("source", "outer_source", "eval_source")  # DataConfig's fields naming a source


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "builtin"  # builtin | tfds:NAME | jsonl:PATH | parquet:PATH | dir:PATH | hf-disk:PATH (see sources)
    outer_source: str = ""  # a trusted set for the outer (validation) loss; default: 1 in outer_every of `source`
    eval_source: str = ""  # a clean set every evaluation reads in full; default: the validation share (see outer_every)
    format: str = ""  # text | chat | prompt_completion (see formats); "" = read off each source's first record
    text_field: str = "text"  # jsonl / parquet / hf-disk: the field holding a document's text
    messages_field: str = "messages"  # ... and a conversation's messages (format chat)
    chat_template: str = ""  # a Jinja chat template file; default: the tokenizer's (chat_template in hf:DIR)
    train_on: str = "assistant"  # chat, prompt_completion: the loss on the assistant's tokens only, or on all
    id_field: str = "id"  # ... and its id (when absent: the line or row number)
    data_dir: str | None = None  # TFDS data dir (default: TFDS's own); may be a gs:// path
    split: str = "train"  # the TFDS split, or a saved DatasetDict's split (hf-disk:)
    tokenizer: str = DEFAULT_ENCODING  # a tiktoken encoding name, or hf:DIR (a tokenizer.json through `tokenizers`)
    vocab_size: int | None = 8192  # tiktoken: keep the N-1 lowest BPE ranks + end-of-text (0 or null: all); not for hf:
    seq_len: int = 128  # tokens per packed row (rows hold seq_len + 1 tokens)
    batch: int = 16  # global: split across processes
    inner_steps: int = 2  # T: inner steps per outer step
    outer_every: int = 10  # 1 in k documents feeds the outer stream, 1 in k is held out for evaluation
    shuffle_window: int = 2048  # packed rows are shuffled within windows of this many rows
    corrupt_fraction: float = 0.0  # of inner documents: tokens shuffled within the document
    seed: int = 0  # shuffling and corruption
    shards: int = 0  # logical data shards; 0 = one per process. Fix it to make batches independent of hosts

    def __post_init__(self):
        for name in ("seq_len", "batch", "inner_steps", "shuffle_window"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"data.{name} must be > 0, got {getattr(self, name)}")
        if self.seed < 0:  # Grain shuffles with seeds 0 to 2^32 - 1 (each window's: data.seed + its number)
            raise ConfigError(f"data.seed must be >= 0, got {self.seed}")
        if self.shards < 0:
            raise ConfigError(f"data.shards must be >= 0 (0 = one per process), got {self.shards}")
        if self.outer_every < 2:
            raise ConfigError(f"data.outer_every must be >= 2 (1 in k documents is held out), got {self.outer_every}")
        if self.format not in ("", *FORMATS):
            raise ConfigError(f"data.format must be one of {', '.join(FORMATS)} (or unset: read off the records), "
                              f"got {self.format!r}")
        if self.train_on not in TRAIN_ON:
            raise ConfigError(f"data.train_on must be one of {', '.join(TRAIN_ON)}, got {self.train_on!r}")
        if not 0.0 <= self.corrupt_fraction < 1.0:
            raise ConfigError(f"data.corrupt_fraction must be in [0, 1), got {self.corrupt_fraction}")
        for name in SOURCE_FIELDS:
            if why := missing_path(getattr(self, name)):
                raise ConfigError(f"data.{name}: {why}")


def device_features(cfg: DataConfig) -> tuple[str, ...]:
    """The batch fields the outer step reads: DEVICE_FEATURES, and `loss_mask` for conversations."""
    return DEVICE_FEATURES + ("loss_mask",) * (cfg.format in MASKED)


class Subset:
    """Documents at the given ids of a random-access source; yields (global id, text)."""

    def __init__(self, source, ids: Sequence[int]):
        self.source, self.ids = source, np.asarray(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        doc = int(self.ids[i])
        return doc, self.source[doc]


def document_source(cfg: DataConfig, spec: str | None = None):
    """The random-access documents of `data.source` (or of `spec`, e.g. `data.outer_source`): see `sources`."""
    return open_source(cfg.source if spec is None else spec, split=cfg.split, data_dir=cfg.data_dir,
                       text_field=cfg.text_field, id_field=cfg.id_field, format=cfg.format,
                       messages_field=cfg.messages_field)


def fields(cfg: DataConfig) -> Fields:
    """Where the records keep their documents: `data.format` and the field names."""
    return Fields(cfg.format, cfg.text_field, cfg.messages_field)


def encoder(cfg: DataConfig, tok: Tokenizer, tokenizer_setting: str = "data.tokenizer=") -> Encoder:
    """Documents → (token ids, loss mask), as `data.train_on`, `data.chat_template` and `data.messages_field` say
    (`tokenizer_setting`: how the user set `cfg.tokenizer`, as an error names it)."""
    return Encoder(tok, cfg.train_on, cfg.chat_template, cfg.messages_field, tokenizer_setting)


def split_ids(n_docs: int, outer_every: int, with_outer: bool = True,
              name: str = "the corpus") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inner, outer and test document ids: document i is outer when i % k == 0 (only `with_outer`), test when
    i % k == k // 2 (k = outer_every), inner otherwise. Disjoint by construction; test documents are seen by
    no training."""
    if n_docs < outer_every:
        raise DataError(f"{name} has {n_docs} documents; at least {outer_every} are needed to hold one out "
                        f"(data.outer_every={outer_every}; lower it for a small source)")
    ids = np.arange(n_docs)
    outer, test = (ids % outer_every == 0) & with_outer, ids % outer_every == outer_every // 2
    return ids[~outer & ~test], ids[outer], ids[test]


def where(docs, i: int) -> str:
    """Document i of `docs` named for a message: its file and line or row (a plain sequence: its index)."""
    return docs.where(i) if hasattr(docs, "where") else f"document {i}"


def _encoder(docs, encode: Encoder, corrupt_fraction: float, seed: int):
    def encode_doc(item):
        doc, value = item
        tokens, mask = encode(value, where(docs, doc))
        rng = np.random.default_rng([seed, doc])
        corrupted = corrupt_fraction > 0 and rng.random() < corrupt_fraction
        if corrupted:  # same tokens, order destroyed: only a model that reads order can tell
            if isinstance(value, str):
                tokens[:-1] = rng.permutation(tokens[:-1])
            else:  # the trained-on tokens (the assistant's) among themselves
                at = np.flatnonzero(mask)
                tokens[at] = rng.permutation(tokens[at])
        return {"tokens": tokens, "loss_mask": mask, "corrupted": np.full(tokens.shape, corrupted, np.int32),
                "doc": np.full(tokens.shape, doc, np.int32)}

    return encode_doc


def main_doc(docs: np.ndarray) -> int:
    """The document contributing most tokens to a packed row (`docs`: each token's document index)."""
    values, counts = np.unique(docs, return_counts=True)
    return int(values[counts.argmax()])


def _finish(row: dict) -> dict:
    trained = row["loss_mask"] * (row["tokens_segment_ids"] > 0)  # the row's tokens the loss reads
    return {"tokens": row["tokens"], "segment_ids": row["tokens_segment_ids"],
            "positions": row["tokens_positions"], "loss_mask": row["loss_mask"],
            # per example: most of the tokens trained on come from corrupted documents
            "corrupted": np.int32((row["corrupted"] * trained).sum() > 0.5 * max(trained.sum(), 1)),
            "doc": np.int32(main_doc(row["doc"]))}  # per example: an index into the source


def stream(docs, ids, encode: Encoder, *, seq_len: int, batch: int, seed: int, corrupt_fraction: float = 0.0,
           process_index: int = 0, process_count: int = 1, shuffle_window: int = 2048) -> grain.IterDataset:
    """Packed, batched rows [batch, seq_len+1] from this process's shard of the documents `ids`.

    Packing a long document gives many consecutive rows of it; the window shuffle after packing mixes
    rows of many documents into each batch (per-example weighting needs mixed batches)."""
    ds = grain.MapDataset.source(Subset(docs, ids))[process_index::process_count]
    # documents already on this machine are read and tokenised on the calling thread: grain's default 16 reader
    # threads and 500-element read-ahead per stream only contend for the GIL here (grain's own advice); TFDS
    # sources, possibly remote, keep a few reader threads
    threads = 4 if isinstance(docs, Tfds) else 0
    read = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=64 if threads else 1)
    ds = EpochShuffleMapDataset(ds, seed).repeat()  # grain's ds.shuffle(seed).repeat(), a whole epoch at a time
    ds = ds.map(_encoder(docs, encode, corrupt_fraction, seed)).to_iter_dataset(read)
    ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={f: seq_len + 1 for f in SEQ_FEATURES})
    if shuffle_window > 1:
        ds = grain.experimental.WindowShuffleIterDataset(ds, window_size=shuffle_window, seed=seed)
    return ds.map(_finish).batch(batch, drop_remainder=True)


def _json_safe_state(state):
    """Grain's concat-then-split state holds (start, stop) tuples that it compares with `==` to a tuple;
    after a JSON round trip they are lists and restore goes wrong. Turn them back into tuples."""
    if isinstance(state, dict):
        return {k: ({f: tuple(sl) for f, sl in v.items()} if k == "remainder_slices" else _json_safe_state(v))
                for k, v in state.items()}
    if isinstance(state, list):
        return [_json_safe_state(x) for x in state]
    return state


class _Checkpointable:
    """What `grain.checkpoint` handlers save and restore: this process's iterators' states as JSON bytes."""

    def __init__(self, iterators):
        self.iterators = iterators

    def get_state(self) -> bytes:
        return json.dumps([it.get_state() for it in self.iterators]).encode()

    def set_state(self, state: bytes) -> None:
        states = json.loads(state)
        if len(states) != len(self.iterators):
            raise ConfigError(f"data.shards: the checkpoint holds {len(states)} data shard(s) for this process, the "
                              f"run has {len(self.iterators)}: resume with the data.shards and process count it was "
                              f"saved with")
        for it, st in zip(self.iterators, states):
            it.set_state(_json_safe_state(st))

    def start_prefetch(self) -> None:
        pass


def _check_fills_a_batch(name: str, docs, ids, encode: Encoder, cfg: DataConfig, n_shards: int, say: bool) -> None:
    """Packing repeats a stream's documents forever: refuse documents with nothing to train on, and (`say`) warn
    when one shard's documents do not fill one batch (batch / shards rows of seq_len+1 tokens), since every batch
    then repeats the same text. Encoding the first documents also finds a bad record or chat template here."""
    need = cfg.batch // n_shards * (cfg.seq_len + 1)
    have = trained = 0
    for i in ids:
        doc = docs[int(i)]
        tokens, mask = encode(doc, where(docs, int(i)))
        # text: the end-of-text token packing adds is not text
        have, trained = have + len(tokens), trained + int(mask.sum()) - isinstance(doc, str)
        if have >= need and trained:
            return
    if not trained:  # packing would spin on end-of-text tokens alone
        raise DataError(f"the {name} stream's {len(ids)} document(s) per data shard hold no text (every document is "
                        "empty); check data.text_field and the source's records")
    if say:
        # the window shuffle after packing fills its window of rows before the first batch: from a few documents,
        # by reading them thousands of times (each pass a few milliseconds), which looks like a hang
        reads = cfg.shuffle_window * (cfg.seq_len + 1) / have if cfg.shuffle_window > 1 else 0
        window = (f", and filling the shuffle window of {cfg.shuffle_window} rows reads them about {reads:,.0f} times "
                  f"before the first batch" if reads >= 1000 else "")
        print(f"metatrain: warning: the {name} stream's {len(ids)} document(s) per data shard hold {have:,} tokens, "
              f"fewer than one batch ({cfg.batch // n_shards} rows x {cfg.seq_len + 1} = {need:,} tokens): every "
              f"batch repeats them{window}; add documents or lower data.batch / data.seq_len"
              f"{' / data.shuffle_window' if window else ''}", file=sys.stderr)


# a shuffle window's bytes per token of its packed rows, at least: their six int32 features (about 50 measured, with
# numpy's and grain's overheads)
WINDOW_BYTES_PER_TOKEN = 24


def _check_windows_fit(cfg: DataConfig, streams: int) -> None:
    """Each stream fills its shuffle window (`data.shuffle_window` packed rows, held in memory) before its first
    batch: refused (one line) where the least those of `streams` streams hold passes the memory available here, which
    was a long wait for the first batch, then the process killed for memory."""
    need = streams * cfg.shuffle_window * (cfg.seq_len + 1) * WINDOW_BYTES_PER_TOKEN if cfg.shuffle_window > 1 else 0
    have = hostmem.available()
    if have is not None and need > have:
        raise ConfigError(f"data.shuffle_window: {streams} shuffle windows of {cfg.shuffle_window:,} rows of "
                          f"{cfg.seq_len + 1:,} tokens (the inner, outer and validation streams of each data shard) "
                          f"hold at least {hostmem.size(need)}, more than the {hostmem.size(have)} available on this "
                          f"machine; lower data.shuffle_window")


def _concat(batches: list[dict], axis: int) -> dict:
    if len(batches) == 1:
        return batches[0]
    return {k: np.concatenate([b[k] for b in batches], axis) for k in batches[0]}


class Streams:
    """The inner and outer streams of one process (its run of logical shards), with checkpointable state."""

    def __init__(self, cfg: DataConfig, process_index: int | None = None, process_count: int | None = None):
        if process_index is None or process_count is None:
            shard = grain.sharding.ShardByJaxProcess()  # this process's place in a multi-host job
            process_index, process_count = shard.shard_index, shard.shard_count
        n_shards = cfg.shards or process_count
        if n_shards % process_count:
            raise ConfigError(f"data.shards={n_shards} does not split over {process_count} processes; "
                             f"use a multiple of {process_count}")
        if cfg.batch % n_shards:
            raise ConfigError(f"data.batch={cfg.batch} is not divisible by the {n_shards} data shards (one per "
                             f"process unless data.shards is set); use a multiple of {n_shards}")
        _check_windows_fit(cfg, streams=3 * (n_shards // process_count))  # inner, outer, validation per shard
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.tokenizer, cfg.vocab_size)
        self.docs = docs = document_source(cfg)
        trusted = document_source(cfg, cfg.outer_source) if cfg.outer_source else None
        inner_ids, outer_ids, self.held_out_ids = split_ids(len(docs), cfg.outer_every, with_outer=trusted is None,
                                                            name=f"data.source {cfg.source!r}")
        if trusted is None:  # the outer stream and the validation set are shares of the one source
            self.trusted, self.validation_ids = docs, self.held_out_ids
        else:  # a trusted set: 1 in k of it is held out for validation, the rest feeds the outer stream
            self.trusted = trusted
            outer_ids, _, self.validation_ids = split_ids(len(trusted), cfg.outer_every, with_outer=False,
                                                          name=f"data.outer_source {cfg.outer_source!r}")
        if cfg.eval_source:  # evaluation reads all of its own set
            self.eval_docs = document_source(cfg, cfg.eval_source)
            self.validation_ids = np.arange(len(self.eval_docs))
        else:
            self.eval_docs = self.trusted
        if cfg.chat_template and self.format not in MASKED:  # it was read by nothing, without a word
            raise ConfigError(f"data.chat_template: the records of data.source={cfg.source} are plain text, and a chat "
                              f"template renders conversations or prompt and completion records; drop it, or give "
                              f"such records")
        self.encode = encoder(cfg, self.tokenizer)
        outer_name = cfg.outer_source or cfg.source
        for name, ids, source in (("inner", inner_ids, cfg.source), ("outer", outer_ids, outer_name),
                                  ("held-out", self.held_out_ids, cfg.source),
                                  ("validation", self.validation_ids, cfg.eval_source or outer_name)):
            if len(ids) < n_shards:
                raise DataError(f"data source {source!r}: its {name} share has {len(ids)} document(s), fewer than "
                                f"the {n_shards} data shards; add documents or lower data.outer_every")
        per = n_shards // process_count
        self._shards = range(process_index * per, (process_index + 1) * per)
        self._common = dict(seq_len=cfg.seq_len, batch=cfg.batch // n_shards, process_count=n_shards,
                            shuffle_window=cfg.shuffle_window)
        for name, source, ids in (("inner", docs, inner_ids), ("outer", self.trusted, outer_ids),
                                  ("validation", self.eval_docs, self.validation_ids)):
            _check_fills_a_batch(name, source, ids[::n_shards], self.encode, cfg, n_shards,
                                 process_index == 0)
        self.inner = [iter(stream(docs, inner_ids, self.encode, seed=cfg.seed,
                                  corrupt_fraction=cfg.corrupt_fraction, process_index=k,
                                  **self._common).batch(cfg.inner_steps)) for k in self._shards]
        self.outer = [iter(stream(self.trusted, outer_ids, self.encode, seed=cfg.seed + 1,
                                  process_index=k, **self._common)) for k in self._shards]

    @property
    def format(self) -> str:
        """The sources' format: `text` when every one is text, else the first conversation format among them (the
        step then reads each batch's `loss_mask`)."""
        formats = [d.fields.format for d in (self.docs, self.trusted, self.eval_docs)]
        return next((f for f in formats if f in MASKED), "text")

    def next(self) -> tuple[dict, dict]:
        """(inner batches [T, batch, seq+1], outer batch [batch, seq+1]) for one outer step; `doc` holds each
        example's document index (`self.docs.doc_id(i)` is the user's id)."""
        return _concat([next(it) for it in self.inner], 1), _concat([next(it) for it in self.outer], 0)

    def test_batches(self, n: int, corrupt_fraction: float = 0.0, seed: int = 12345,
                     of: str = "validation") -> Iterator[dict]:
        """Up to `n` batches [batch, seq+1] of documents never in either stream, the same every call, made as they
        are asked for: `validation` (the trusted set's held-out share, or the source's) or `held_out` (the inner
        source's held-out share: the same as validation without an outer or evaluation source); `data.eval_source`,
        when given, is the validation set, all of it."""
        docs, ids = (self.eval_docs, self.validation_ids) if of == "validation" else (self.docs, self.held_out_ids)
        its = [iter(stream(docs, ids, self.encode, seed=seed, corrupt_fraction=corrupt_fraction,
                           process_index=k, **self._common)) for k in self._shards]
        for _ in range(n):
            yield _concat([next(it) for it in its], 0)

    def get_state(self) -> dict[str, Any]:
        return {"inner": [it.get_state() for it in self.inner], "outer": [it.get_state() for it in self.outer]}

    def set_state(self, state: dict[str, Any]) -> None:
        for name in ("inner", "outer"):
            _Checkpointable(getattr(self, name)).set_state(json.dumps(state[name]).encode())

    def save_args(self) -> dict:
        """Orbax composite-args entries that save both streams (one JSON file per process)."""
        return {"inner_data": grain.checkpoint.CheckpointSave(_Checkpointable(self.inner)),
                "outer_data": grain.checkpoint.CheckpointSave(_Checkpointable(self.outer))}

    def restore_args(self) -> dict:
        """Orbax composite-args entries that restore both streams in place."""
        return {"inner_data": grain.checkpoint.CheckpointRestore(_Checkpointable(self.inner)),
                "outer_data": grain.checkpoint.CheckpointRestore(_Checkpointable(self.outer))}


def to_global(batch: dict, sharding, keys: Sequence[str] | None = None) -> dict:
    """Per-process numpy batch → global `jax.Array`s with `sharding` (a NamedSharding over the batch axis);
    only `keys` when given (the outer step reads DEVICE_FEATURES)."""
    import jax

    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()
            if keys is None or k in keys}
