"""A noisy corpus with labelled, realistic defects, for curation experiments (`metatrain data make-noisy`).

The built-in corpus is cut into pieces of 600 to 1,500 characters. Whole source documents go to one of three
sets, so no set sees another's documents: a clean held-out evaluation set, a clean trusted set (the outer
stream of meta-training) and the training pool. In the pool a fraction `rate` of the pieces gets one defect,
the kinds in equal shares (`KINDS`), the kinds DataRater's low scores caught:

- `mojibake`: UTF-8 read as Latin-1 and replacement characters in place of some characters;
- `ocr`: OCR-like character noise (confusable letters and digits, dropped and doubled characters);
- `whitespace`: runs of spaces, tabs and blank lines;
- `blob`: most of the text replaced by base64 or hex key material;
- `caps`: the whole text in capitals;
- `boilerplate`: a cookie / licence / navigation template with a few fields changed;
- `near_duplicate`: another training piece with a few words changed;
- `truncated`: cut to its first 5 to 15%, mid-word;
- `shuffled`: the words in random order.

Every record has an `id`, its `text` and a `defect` label (`none` for clean pieces); training reads only the
text, the label is for reports. Deterministic for a seed.
"""

from __future__ import annotations

import base64
import json
import os
import random

from metatrain import paths
from metatrain.errors import ConfigError

KINDS = ("mojibake", "ocr", "whitespace", "blob", "caps", "boilerplate", "near_duplicate", "truncated", "shuffled")
FILES = {"train": "train.jsonl", "trusted": "trusted.jsonl", "heldout": "heldout.jsonl"}
OCR = {"l": "1", "1": "l", "O": "0", "0": "O", "e": "c", "m": "rn", "S": "5", "a": "o", "i": "í", "t": "f"}
MOJIBAKE = ("â€™", "â€œ", "â€\x9d", "Ã©", "Ã¨", "Ã¼", "Â", "\ufffd", "\ufffd\ufffd")
BOILERPLATE = ("We use cookies to improve your experience. By continuing to browse {site} you agree to our use of "
               "cookies. Accept all | Manage preferences | Privacy policy\nHome > {section} > {page}\nCopyright (c) "
               "{year} {site}. All rights reserved. Terms of use. Contact us. Subscribe to our newsletter for the "
               "latest {section} news.\nShare: Facebook Twitter LinkedIn Email Print\nPage {n} of {m}  Next >")


def pieces_of(text: str, rng: random.Random) -> list[str]:
    """The text cut into consecutive pieces of 600 to 1,500 characters (a last, shorter remainder dropped)."""
    out, k = [], 0
    while True:
        length = rng.randint(600, 1500)
        if k + length > len(text):
            return out
        out.append(text[k:k + length])
        k += length


