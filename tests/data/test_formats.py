"""Conversation records through the pipeline: the format read off the records, the loss mask through packing (exactly
the assistant's tokens), prompt and completion pairs, the per-example loss over masked tokens, and one-line errors
naming the file, the record and the field."""

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import one_line_error

from metatrain.data import chat
from metatrain.data.chat_data import CHATML, make_chat, requests_of, write_tokenizer
from metatrain.data.formats import Encoder, Fields, preview
from metatrain.data.pipeline import DataConfig, Streams
from metatrain.data.sources import open_source
from metatrain.data.tokenizer import load_tokenizer
from metatrain.errors import ConfigError, DataError

WORDS = "the quick brown fox jumps over a lazy dog what is two plus two four said the model".split()


def _conversation(rng, i):
    messages = [{"role": "system", "content": "be brief."}] if i % 2 else []
    for _ in range(1 + i % 3):
        messages.append({"role": "user", "content": " ".join(rng.choice(WORDS, 6))})
        messages.append({"role": "assistant", "content": " ".join(rng.choice(WORDS, 1 + i % 7))})
    return messages


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok") / "tokenizer"
    write_tokenizer(str(directory), [" ".join(WORDS)] * 20, 300)
    return directory


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _chats(tmp_path, n=40):
    rng = np.random.default_rng(0)
    return _jsonl(tmp_path / "chat.jsonl", [{"id": f"c{i}", "messages": _conversation(rng, i)} for i in range(n)])


def _cfg(path, tok_dir, **kw):
    return DataConfig(**{"source": f"jsonl:{path}", "tokenizer": f"hf:{tok_dir}", "seq_len": 24, "batch": 4,
                         "outer_every": 5, "shuffle_window": 8, **kw})


def test_the_loss_mask_goes_through_packing_and_covers_the_assistant_tokens(tmp_path, tok_dir):
    """Each packed row's loss_mask marks exactly the tokens that `chat.encode` marks in its conversations: the
    packed rows are the conversations' ids concatenated, and the masks concatenated the same way."""
    path = _chats(tmp_path)
    streams = Streams(_cfg(path, tok_dir, shuffle_window=1), 0, 1)
    assert streams.format == "chat" and streams.docs.fields.format == "chat"
    src = open_source(f"jsonl:{path}")
    encoded = {i: chat.encode(src[i], f"hf:{tok_dir}") for i in range(len(src))}
    seen = trained = 0
    for _ in range(6):
        inner, _ = streams.next()
        for row in range(4):
            tokens, mask = inner["tokens"][0, row], inner["loss_mask"][0, row]
            seg, doc = inner["segment_ids"][0, row], inner["doc"][0, row]
            # rebuild the row from the conversations it was cut from: segments follow the documents in order
            for s in np.unique(seg[seg > 0]):
                at = np.flatnonzero(seg == s)
                piece, piece_mask = tokens[at].tolist(), mask[at].tolist()
                hits = [(i, k) for i, (ids, m) in encoded.items() for k in range(len(ids) - len(at) + 1)
                        if ids[k:k + len(at)] == piece and m[k:k + len(at)] == piece_mask]
                assert hits, (doc, piece)
                seen += 1
            trained += int(mask.sum())  # a row may hold only a conversation's user turns: none of its tokens
    assert seen > 20 and trained > 100


def test_the_mask_is_the_assistant_text_and_train_on_all_is_every_token(tmp_path, tok_dir):
    path = _chats(tmp_path, 6)
    src = open_source(f"jsonl:{path}")
    tok = load_tokenizer(f"hf:{tok_dir}")
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    for i in range(len(src)):
        ids, mask = Encoder(tok)(src[i])
        runs, run = [], []
        for t, m in zip(ids, mask):
            if m:
                run.append(int(t))
            elif run:
                runs.append(run)
                run = []
        texts = [backend.decode(r, skip_special_tokens=False) for r in runs + ([run] if run else [])]
        assert texts == [m["content"] + "<|im_end|>" for m in src[i] if m["role"] == "assistant"]
        ids_all, mask_all = Encoder(tok, train_on="all")(src[i])
        assert ids_all.tolist() == ids.tolist() and mask_all.all()


