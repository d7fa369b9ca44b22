"""`metatrain generate`: text from a run's model, an export dir or a Hugging Face model dir, with a KV cache."""

from __future__ import annotations

import json
import sys

from metatrain.cli import common


def _model(src: str, what: str | None, tokenizer: str | None):
    """(model config, pure-dict parameters, tokenizer) of SRC."""
    from metatrain import export as export_lib
    from metatrain import hf, paths
    from metatrain.data.tokenizer import HF_PREFIX, load_tokenizer
    from metatrain.errors import ConfigError

    if src.startswith(HF_PREFIX):
        directory = paths.local(src[len(HF_PREFIX):])
        cfg, params = hf.read(directory)
        return cfg, params, load_tokenizer(tokenizer or HF_PREFIX + directory)
    exported = export_lib.read_source(src, what or "inner")
    if exported.model is None or exported.model.head != "lm":
        raise ConfigError(f"generate: {src} holds no language model ({exported.info.get('what')}); give a run, an "
                          "export dir of a model, or hf:DIR")
    if tokenizer is None and exported.info.get("tokenizer_dir"):
        tokenizer = HF_PREFIX + exported.info["tokenizer_dir"]
    if tokenizer is None and exported.run is not None:  # a run's: the tokenizer it trained with
        return exported.model, export_lib._pure(exported.params), exported.run.tokenizer()
    if tokenizer is None:
        raise ConfigError(f"generate: {src} names no tokenizer; give --tokenizer (a tiktoken encoding or hf:DIR)")
    return exported.model, export_lib._pure(exported.params), load_tokenizer(tokenizer)


def _prompts(args) -> list:
    from metatrain.errors import DataError

    if args.prompt is not None:
        return [args.prompt]
    out = []
    from metatrain.data.sources import json_record

    with open(args.prompts, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json_record(line, args.prompts, n)
            value = record.get("messages", record.get("prompt"))
            if not isinstance(value, (str, list)):
                raise DataError(f"{args.prompts}:{n}: give a 'prompt' (text) or 'messages' (a conversation)")
            out.append(value)
    return out


def cmd_generate(args) -> int:
    from metatrain.data.tokenizer import HF_PREFIX
    from metatrain.errors import ConfigError
    from metatrain.generation import generate

    cfg, params, tok = _model(args.src, args.what, args.tokenizer)
    prompts, ids = _prompts(args), []
    for p in prompts:
        if args.chat or isinstance(p, list):
            from metatrain.data import chat

            if not hasattr(tok, "backend"):
                raise ConfigError("generate --chat: a chat template comes with a Hugging Face tokenizer (hf:DIR)")
            messages = p if isinstance(p, list) else [{"role": "user", "content": p}]
            ids.append(chat.encode(messages, HF_PREFIX + tok.directory, add_generation_prompt=True)[0])
        else:
            ids.append([int(t) for t in tok.encode(p, eot=False)])
    out = generate(cfg, params, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                   eos=tok.eot)
    for p, new in zip(prompts, out):
        text = tok.decode([t for t in new if t != tok.eot])
        if args.stop and args.stop in text:
            text = text[:text.index(args.stop)]
        if args.prompts:
            print(json.dumps({"prompt": p, "completion": text, "tokens": len(new)}, ensure_ascii=False))
        else:
            sys.stdout.write(text + "\n")
    return 0


def _at_least_zero(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _top_p(text: str) -> float:
    import argparse

    value = _at_least_zero(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def register(sub) -> None:
    p = sub.add_parser("generate", help="text from a run's model, an export dir or hf:DIR (a KV cache)")
    p.add_argument("src", help="a run's work dir (its inner model), an export dir, or hf:DIR")
    q = p.add_mutually_exclusive_group(required=True)
    q.add_argument("--prompt", help="one prompt (text)")
    q.add_argument("--prompts", metavar="FILE", help="JSON lines, each {\"prompt\": TEXT} or {\"messages\": [...]}; "
                                                     "the output is JSON lines too")
    p.add_argument("--chat", action="store_true", help="render each prompt as a user turn with the chat template")
    p.add_argument("--what", choices=["inner", "baseline"], default=None,
                   help="a run's inner model (default) or its uniform baseline's")
    p.add_argument("--tokenizer", default=None, help="default: the source's (hf:DIR, or the run's encoding)")
    p.add_argument("--max-new-tokens", type=common.positive_int, default=64)
    p.add_argument("--temperature", type=_at_least_zero, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=common.nonnegative_int, default=0, help="0: all tokens")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="in (0, 1]; 1: all tokens")
    p.add_argument("--seed", type=common.nonnegative_int, default=0)
    p.add_argument("--stop", default=None, help="cut each completion at the first occurrence of this text")
    p.set_defaults(fn=cmd_generate)