def defect(kind: str, text: str, rng: random.Random, pool: list[str]) -> str:
    """`text` with one defect of `kind` (`pool`: clean training pieces, for near-duplicates)."""
    if kind == "mojibake":
        chars = list(text.encode("utf-8").decode("latin-1"))
        for i in rng.sample(range(len(chars)), max(1, len(chars) // 12)):
            chars[i] = rng.choice(MOJIBAKE)
        return "".join(chars)
    if kind == "ocr":
        out = []
        for c in text:
            r = rng.random()
            if r < 0.12 and c in OCR:
                out.append(OCR[c])
            elif r < 0.15:
                continue  # dropped
            elif r < 0.18:
                out.append(c + c)  # doubled
            else:
                out.append(c)
        return "".join(out)
    if kind == "whitespace":
        words = text.split(" ")
        for i in rng.sample(range(len(words)), max(1, len(words) // 4)):
            words[i] += rng.choice([" " * rng.randint(8, 40), "\t" * rng.randint(3, 12), "\n" * rng.randint(4, 12)])
        return " ".join(words)
    if kind == "blob":
        keep = text[:rng.randint(40, 120)]
        raw = rng.randbytes(rng.randint(600, 1200))
        blob = (base64.b64encode(raw).decode() if rng.random() < 0.5 else
                "\n".join(raw[i:i + 32].hex() for i in range(0, len(raw), 32)))
        return keep + "\n-----BEGIN KEY-----\n" + blob + "\n-----END KEY-----\n"
    if kind == "caps":
        return text.upper()
    if kind == "boilerplate":
        fields = {"site": rng.choice(["example.com", "news-portal.net", "shop.example.org", "the-daily.info"]),
                  "section": rng.choice(["Technology", "Sports", "Finance", "Lifestyle", "Science"]),
                  "page": rng.choice(["Article", "Gallery", "Archive", "Index"]), "year": rng.randint(2005, 2024),
                  "n": rng.randint(1, 9), "m": rng.randint(10, 40)}
        return "\n".join([BOILERPLATE.format(**fields)] * rng.randint(1, 3))
    if kind == "near_duplicate":
        words = rng.choice(pool).split(" ")
        for i in rng.sample(range(len(words)), max(1, len(words) // 50)):
            words[i] = rng.choice(["the", "a", "data", "value", "x"])
        return " ".join(words)
    if kind == "truncated":
        return text[:max(10, int(len(text) * rng.uniform(0.05, 0.15)))]
    if kind == "shuffled":
        words = text.split()
        rng.shuffle(words)
        return " ".join(words)
    raise ValueError(f"unknown defect kind {kind!r}")


def builtin_sets(out: str, rng: random.Random, heldout: float, trusted: float, flag: str = "--out"
                 ) -> tuple[object, dict]:
    """(the built-in corpus, its documents' indices split into held-out, trusted and training sets at random), once
    `out` is known to be a new or empty directory (`paths.output`; `flag` names it in errors)."""
    from metatrain.data.sources import open_source

    paths.output(out, flag, directory=True)
    src = open_source("builtin")
    docs = list(range(len(src)))
    rng.shuffle(docs)
    n_held, n_trusted = int(len(docs) * heldout), int(len(docs) * trusted)
    return src, {"heldout": docs[:n_held], "trusted": docs[n_held:n_held + n_trusted],
                 "train": docs[n_held + n_trusted:]}


def make_noisy(out: str, rate: float = 0.3, seed: int = 0, heldout: float = 0.1, trusted: float = 0.1) -> dict:
    """Write OUT/train.jsonl (a fraction `rate` defective, labelled), OUT/trusted.jsonl, OUT/heldout.jsonl (clean)
    and OUT/manifest.json; returns the manifest.

    Args:
      out: a new (or empty) directory.
      rate: the fraction of training pieces with a defect, in [0, 1), split equally over `KINDS`.
      seed: the split, the defects and their places.
      heldout, trusted: the fractions of the built-in corpus's documents given to each clean set.

    Returns:
      The manifest: counts per set and per defect kind, the rate, the seed, the files.
    """
    if not 0 <= rate < 1:
        raise ConfigError(f"--rate {rate}: the fraction of defective documents must be in [0, 1)")
    rng = random.Random(seed)
    src, sets = builtin_sets(out, rng, heldout, trusted, "data make-noisy --out")
    pieces = {name: [p for i in ids for p in pieces_of(src[i], rng)] for name, ids in sets.items()}
    train = pieces["train"]
    labels = ["none"] * len(train)
    bad = rng.sample(range(len(train)), round(rate * len(train)))
    for k, i in enumerate(bad):
        labels[i] = KINDS[k % len(KINDS)]
    clean = [t for t, label in zip(train, labels) if label == "none"] or train
    texts = [t if label == "none" else defect(label, t, rng, clean) for t, label in zip(train, labels)]
    counts = {}
    with paths.filled_dir(out):  # an error or a signal leaves nothing behind
        for name, rows in (("train", list(zip(texts, labels))), ("trusted", [(t, "none") for t in pieces["trusted"]]),
                           ("heldout", [(t, "none") for t in pieces["heldout"]])):
            with open(os.path.join(out, FILES[name]), "w") as f:
                for i, (text, label) in enumerate(rows):
                    f.write(json.dumps({"id": f"{name}-{i:06d}", "text": text, "defect": label}) + "\n")
            counts[name] = len(rows)
        manifest = {"seed": seed, "rate": rate, "documents": counts,
                    "defects": {kind: labels.count(kind) for kind in KINDS}, "files": FILES,
                    "source": "the built-in corpus, cut into pieces of 600 to 1,500 characters; whole source "
                              "documents per set"}
        with open(os.path.join(out, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
    return manifest