def test_prompt_completion_trains_on_the_completion(tmp_path, tok_dir):
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": f"what is {w}?", "completion": f" {w} is a word."}
                                          for w in WORDS])
    src = open_source(f"jsonl:{path}")
    assert src.fields.format == "prompt_completion"
    tok = load_tokenizer(f"hf:{tok_dir}")
    ids, mask = Encoder(tok)(src[0])
    prompt = tok.encode("what is the?", eot=False)
    assert ids[:len(prompt)].tolist() == prompt.tolist() and not mask[:len(prompt)].any()
    assert mask[len(prompt):].all() and ids[-1] == tok.eot
    # message lists: one conversation, the completion's assistant turns trained on (not the prompt's)
    record = {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the fox"},
                         {"role": "user", "content": "more"}],
              "completion": [{"role": "assistant", "content": "a lazy dog"}]}
    doc = Fields().detect(record, "r").value(record, "r")
    ids, mask = Encoder(tok)(doc)
    assert tok.decode(ids[mask == 1]) == "a lazy dog<|im_end|>"
    assert preview(doc) == "user: hi | assistant: the fox | user: more | assistant: a lazy dog"


def test_the_masked_loss_is_the_mean_over_masked_targets():
    import jax
    import jax.numpy as jnp

    from metatrain import models

    cfg = models.ModelConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, n_layers=1)
    model = models.Transformer(cfg, rngs=__import__("flax").nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, 50)
    mask = jnp.asarray(np.random.default_rng(0).integers(0, 2, (3, 9)))
    logits = np.asarray(model(tokens[:, :-1]), np.float64)
    target = np.take_along_axis(logits, np.asarray(tokens[:, 1:])[..., None], -1)[..., 0]
    nll = np.log(np.exp(logits).sum(-1)) - target
    m = np.asarray(mask[:, 1:], np.float64)
    expected = (nll * m).sum(-1) / np.maximum(m.sum(-1), 1)
    # float32 logits of a 1-layer model: the two means agree to float32 rounding (~1e-6 relative)
    np.testing.assert_allclose(model.example_losses(tokens, loss_mask=mask), expected, rtol=1e-5)
    chunked = models.Transformer(cfg.replace(loss_chunk=4), rngs=__import__("flax").nnx.Rngs(0))
    np.testing.assert_allclose(chunked.example_losses(tokens, loss_mask=mask), expected, rtol=1e-5)


