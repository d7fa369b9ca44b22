"""Conversations as token ids and an assistant mask, rendered by the model's own chat template.

The template (`chat_template` in `tokenizer_config.json`, or `chat_template.jinja` beside it, or a file given) is
rendered with jinja2 as transformers' `apply_chat_template` renders it: a sandboxed environment with
`trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now` and a `tojson` that does not
escape HTML, the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables. The text is then
tokenized without adding special tokens, so the ids are the ones transformers gives.

The assistant mask marks the tokens of the assistant's turns: the `{% generation %}` blocks of a template that
has them, or else, found by rendering prefixes of the conversation, each assistant message's text after the
assistant header (what the conversation before it renders with `add_generation_prompt`) up to the start of the
next turn: its content and end-of-turn token, without the whitespace after them.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime

from metatrain import paths
from metatrain.data.tokenizer import HF_PREFIX, unicode_text
from metatrain.errors import ConfigError, DataError

ROLES = ("system", "user", "assistant", "tool")


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: records where the block's text lands in the output."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

        def _record(self, caller):
            text = caller()
            spans = self.environment.spans
            if spans is not None:
                start = sum(len(b) for b in self.environment.blocks)
                spans.append([start, start + len(text)])
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    env.spans, env.blocks = None, []
    return env


def read_template(directory: str, path: str = "", flag: str = "data.chat_template") -> str:
    """The chat template: `path`'s text when given (its errors name `flag`, the setting that gave it), else the model
    dir's `chat_template.jinja` or `tokenizer_config.json`'s `chat_template`."""
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"{flag}: {path} not found; give a Jinja chat template file")
        return _text(path, f"{flag}: ")
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):
        return _text(jinja)
    config = os.path.join(directory, "tokenizer_config.json")
    template = None
    if os.path.isfile(config):
        with open(config) as f:
            template = json.load(f).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise ConfigError(f"{directory} has no chat template (chat_template.jinja, or chat_template in "
                          "tokenizer_config.json); give a template file: data.chat_template=PATH to train, "
                          "--chat-template PATH to generate or for data stats, chat_template=PATH in chat.encode")
    return template


def _text(path: str, flag: str = "") -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{flag}{path} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); "
                          "save the template as UTF-8") from None


def special_tokens(directory: str) -> dict[str, str]:
    """The tokenizer's special tokens as template variables (`bos_token`, `eos_token`, ...)."""
    config = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(config):
        return {}
    with open(config) as f:
        saved = json.load(f)
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = saved.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


