"""Data for the README's "Your own data" example, and its check.

    python examples/own_data.py make DIR         # DIR/inner.jsonl (30% word-shuffled), trusted.jsonl, truth.jsonl
    python examples/own_data.py auc DIR SCORES   # ROC AUC of -score for the corrupted documents of inner.jsonl
    python examples/own_data.py load HF_DIR      # the exported model in transformers (the `hf` extra), vs metatrain's

The documents are 600-character pieces of the Python standard library's modules (on every machine, no
download): a stand-in for a user's pile of documents. The trusted set is clean pieces of other modules.
"""

from __future__ import annotations

import glob
import json
import os
import random
import sys
import sysconfig


def make(out: str, n_inner: int = 2000, n_trusted: int = 300, corrupted: float = 0.3, seed: int = 0) -> None:
    rng = random.Random(seed)
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    rng.shuffle(files)
    pieces = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        pieces += [(path, text[k:k + 600]) for k in range(0, min(len(text), 6000), 600) if len(text[k:k + 600]) > 300]
    split = int(len(files) * 0.8)  # the trusted set comes from modules the inner documents never show
    inner_files = set(files[:split])
    inner = [p for f, p in pieces if f in inner_files][:n_inner]
    trusted = [p for f, p in pieces if f not in inner_files][:n_trusted]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "inner.jsonl"), "w") as f, open(os.path.join(out, "truth.jsonl"), "w") as t:
        for i, text in enumerate(inner):
            bad = rng.random() < corrupted
            if bad:  # word order destroyed within the document
                words = text.split()
                rng.shuffle(words)
                text = " ".join(words)
            f.write(json.dumps({"id": f"doc-{i:05d}", "text": text}) + "\n")
            t.write(json.dumps({"id": f"doc-{i:05d}", "corrupted": bad}) + "\n")
    with open(os.path.join(out, "trusted.jsonl"), "w") as f:
        for text in trusted:
            f.write(json.dumps({"text": text}) + "\n")
    print(f"wrote {out}/inner.jsonl ({len(inner)} documents), trusted.jsonl ({len(trusted)}), truth.jsonl")


def auc(out: str, scores_path: str) -> float:
    """P(−score of a corrupted document > −score of a clean one), ties counted half."""
    with open(os.path.join(out, "truth.jsonl")) as f:
        truth = {r["id"]: r["corrupted"] for r in map(json.loads, f)}
    with open(scores_path) as f:
        rows = [r for r in map(json.loads, f) if r["score"] is not None]
    bad = [-r["score"] for r in rows if truth[r["id"]]]
    good = [-r["score"] for r in rows if not truth[r["id"]]]
    wins = sum((b > g) + 0.5 * (b == g) for b in bad for g in good)
    return wins / (len(bad) * len(good))


def load(directory: str) -> float:
    """Loads an exported Hugging Face dir with transformers and returns the largest logit difference from
    metatrain's own model of the same dir on a few token ids."""
    import numpy as np
    import torch
    import transformers

    from metatrain import hf

    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    tokens = np.arange(2 * 24).reshape(2, 24) % model.config.vocab_size
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens)).logits.numpy()
    ours = np.asarray(hf.load(directory)(tokens))
    print(f"transformers loaded {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters); "
          f"max |logits - metatrain's| = {np.abs(theirs - ours).max():.1e}")
    return float(np.abs(theirs - ours).max())


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "auc":
        print(f"corrupted documents' ROC AUC of -score: {auc(sys.argv[2], sys.argv[3]):.3f}")
    elif len(sys.argv) == 3 and sys.argv[1] == "load":
        load(sys.argv[2])
    else:
        sys.exit(__doc__)
