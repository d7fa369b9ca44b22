"""`metatrain generate`: text from a run's model, an export dir or a Hugging Face model dir, with a KV cache."""

from __future__ import annotations

import json
import os
import sys

from metatrain import argtypes, stops
from metatrain.cli import common

PROMPT_LINE = '{"prompt": TEXT} or {"messages": [...]}'  # a line of a --prompts file


def _model(src: str, what: str | None, tokenizer: str | None):
    """(model config, pure-dict parameters, tokenizer, chat template file, context length or None) of SRC."""
    from metatrain import export as export_lib
    from metatrain import hf, paths
    from metatrain.data.tokenizer import HF_PREFIX, load_tokenizer
    from metatrain.errors import ConfigError

    if src.startswith(HF_PREFIX):
        directory = paths.local(src[len(HF_PREFIX):])
        cfg, params = hf.read(directory)
        context = paths.read_json(os.path.join(directory, "config.json"), "config.json").get("max_position_embeddings")
        return cfg, params, load_tokenizer(tokenizer or HF_PREFIX + directory), "", context
    exported = export_lib.read_source(src, what or "inner", command="generate")
    info = exported.info
    if info.get("lora") is not None:  # `export --adapters`: the adapters alone, without the base they adapt
        raise ConfigError(f"{src} holds LoRA adapters alone (export --adapters); give the run they came from, or "
                          "its merged model (metatrain export RUN --what inner --out DIR)")
    if exported.model is None or exported.model.head != "lm":
        raise ConfigError(f"{src} holds no language model ({info.get('what')}); give a run, an "
                          "export dir of a model, or hf:DIR")
    context = (info.get("hf_config") or {}).get("max_position_embeddings")
    template = exported.run.cfg.data.chat_template if exported.run is not None else ""
    params = export_lib._pure(exported.params)
    if tokenizer is None and info.get("tokenizer_dir"):
        tokenizer = HF_PREFIX + info["tokenizer_dir"]
    if tokenizer is None and exported.run is not None:  # a run's: the tokenizer it trained with
        return exported.model, params, exported.run.tokenizer(), template, context
    if tokenizer is None and info.get("tokenizer"):  # an export of a tiktoken run: the encoding it named
        tokenizer = info["tokenizer"]
    if tokenizer is None:
        raise ConfigError(f"generate: {src} names no tokenizer; give --tokenizer (a tiktoken encoding or hf:DIR)")
    # the run's encoding, cut to the vocabulary it trained with; any other at its own
    vocab = info.get("tokenizer_vocab_size") if tokenizer == info.get("tokenizer") else None
    return exported.model, params, load_tokenizer(tokenizer, vocab), template, context


def _prompts(args) -> list[tuple[str | list, str]]:
    """(a prompt: text or messages, where it came from) of --prompt or each line of --prompts."""
    from metatrain import paths
    from metatrain.data.corpus import refuse_non_utf8
    from metatrain.data.sources import json_record
    from metatrain.errors import ConfigError, DataError

    if args.prompt is not None:  # (never empty: the parser refuses '', `argtypes.given`)
        return [(args.prompt, "--prompt")]
    path = paths.local(args.prompts)
    if not os.path.isfile(path):
        raise ConfigError(f"generate --prompts: {path} " + ("is a directory" if os.path.isdir(path) else
                                                            "not found") + "; give a JSON lines file")
    refuse_non_utf8(path, "generate --prompts")
    out = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json_record(line, path, n)
            except DataError as e:  # a plain text line: say what a line must be
                raise DataError(f"{e}; --prompts takes one JSON object per line, {PROMPT_LINE}") from None
            value = record.get("messages", record.get("prompt"))
            if not isinstance(value, (str, list)) or not value:
                raise DataError(f"{path}:{n}: give a non-empty 'prompt' (text) or 'messages' (a conversation)")
            out.append((value, f"{path}:{n}"))
    if not out:
        raise ConfigError(f"generate --prompts: {path} holds no prompts; write one JSON line per prompt, {PROMPT_LINE}")
    return out


def _encode(prompts, tok, args, template: str) -> list[list[int]]:
    from metatrain.data import chat
    from metatrain.data.tokenizer import HF_PREFIX
    from metatrain.errors import ConfigError

    ids = []
    for p, where in prompts:
        if args.chat or isinstance(p, list):
            if not hasattr(tok, "backend"):
                raise ConfigError("generate --chat: a chat template comes with a Hugging Face tokenizer (hf:DIR)")
            messages = p if isinstance(p, list) else [{"role": "user", "content": p}]
            ids.append(chat.encode(messages, HF_PREFIX + tok.directory, add_generation_prompt=True,
                                   chat_template=template, where=where)[0])
        else:
            ids.append([int(t) for t in tok.encode(p, eot=False, where=where)])
        if not ids[-1]:
            raise ConfigError(f"generate: the prompt of {where} encodes to no token; give some text")
    return ids


def _check_sizes(cfg, ids: list[list[int]], args, context: int | None) -> None:
    """Token ids within the model's vocabulary; prompt + new tokens within its context; the KV cache in memory."""
    import jax

    from metatrain import aot
    from metatrain.errors import ConfigError
    from metatrain.models import decode

    high = max(max(x) for x in ids)
    if high >= cfg.vocab_size:
        raise ConfigError(f"generate: the tokenizer gives id {high}, beyond the model's vocabulary of "
                          f"{cfg.vocab_size}; give the tokenizer the model was trained with (--tokenizer)")
    longest = max(len(x) for x in ids)
    if context and longest + args.max_new_tokens > context:
        raise ConfigError(f"generate --max-new-tokens {args.max_new_tokens}: with a prompt of {longest} tokens that "
                          f"passes the model's context of {context} (max_position_embeddings); give at most "
                          f"{max(context - longest, 0)}")
    need, have = decode.cache_bytes(cfg, len(ids), longest + args.max_new_tokens), aot.memory_here(jax.devices()[0])
    if have and need > have // 2:
        raise ConfigError(f"generate --max-new-tokens {args.max_new_tokens}: the KV cache for {len(ids)} prompt(s) "
                          f"of up to {longest} + {args.max_new_tokens} tokens needs {need / 2**30:.1f} GiB, more than "
                          f"half the {have / 2**30:.1f} GiB free here; ask for fewer new tokens or fewer prompts")