class ChatTemplate:
    """A model dir's chat template and tokenizer.

    Args:
      directory: a Hugging Face model (or tokenizer) dir: tokenizer.json and the template.
      template: a template file that replaces the directory's.
    """

    def __init__(self, directory: str, template: str = ""):
        from tokenizers import Tokenizer

        if not os.path.isfile(os.path.join(directory, "tokenizer.json")):  # before its template, which is beside it
            raise ConfigError(f"tokenizer hf:{directory}: " + ("no such directory" if not os.path.isdir(directory) else
                                                               "no tokenizer.json in it") +
                              "; give a Hugging Face model dir (or a metatrain import dir) holding tokenizer.json")
        self.source = read_template(directory, template)
        self.env = _environment()
        try:
            self.template = self.env.from_string(self.source)
        except Exception as e:  # noqa: BLE001 — jinja2's syntax errors
            raise ConfigError(f"the chat template of {template or directory} cannot be read: "
                              f"{str(e).splitlines()[0]}") from None
        self.variables = special_tokens(directory)
        self.tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        self.marked = "{% generation" in self.source or "{%- generation" in self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = False, where: str = "",
               prefix: bool = False) -> tuple[str, list]:
        """(the text, the [start, end) character spans of the `generation` blocks). `prefix`: the first turns of a
        conversation checked whole (it may be empty: the part before an opening assistant turn)."""
        if not prefix:
            check(messages, where)
        messages = self._as_template_reads(messages, where)
        env = self.env
        env.spans, env.blocks = [], []
        try:
            for block in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **self.variables):
                env.blocks.append(block)
            return "".join(env.blocks), env.spans
        except Exception as e:  # noqa: BLE001 — the template's own errors (raise_exception, a missing field)
            raise DataError(f"{where or 'a conversation'}: the chat template fails to render it: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        finally:
            env.spans, env.blocks = None, []

    def _as_template_reads(self, messages: list[dict], where: str) -> list[dict]:
        """The messages as the template gets them: text parts joined into one text; null content (a tool call)
        only where the template renders `tool_calls`."""
        out = []
        for i, m in enumerate(messages):
            content = m["content"]
            if isinstance(content, list):
                m = dict(m, content=content_text(content))
            elif content is None and "tool_calls" not in self.source:
                raise DataError(f"{where or 'a conversation'}: message {i} has null content (a tool call) and the "
                                "chat template does not render tool_calls; give its content as text, or a "
                                "template that renders tool calls")
            out.append(m)
        return out

    def assistant_spans(self, messages: list[dict], where: str = "") -> tuple[str, list]:
        """(the text, each assistant turn's [start, end) characters)."""
        text, spans = self.render(messages, False, where)
        if self.marked:
            return text, spans
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            head = self.render(messages[:k], True, where, prefix=True)[0]
            turn = self.render(messages[:k + 1], False, where, prefix=True)[0]
            if not (turn.startswith(head) and text.startswith(turn)):
                raise DataError(f"{where or 'a conversation'}: the chat template renders a conversation's start "
                                "differently from the whole, so its assistant turns cannot be found; add "
                                "{% generation %} markers around the assistant's text")
            end = len(turn.rstrip())
            spans.append([len(head), end])
        return text, spans

    def encode(self, messages: list[dict], add_generation_prompt: bool = False, where: str = "",
               skip_turns: int = 0) -> tuple[list[int], list[int]]:
        """(token ids, assistant mask) of a conversation, each a list of the same length; the mask leaves out the
        first `skip_turns` assistant turns (a prompt's, before its completion)."""
        if add_generation_prompt:
            text, spans = self.render(messages, True, where)
            spans = spans if self.marked else []
        else:
            text, spans = self.assistant_spans(messages, where)
        spans = spans[skip_turns:]
        encoding = self.tokenizer.encode(unicode_text(text, where or "a conversation"), add_special_tokens=False)
        mask = [int(any(end > s and start < e for s, e in spans)) for start, end in encoding.offsets]
        return list(encoding.ids), mask


def check(messages, where: str = "") -> None:
    """A conversation is a list of {role, content} with known roles; content is text, a list of text parts
    (`{"type": "text", "text": ...}`, joined), or null beside `tool_calls`. Anything else is refused in one line."""
    where = where or "a conversation"
    if isinstance(messages, dict) and "role" in messages:
        raise DataError(f"{where}: one message, not a conversation; give a list of messages, [{{role, content}}, ...]")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {i} needs a 'role' and a 'content'")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has role {m['role']!r}, not one of {', '.join(ROLES)}")
        content = m["content"]
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise DataError(f"{where}: message {i}, content part {j} is {kind!r}; only text parts "
                                    '({"type": "text", "text": ...}) can be trained on')
        elif content is None:
            if not m.get("tool_calls"):
                raise DataError(f"{where}: message {i} has null content and no tool_calls; give its text")
        elif not isinstance(content, str):
            raise DataError(f"{where}: message {i} has content of type {type(content).__name__}; give text")


def content_text(content) -> str:
    """A message's content as the template gets it: text parts joined into one text (null: empty)."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


@functools.lru_cache(maxsize=8)
def _template(directory: str, template: str = "") -> ChatTemplate:
    return ChatTemplate(directory, template)


def encode(messages: list[dict], tokenizer: str, add_generation_prompt: bool = False,
           chat_template: str = "", where: str = "") -> tuple[list[int], list[int]]:
    """A conversation as the model's chat template renders it: token ids and the assistant mask.

    Args:
      messages: `[{"role": ..., "content": ...}, ...]` (roles system, user, assistant, tool).
      tokenizer: `hf:DIR`, a model dir with tokenizer.json and a chat template.
      add_generation_prompt: end with the assistant's header, for generation (the mask is then the template's
        `generation` blocks only, where it has them).
      chat_template: a template file that replaces the model's.
      where: how errors name the conversation (e.g. `FILE:LINE`).

    Returns:
      (ids, assistant_mask): two lists of the same length; 1 marks the assistant's tokens.
    """
    if not tokenizer.startswith(HF_PREFIX):
        raise ConfigError(f"tokenizer {tokenizer!r}: chat needs a model's tokenizer and template, hf:DIR")
    directory = paths.local(tokenizer[len(HF_PREFIX):])
    messages = list(messages) if isinstance(messages, tuple) else messages
    return _template(directory, chat_template).encode(messages, add_generation_prompt, where)