def test_formats_are_read_off_the_first_record_and_ambiguity_is_refused(tmp_path):
    text = _jsonl(tmp_path / "t.jsonl", [{"text": "hello"}])
    assert open_source(f"jsonl:{text}").fields.format == "text"
    both = _jsonl(tmp_path / "b.jsonl", [{"text": "hello", "messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(DataError, match=r"b.jsonl:1: the record could be chat or text.*data.format=chat\|text"):
        open_source(f"jsonl:{both}")
    assert open_source(f"jsonl:{both}", format="chat").fields.format == "chat"
    with pytest.raises(ConfigError, match="data.format=chat: data source 'builtin' holds plain text"):
        open_source("builtin", format="chat")
    with pytest.raises(ConfigError, match="data.format must be one of text, chat, prompt_completion"):
        DataConfig(format="sharegpt")
    with pytest.raises(ConfigError, match="data.train_on must be one of assistant, all"):
        DataConfig(train_on="user")


def test_bad_conversations_are_one_line_naming_file_record_and_field(tmp_path, tok_dir):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the fox"}]}
    cases = [
        ({"text": "no messages here"}, r"bad.jsonl:2: no field 'messages'.*data.messages_field"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"bad.jsonl:2: field 'messages': message 0 has role "
                                                            r"'robot'"),
        ({"messages": [{"role": "user"}]}, r"bad.jsonl:2: field 'messages': message 0 needs a 'role' and a 'content'"),
    ]
    for record, message in cases:
        path = _jsonl(tmp_path / "bad.jsonl", [good, record])
        with pytest.raises(DataError, match=message):
            open_source(f"jsonl:{path}", format="chat")
    # found while encoding: no assistant turn (under train_on=assistant), a template that fails to render
    path = _jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 10)
    with pytest.raises(DataError, match=r"bad.jsonl:\d+: field 'messages': no assistant turn to train on "
                                        r"\(data.train_on=assistant\); add one, or set data.train_on=all"):
        Streams(_cfg(path, tok_dir), 0, 1)
    failing = tmp_path / "failing.jinja"
    failing.write_text("{{ raise_exception('only user turns, please') }}")
    path = _chats(tmp_path)
    with pytest.raises(DataError, match=r"chat.jsonl:\d+: the chat template fails to render it: only user turns"):
        Streams(_cfg(path, tok_dir, chat_template=str(failing)), 0, 1)
    with pytest.raises(ConfigError, match="data.format=chat: conversations are rendered by the model's chat template, "
                                          "which a tiktoken encoding has none of; give data.tokenizer=hf:DIR .*: "
                                          "a run trained with a tiktoken encoding reads text only"):
        Streams(DataConfig(source=f"jsonl:{path}", seq_len=24, batch=4, outer_every=5), 0, 1)


def test_a_bad_record_is_one_line_from_the_command(tmp_path, tok_dir):
    """From `metatrain train`, as a user meets it: no traceback, the file and line."""
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "x"},
                                                       {"role": "assistant", "content": "y"}]}] * 9
                  + [{"messages": [{"role": "narrator", "content": "x"}]}])
    res = subprocess.run([sys.executable, "-m", "metatrain.cli", "train", f"data.source=jsonl:{path}",
                          f"data.tokenizer=hf:{tok_dir}", f"workdir={tmp_path / 'run'}"], capture_output=True,
                         text=True, cwd=tmp_path)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"{path}:10: field 'messages': message 0 has role 'narrator'" in res.stderr


def test_make_chat_writes_conversations_and_a_tokenizer_with_a_template(tmp_path):
    text = 'def f(a, b):\n    """Add two numbers."""\n    return a + b\n\n\nclass C:\n    def g(self):\n' \
           '        """Nothing."""\n        return None\n'
    assert requests_of(text) == [("Write a Python function `f(a, b)`: Add two numbers.",
                                  'def f(a, b):\n    """Add two numbers."""\n    return a + b'),
                                 ("Write a Python function `g(self)`: Nothing.",
                                  'def g(self):\n    """Nothing."""\n    return None')]
    m = make_chat(str(tmp_path / "chat"), vocab_size=400)
    assert min(m["conversations"].values()) > 50
    first = json.loads((tmp_path / "chat" / "train.jsonl").read_text().splitlines()[0])
    ids, mask = chat.encode(first["messages"], f"hf:{tmp_path / 'chat' / 'tokenizer'}")
    assert 0 < sum(mask) < len(ids)
    assert chat.read_template(str(tmp_path / "chat" / "tokenizer")) == CHATML
    with pytest.raises(ConfigError, match="make-chat --out: .* already exists and is not empty"):
        make_chat(str(tmp_path / "chat"))


