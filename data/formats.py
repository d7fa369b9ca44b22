"""What a record holds and how it becomes token ids and a loss mask: plain text, a conversation, or a prompt and
its completion (`data.format`).

    text               {text_field: "..."}: every token is trained on
    chat               {messages_field: [{"role", "content"}, ...]}: rendered by the model's chat template; the
                       assistant's turns are trained on (`data.train_on=all`: every token)
    prompt_completion  {"prompt", "completion"}: two strings (the prompt's tokens, then the completion's and
                       end-of-text; the completion is trained on) or two message lists (one conversation, rendered
                       by the chat template; the completion's assistant turns are trained on)

With `data.format` unset the format is read off a source's first record: `messages_field` holding a list is chat,
`prompt` and `completion` are prompt_completion, `text_field` is text. A source of plain files (builtin, dir:,
tfds:) is text.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from metatrain.data.chat import _template, check, content_text
from metatrain.data.tokenizer import HFTokenizer, Tokenizer
from metatrain.errors import ConfigError, DataError

FORMATS = ("text", "chat", "prompt_completion")
TRAIN_ON = ("assistant", "all")
PAIR = ("prompt", "completion")


@dataclasses.dataclass(frozen=True)
class Fields:
    """Where a record keeps its document: `format` ("" until read off a record) and the field names."""

    format: str = ""
    text_field: str = "text"
    messages_field: str = "messages"

    def detect(self, record: dict, where: str) -> Fields:
        """These fields with the format set: the given one, or the one `record` (a source's first) shows."""
        if self.format:
            return self
        found = [fmt for fmt, present in (
            ("chat", isinstance(record.get(self.messages_field), list)),
            ("prompt_completion", all(f in record for f in PAIR)),
            ("text", isinstance(record.get(self.text_field), str))) if present]
        if len(found) > 1:
            raise DataError(f"{where}: the record could be {' or '.join(found)} (it has the fields "
                            f"{sorted(record)[:8]}); choose with data.format={'|'.join(found)}")
        return dataclasses.replace(self, format=found[0] if found else "text")

    def columns(self) -> list[str]:
        """The fields a document is read from."""
        return {"text": [self.text_field], "chat": [self.messages_field], "prompt_completion": list(PAIR)}[self.format]

    def value(self, record: dict, where: str):
        """The record's document: its text, its messages, or {"prompt", "completion"}; a record that does not hold
        one is refused in one line naming `where` and the field."""
        if self.format == "text":
            return text_of(record, self.text_field, where)
        null = [f for f in self.columns() if f in record and record[f] is None]
        if null:
            raise DataError(f"{where}: field {null[0]!r} is null; data.format={self.format} needs it to hold "
                            + ("a list of messages" if self.format == "chat" else "text or a list of messages"))
        missing = [f for f in self.columns() if record.get(f) is None]
        if missing:
            hint = "name the field with data.messages_field" if self.format == "chat" else "both fields are needed"
            raise DataError(f"{where}: no field {missing[0]!r} (the record has {sorted(record)[:8]}); "
                            f"data.format={self.format}: {hint}")
        if self.format == "chat":
            check(record[self.messages_field], f"{where}: field {self.messages_field!r}")
            return record[self.messages_field]
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return {"prompt": prompt, "completion": completion}
        if isinstance(prompt, list) and isinstance(completion, list):
            check(prompt + completion, f"{where}: fields 'prompt' and 'completion'")
            return {"prompt": prompt, "completion": completion}
        raise DataError(f"{where}: fields 'prompt' and 'completion' must both be text or both message lists, got "
                        f"{type(prompt).__name__} and {type(completion).__name__}")


def preview(doc) -> str:
    """A document as one line of text (for reports): the text, or each message as `role: content`, whitespace
    collapsed."""
    if isinstance(doc, dict):
        doc = [*_as_messages(doc["prompt"], "user"), *_as_messages(doc["completion"], "assistant")]
    if isinstance(doc, list):
        doc = " | ".join(f"{m['role']}: {content_text(m['content'])}" for m in doc)
    return " ".join(str(doc).split())


def _as_messages(part, role: str) -> list[dict]:
    return part if isinstance(part, list) else [{"role": role, "content": part}]


def text_of(record: dict, field: str, where: str) -> str:
    if field not in record:
        raise DataError(f"{where}: no field {field!r} (the record has {sorted(record)[:8]}); name the text field "
                        f"with data.text_field (--text-field in scores, eval, filter and data stats), or set "
                        f"data.format for conversations")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} is {type(text).__name__}, not text")
    return text


class Encoder:
    """Documents → (token ids, loss mask): two int32 arrays of the same length; the mask marks the tokens trained
    on. A document is what a source gives: text, a message list (chat) or {"prompt", "completion"}.

    Args:
      tokenizer: a `Tokenizer` or `HFTokenizer` (conversations need the latter: its directory holds the template).
      train_on: `assistant` (the assistant's turns, or the completion) or `all` (every token).
      chat_template: a template file that replaces the model's.
      messages_field: the messages' field, for messages.
      tokenizer_setting: how the user set the tokenizer, as an error names it (`--tokenizer ` for a command's flag).
    """

    def __init__(self, tokenizer: Tokenizer | HFTokenizer, train_on: str = "assistant", chat_template: str = "",
                 messages_field: str = "messages", tokenizer_setting: str = "data.tokenizer="):
        self.tokenizer, self.train_on, self.messages_field = tokenizer, train_on, messages_field
        self.tokenizer_setting = tokenizer_setting
        self.chat_template, self.template = chat_template, None

    def _chat(self, format: str):
        if self.template is None:
            directory = getattr(self.tokenizer, "directory", None)
            if directory is None:
                raise ConfigError(f"data.format={format}: conversations are rendered by the model's chat template, "
                                  f"which a tiktoken encoding has none of; give {self.tokenizer_setting}hf:DIR (a "
                                  "model dir with tokenizer.json and a chat template): a run trained with a tiktoken "
                                  "encoding reads text only")
            self.template = _template(os.path.abspath(directory), self.chat_template)
        return self.template

    def __call__(self, doc, where: str = "") -> tuple[np.ndarray, np.ndarray]:
        if isinstance(doc, str):
            ids = self.tokenizer.encode(doc, where=where)
            return ids, np.ones(len(ids), np.int32)
        if isinstance(doc, dict) and isinstance(doc["prompt"], str):
            prompt = self.tokenizer.encode(doc["prompt"], eot=False, where=where)
            completion = self.tokenizer.encode(doc["completion"], where=where)
            mask = np.concatenate([np.full(len(prompt), self.train_on == "all"), np.ones(len(completion))])
            return np.concatenate([prompt, completion]).astype(np.int32), mask.astype(np.int32)
        format = "chat" if isinstance(doc, list) else "prompt_completion"
        messages, skip = (doc, 0) if format == "chat" else (
            doc["prompt"] + doc["completion"], sum(m["role"] == "assistant" for m in doc["prompt"]))
        ids, mask = self._chat(format).encode(messages, where=where, skip_turns=skip)
        if self.train_on == "all":
            mask = [1] * len(ids)
        elif not any(mask):
            field = self.messages_field if format == "chat" else "completion"
            raise DataError(f"{where or 'a conversation'}: field {field!r}: no assistant turn to train on "
                            "(data.train_on=assistant); add one, or set data.train_on=all")
        return np.asarray(ids, np.int32), np.asarray(mask, np.int32)