def cmd_generate(args) -> int:
    from metatrain import paths
    from metatrain.data import chat
    from metatrain.generation import model as model_of
    from metatrain.models import decode

    cfg, params, tok, template, context = _model(args.src, args.what, args.tokenizer)
    if args.chat_template:  # the given template, over a run's data.chat_template and the tokenizer's
        template = paths.local(args.chat_template)
        chat.read_template("", template, flag="generate --chat-template")  # a missing or non-UTF-8 file, named
    prompts = _prompts(args)
    ids = _encode(prompts, tok, args, template)
    _check_sizes(cfg, ids, args, context)
    eos = list(tok.eos_ids)
    out, stopped = [[] for _ in ids], []
    screen = _Screen(args.stop) if not args.prompts and sys.stdout.isatty() else None  # one prompt, on a terminal
    # Ctrl-C / SIGTERM / SIGHUP are noted and acted on between two compiled calls (a KeyboardInterrupt raised inside
    # JAX's dispatch can leave a computation in flight as the interpreter exits)
    with stops.caught(lambda signum, _: stopped.append(signum)):
        for so_far in decode.stream(model_of(cfg, params), ids, args.max_new_tokens, args.temperature, args.top_k,
                                    args.top_p, args.seed, eos=eos):
            out = so_far
            if stopped:
                break
            texts = [tok.decode([t for t in new if t not in eos]) for new in so_far] if screen or args.stop else []
            if screen is not None:
                screen.show(texts[0])
            if args.stop and all(args.stop in text for text in texts):  # every completion is cut: no more to print
                break
    for (p, _), new in zip(prompts, out):
        text = tok.decode([t for t in new if t not in eos])
        if args.stop and args.stop in text:
            text = text[:text.index(args.stop)]
        if args.prompts:
            print(json.dumps({"prompt": p, "completion": text, "tokens": len(new)}, ensure_ascii=False))
        elif screen is not None:
            screen.finish(text)
        else:
            sys.stdout.write(text + "\n")
    if stopped:  # what was generated is printed; the command line says what stopped it
        sys.stdout.flush()
        interrupt = KeyboardInterrupt()
        interrupt.signum = stopped[0]
        raise interrupt
    return 0


class _Screen:
    """One completion written to a terminal as it is decoded: the text so far, less what may still change (a
    character whose bytes are not all decoded yet, the start of the --stop text)."""

    def __init__(self, stop: str):
        self.stop, self.shown = stop, ""

    def show(self, text: str) -> None:
        if self.stop and self.stop in text:
            text = text[:text.index(self.stop)]
        elif self.stop:
            text = text[:max(len(text) - len(self.stop) + 1, 0)]
        text = text.rstrip("\ufffd")  # a character cut between two tokens
        if text.startswith(self.shown) and len(text) > len(self.shown):
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text

    def finish(self, text: str) -> None:
        """The whole completion: what is not shown yet, or all of it on a line of its own where the decoded text
        changed under what was shown."""
        sys.stdout.write((text[len(self.shown):] if text.startswith(self.shown) else "\n" + text) + "\n")


def _top_p(text: str) -> float:
    import argparse

    value = argtypes.number(float, 0, 1, "in (0, 1]")(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def register(sub) -> None:
    p = sub.add_parser("generate", help="text from a run's model, an export dir or hf:DIR (a KV cache)")
    p.add_argument("src", metavar="SRC", help="a run's work dir (its inner model), an export dir, or hf:DIR")
    q = p.add_mutually_exclusive_group(required=True)
    q.add_argument("--prompt", help="one prompt (text); on a terminal the completion shows as it is decoded")
    q.add_argument("--prompts", metavar="FILE", help="JSON lines, each {\"prompt\": TEXT} or {\"messages\": [...]}; "
                                                     "the output is JSON lines too")
    p.add_argument("--chat", action="store_true", help="render each prompt as a user turn with the chat template (a "
                                                       "run's data.chat_template, else the tokenizer's)")
    p.add_argument("--chat-template", metavar="FILE", default="",
                   help="a Jinja chat template file (default: a run's data.chat_template, else the tokenizer's)")
    p.add_argument("--what", choices=["inner", "baseline"], default=None,
                   help="a run's inner model (default) or its uniform baseline's")
    p.add_argument("--tokenizer", default=None, help="default: the source's (hf:DIR, or the run's encoding)")
    p.add_argument("--max-new-tokens", type=common.positive_int, default=64)
    p.add_argument("--temperature", type=argtypes.number(float, 0, sys.float_info.max, "a finite number >= 0"),
                   default=0.0,
                   help="0: greedy (default)")
    p.add_argument("--top-k", type=common.nonnegative_int, default=0, help="0 (or above the vocabulary): all tokens")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="in (0, 1]; 1: all tokens")
    p.add_argument("--seed", type=common.nonnegative_int, default=0)
    p.add_argument("--stop", default=None, help="cut each completion at the first occurrence of this text; decoding "
                   "ends once every completion holds it")
    p.set_defaults(fn=cmd_generate)