@pytest.mark.slow
def test_a_chat_run_then_scores_eval_and_filter_on_conversations(tmp_path, tok_dir, capsys):
    """A tiny loss-weighting run on conversations (trusted set: conversations too), then its scores, eval and filter
    on conversations: one score per conversation, the loss of the assistant's tokens, the kept lines unchanged."""
    from helpers import TINY

    from metatrain import cli, filtering, scores

    rng = np.random.default_rng(1)
    path = _jsonl(tmp_path / "chat.jsonl", [{"id": f"c{i}", "messages": _conversation(rng, i)} for i in range(60)])
    trusted = _jsonl(tmp_path / "trusted.jsonl", [{"messages": _conversation(rng, i)} for i in range(20)])
    run = tmp_path / "run"
    template = tmp_path / "mine.jinja"  # the run's own template: the tokenizer's, after a line of its own
    template.write_text("run's own template\n" + CHATML)
    assert cli.main(["train", *TINY, "steps=2", f"data.source=jsonl:{path}", f"data.outer_source=jsonl:{trusted}",
                     f"data.tokenizer=hf:{tok_dir}", f"data.chat_template={template}", f"workdir={run}"]) == 0
    out, n = scores.scores(str(run), f"jsonl:{path}")
    rows = [json.loads(line) for line in open(out)]
    assert n == 60 and [r["id"] for r in rows] == [f"c{i}" for i in range(60)]
    assert all(np.isfinite(r["score"]) and r["weight"] > 0 for r in rows)
    losses = dict(scores.evaluate(str(run), f"jsonl:{trusted}"))
    assert 0 < losses["inner model (fine-tuned)"] < 10 and 0 < losses["uniform baseline"] < 10
    # a masked loss: every token of the same conversations, counted as text, gives another figure
    whole = _jsonl(tmp_path / "whole.jsonl", [{"text": chat.ChatTemplate(str(tok_dir)).render(
        json.loads(line)["messages"])[0]} for line in open(trusted)])
    assert dict(scores.evaluate(str(run), f"jsonl:{whole}"))["uniform baseline"] != losses["uniform baseline"]
    # generate --chat renders a prompt with the run's template; a bad conversation names its file and line
    from metatrain.cli.generate import _encode, _model

    _, _, tok, run_template, _ = _model(str(run), None, None)
    assert run_template == str(template)
    ids = _encode([("hi", "--prompt")], tok, argparse.Namespace(chat=True), run_template)[0]
    assert tok.decode(ids).startswith("run's own template\n<|im_start|>user\nhi")
    prompts = _jsonl(tmp_path / "prompts.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                                  {"messages": [{"role": "narrator", "content": "once"}]}])
    capsys.readouterr()
    assert cli.main(["generate", str(run), "--prompts", str(prompts), "--max-new-tokens", "2"]) == 2
    one_line_error(capsys.readouterr().err, f"{prompts}:2", "role 'narrator'")
    m = filtering.filter_corpus(str(run), f"jsonl:{path}", str(tmp_path / "kept"), 0.5, batch=4)
    kept = (tmp_path / "kept" / "part-00000.jsonl").read_text().splitlines()
    assert m["documents"]["kept"] == len(kept) and 0 < len(kept) < 60
    assert set(kept) <= set(path.read_text().splitlines())


# ---- records that once ended in a traceback or trained on the wrong text --------------------------------------------
def _encoder(tok_dir, **kw):
    return Encoder(load_tokenizer(f"hf:{tok_dir}"), **kw)


def test_a_lone_surrogate_is_one_line_naming_the_record(tok_dir):
    """"\\ud800" is valid JSON but no character: the tokenizers library raised a TypeError on it."""
    enc = _encoder(tok_dir)
    bad = json.loads('"a \\ud800 b"')
    for doc in ([{"role": "user", "content": bad}, {"role": "assistant", "content": "ok"}], bad,
                {"prompt": "q", "completion": bad}):
        with pytest.raises(DataError, match=r"c.jsonl:3: the text holds a lone surrogate .*not valid Unicode"):
            enc(doc, "c.jsonl:3")


def test_a_chat_template_that_is_not_utf8_is_one_line(tok_dir, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_bytes(b"{{ messages[0]['content'] }}\xff")
    with pytest.raises(ConfigError, match=r"data.chat_template: .*t.jinja is not UTF-8 text"):
        chat.encode([{"role": "user", "content": "x"}], f"hf:{tok_dir}", chat_template=str(path))


def test_null_fields_and_content_parts_and_an_opening_assistant_turn(tok_dir):
    fields = Fields("prompt_completion")
    with pytest.raises(DataError, match="r.jsonl:2: field 'completion' is null"):
        fields.value({"prompt": "q", "completion": None}, "r.jsonl:2")
    enc = _encoder(tok_dir)
    text = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "general kenobi"}]}]
    assert [a.tolist() for a in enc(parts, "x")] == [a.tolist() for a in enc(text, "x")]  # joined, not a repr
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, text[1]]
    with pytest.raises(DataError, match="message 0, content part 0 is 'image_url'; only text parts"):
        enc(image, "x")
    # a greeting first: the template renders it, and it is trained on
    greeting = [{"role": "assistant", "content": "hi, how can I help?"}, *text]
    ids, mask = enc(greeting, "x")
    tok = load_tokenizer(f"hf:{tok_dir}")
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert "hi, how can I help?" in trained and "general kenobi" in trained and "hello there" not in trained


