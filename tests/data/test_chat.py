"""Chat templates: metatrain's token ids and assistant masks against transformers' apply_chat_template, for a
ChatML-style and a Llama-3-style template (and ChatML with {% generation %} markers)."""

import json
import random

import pytest

from metatrain.data import chat
from metatrain.errors import ConfigError, DataError

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_MARKED = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
                 "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
                 "{% endgeneration %}{{ '\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
SPECIAL = {"chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
           "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                      "<|eot_id|>"]}
END = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}
WORDS = "the quick brown fox jumps over a lazy dog; what is two plus two? four, said the model. résumé".split()


def _tokenizer(directory, kind: str, template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [" ".join(random.Random(i).choices(WORDS + ["system", "user", "assistant", "\n"], k=30)) for i in range(200)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL[kind],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos, eos = (SPECIAL[kind][0], SPECIAL[kind][1]) if kind == "llama3" else (None, "<|im_end|>")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                         chat_template=template).save_pretrained(directory)
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def _conversations(n: int = 20):
    rng = random.Random(0)
    out = []
    for i in range(n):
        turns = 1 + i % 4
        messages = [{"role": "system", "content": "be brief."}] if i % 2 else []
        for t in range(turns):
            messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))})
            if t < turns - 1 or i % 3:  # some end with the user, waiting for the assistant
                messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))})
        out.append(messages)
    return out


def _runs(ids, mask, tok):
    """The decoded texts of the mask's runs of 1s."""
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(tok.decode(current)), current.clear()
    return runs + ([tok.decode(current)] if current else [])


@pytest.mark.parametrize("kind, template", [("chatml", CHATML), ("llama3", LLAMA3), ("chatml", CHATML_MARKED)],
                         ids=["chatml", "llama3", "chatml-generation-markers"])
def test_ids_and_assistant_mask_match_transformers(tmp_path, kind, template):
    tok = _tokenizer(tmp_path, kind, template)
    marked = "{% generation %}" in template
    for messages in _conversations():
        for add in (False, True):
            ids, mask = chat.encode(messages, f"hf:{tmp_path}", add_generation_prompt=add)
            expected = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add, return_dict=True,
                                               return_assistant_tokens_mask=marked)
            assert ids == list(expected["input_ids"]), (messages, add)
            assert len(mask) == len(ids)
            if marked:
                assert mask == list(expected["assistant_masks"]), (messages, add)
            if not add:  # exactly each assistant content and its end-of-turn token
                contents = [m["content"].strip() + END[kind] for m in messages if m["role"] == "assistant"]
                assert _runs(ids, mask, tok) == contents, messages


def test_without_markers_the_mask_is_the_markers_mask(tmp_path):
    """The same ChatML template with and without {% generation %} markers: the prefix-rendering mask equals the
    markers' (and transformers')."""
    tok = _tokenizer(tmp_path / "marked", "chatml", CHATML_MARKED)
    _tokenizer(tmp_path / "plain", "chatml", CHATML)
    for messages in _conversations():
        plain = chat.encode(messages, f"hf:{tmp_path / 'plain'}")
        expected = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
        assert plain == (list(expected["input_ids"]), list(expected["assistant_masks"]))


def test_a_tokenizer_dir_under_home_is_found(tmp_path, monkeypatch):
    """`chat.encode(..., "hf:~/models/x")` looked for `./~/models/x`."""
    _tokenizer(tmp_path / "tok", "chatml", CHATML)
    monkeypatch.setenv("HOME", str(tmp_path))
    messages = _conversations()[0]
    assert chat.encode(messages, "hf:~/tok") == chat.encode(messages, f"hf:{tmp_path / 'tok'}")


def test_a_tuple_of_messages_is_a_conversation(tmp_path):
    """A tuple was refused as "messages must be a non-empty list"."""
    _tokenizer(tmp_path, "chatml", CHATML)
    messages = _conversations()[0]
    assert chat.encode(tuple(messages), f"hf:{tmp_path}") == chat.encode(messages, f"hf:{tmp_path}")


def test_bad_conversations_are_one_line(tmp_path):
    _tokenizer(tmp_path, "chatml", CHATML)
    for messages, says in (([{"role": "user"}], "message 0 needs a 'role' and a 'content'"),
                           ([{"role": "robot", "content": "hi"}], "role 'robot'"), ([], "non-empty list"),
                           # one message, not wrapped in a list: "messages must be a non-empty list" before
                           ({"role": "user", "content": "hi"}, "one message, not a conversation; give a list")):
        with pytest.raises(DataError) as e:
            chat.encode(messages, f"hf:{tmp_path}")
        assert says in str(e.value) and "\n" not in str(e.value)


def test_a_tokenizer_dir_that_is_missing_or_has_no_tokenizer_json_is_named(tmp_path):
    """It was "DIR has no chat template", whatever the dir held (or when there was none)."""
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ConfigError, match=f"tokenizer hf:{tmp_path / 'missing'}: no such directory; give a Hugging "
                                          "Face model dir"):
        chat.encode(messages, tokenizer=f"hf:{tmp_path / 'missing'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty: no tokenizer.json in it; give a Hugging Face model dir"):
        chat.encode(messages, tokenizer=f"hf:{tmp_path / 'empty'}")


def test_a_dir_without_a_template_names_how_to_give_one_here(tmp_path):
    """The message named the commands' ways only (data.chat_template=, --chat-template) for a chat.encode call; a
    template given as chat_template= is then used."""
    _tokenizer(tmp_path / "tok", "chatml", CHATML)
    for name in ("chat_template.jinja", "tokenizer_config.json"):  # where transformers may have saved the template
        path = tmp_path / "tok" / name
        if name.endswith(".jinja"):
            path.unlink(missing_ok=True)
        else:
            path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "chat_template"}))
    messages = _conversations()[1]
    with pytest.raises(ConfigError, match="has no chat template .*chat_template=PATH in chat.encode"):
        chat.encode(messages, f"hf:{tmp_path / 'tok'}")
    (tmp_path / "t.jinja").write_text(CHATML)
    _tokenizer(tmp_path / "with", "chatml", CHATML)
    assert chat.encode(messages, f"hf:{tmp_path / 'tok'}", chat_template=str(tmp_path / "t.jinja")) == \
        chat.encode(messages, f"hf:{tmp_path / 'with'}")
