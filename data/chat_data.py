"""A small chat data set and a tokenizer with a chat template, made offline from the built-in corpus (`metatrain data
make-chat`): conversations in which the user asks for a Python function and the assistant writes it.

Each function of the standard library's modules that has a docstring and at most `MAX_CHARS` characters gives
one request: "Write a Python function `name(args)`: <the docstring's first line>", answered by the function's
source. A conversation holds one request, or two from the same module (one in three); one in two starts with a
system prompt. Whole modules go to one of three sets, so no set sees another's modules: `train.jsonl` (the pile
to weigh or fine-tune on), `trusted.jsonl` (the outer stream) and `heldout.jsonl` (evaluation). Records are
`{"id", "messages"}`.

`tokenizer/` is a byte-level BPE trained on the training conversations, with ChatML's special tokens and a ChatML
chat template in `tokenizer_config.json`, for models trained from scratch (`data.tokenizer=hf:DIR/tokenizer`). A
pretrained model brings its own tokenizer and template instead. Deterministic for a seed.
"""

from __future__ import annotations

import ast
import json
import os
import random

from metatrain import paths
from metatrain.data.noisy import builtin_sets
from metatrain.errors import ConfigError

FILES = {"train": "train.jsonl", "trusted": "trusted.jsonl", "heldout": "heldout.jsonl"}
MAX_CHARS = 1200
SYSTEM = "You are a concise Python assistant. Answer with code only."
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def requests_of(text: str) -> list[tuple[str, str]]:
    """(request, answer) for each short documented function of a module's source (none if it does not parse)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines, out = text.splitlines(), []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
            continue
        doc = ast.get_docstring(node)
        if not doc or not doc.strip().splitlines()[0].strip() or node.end_lineno is None:
            continue
        indent = node.col_offset  # the def's own indentation, taken off every line of it
        source = lines[node.lineno - 1:node.end_lineno]
        if sum(map(len, source)) > MAX_CHARS or any(line[:indent].strip() for line in source):
            continue
        args = ", ".join(a.arg for a in node.args.args)
        out.append((f"Write a Python function `{node.name}({args})`: {doc.strip().splitlines()[0].strip()}",
                    "\n".join(line[indent:] for line in source).strip()))
    return out


def conversations(requests: list[tuple[str, str]], rng: random.Random) -> list[list[dict]]:
    """One module's requests as conversations: one request each, or two (one in three)."""
    out, k = [], 0
    while k < len(requests):
        turns = 2 if rng.random() < 1 / 3 and k + 1 < len(requests) else 1
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
        for request, answer in requests[k:k + turns]:
            messages += [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]
        out.append(messages)
        k += turns
    return out


def render(messages: list[dict]) -> str:
    """The ChatML text of a conversation (what the template renders)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def write_tokenizer(directory: str, texts: list[str], vocab_size: int) -> None:
    """A byte-level BPE of `vocab_size` tokens trained on `texts`, with ChatML's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    os.makedirs(directory)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "chat_template": CHATML, "model_max_length": 1 << 20}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def make_chat(out: str, seed: int = 0, vocab_size: int = 1024, heldout: float = 0.1, trusted: float = 0.1) -> dict:
    """Write OUT/train.jsonl, OUT/trusted.jsonl, OUT/heldout.jsonl, OUT/tokenizer/ and OUT/manifest.json; returns the
    manifest.

    Args:
      out: a new (or empty) directory.
      seed: the split of modules and the conversations' shapes.
      vocab_size: the tokenizer's vocabulary, special tokens included.
      heldout, trusted: the fractions of the built-in corpus's modules given to each of those sets.

    Returns:
      The manifest: conversations per set, the seed, the files.
    """
    if not 300 <= vocab_size <= 1 << 17:
        raise ConfigError(f"--vocab-size {vocab_size}: give 300 to {1 << 17} tokens")
    rng = random.Random(seed)
    src, sets = builtin_sets(out, rng, heldout, trusted, "data make-chat --out")
    chats = {name: [c for i in ids for c in conversations(requests_of(src[i]), rng)] for name, ids in sets.items()}
    with paths.filled_dir(out):  # an error or a signal leaves nothing behind
        for name, rows in chats.items():
            with open(os.path.join(out, FILES[name]), "w") as f:
                for i, messages in enumerate(rows):
                    f.write(json.dumps({"id": f"{name}-{i:06d}", "messages": messages}) + "\n")
        write_tokenizer(os.path.join(out, "tokenizer"), [render(m) for m in chats["train"]], vocab_size)
        manifest = {"seed": seed, "conversations": {name: len(rows) for name, rows in chats.items()},
                    "files": {**FILES, "tokenizer": "tokenizer/"}, "vocab_size": vocab_size,
                    "source": "documented functions of the built-in corpus's modules, whole modules per set"}
        with open(os.path.join(out, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
    return manifest