def test_a_tool_call_with_null_content(tok_dir, tmp_path):
    """Null content beside tool_calls goes to a template that renders tool calls as it is (as transformers passes
    it); a template that does not (ChatML here) would print "None": refused."""
    call = [{"role": "user", "content": "add 1 and 2"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                "name": "add", "arguments": {"a": 1, "b": 2}}}]},
            {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]
    with pytest.raises(DataError, match="message 1 has null content .*does not render tool_calls"):
        _encoder(tok_dir)(call, "t.jsonl:1")
    with pytest.raises(DataError, match="message 0 has null content and no tool_calls"):
        _encoder(tok_dir)([{"role": "user", "content": None}, call[3]], "t.jsonl:1")
    template = tmp_path / "tools.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is not none %}"
                        "{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}call {{ c.function.name }}"
                        "({{ c.function.arguments | tojson }}){% endfor %}<|im_end|>\n{% endfor %}")
    ids, mask = _encoder(tok_dir, chat_template=str(template))(call, "t.jsonl:1")
    text = load_tokenizer(f"hf:{tok_dir}").decode(ids)
    assert 'call add({"a": 1, "b": 2})' in text and "None" not in text


def test_data_stats_reads_conversations_as_training_does(tmp_path, tok_dir, capsys):
    from metatrain import cli

    path = _chats(tmp_path, n=12)
    assert cli.main(["data", "stats", "--source", f"jsonl:{path}", "--tokenizer", f"hf:{tok_dir}"]) == 0
    out = capsys.readouterr().out
    enc = _encoder(tok_dir)
    rows = [enc(json.loads(line)["messages"], "x") for line in path.read_text().splitlines()]
    assert "documents: 12 of 12" in out and f"tokens: {sum(len(i) for i, _ in rows):,}" in out
    assert f"trained-on tokens: {sum(int(m.sum()) for _, m in rows):,}" in out


def test_data_stats_names_its_tokenizer_flag_for_conversations_under_tiktoken(tmp_path, capsys):
    """`data stats` of conversations with its default tiktoken encoding names the flag to change (--tokenizer), not
    a config key the command does not take."""
    from metatrain import cli

    path = _chats(tmp_path, n=12)
    assert cli.main(["data", "stats", "--source", f"jsonl:{path}"]) == 2
    err = capsys.readouterr().err
    one_line_error(err, "data.format=chat", "give --tokenizer hf:DIR")
    assert "data.tokenizer" not in err


def test_data_stats_refuses_a_chat_template_it_would_not_read(tmp_path, capsys):
    """A template file for plain-text records was read by nothing and counted nothing, without a word (train refuses
    it); a missing template file was not looked for."""
    from metatrain import cli

    corpus, template = tmp_path / "docs.jsonl", tmp_path / "chat.jinja"
    corpus.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(4)))
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    for given, says in ((template, f"--chat-template: the records of jsonl:{corpus} are plain text"),
                        (tmp_path / "none.jinja", f"--chat-template: {tmp_path / 'none.jinja'} not found")):
        assert cli.main(["data", "stats", "--source", f"jsonl:{corpus}", "--chat-template", str(given)]) == 2
        assert says in capsys.readouterr().err.strip().splitlines()[-1]


def test_preview_joins_text_parts():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": None, "tool_calls": []}]
    assert preview(parts) == "user: a b | assistant:"
