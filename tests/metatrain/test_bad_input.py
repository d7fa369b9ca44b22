"""Bad input found by probing the newer surfaces (LoRA, the scorer, data sources, overrides): each is one line naming
the field or file and what to do, exit 2, before anything compiles; none is silently ignored."""

import json
import logging
import os
import re

import pytest
from helpers import TINY, one_line_error

from metatrain import cli


def _write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.mark.parametrize("extra, needles", [
    (["inner.lora.targets=,"], ["inner.lora.targets:", "cannot be read as a value"]),  # not YAML
    (["inner.lora.rank=4", "inner.lora.targets=gate"], ["inner.lora.targets: gate adapts no weight"]),  # GELU MLP
    (["task=maml", "meta_model.preset=44m"], ["meta_model:", "task 'maml' has no meta model"]),  # was ignored
    (["meta_model.n_heads=3"], ["meta_model.d_model=16 is not divisible by meta_model.n_heads=3"]),
    # a chat template for plain text (here not even a file) was read by nothing
    (["data.chat_template=tpl.jinja"], ["data.chat_template: the records of data.source=builtin are plain text"]),
    # a kind without its path (an empty shell variable after it): YAML reads `jsonl:` as a mapping
    (["data.source=jsonl:"], ["data.source: 'jsonl:' names no path; write jsonl:PATH"]),
    (["data.eval_source=hf-disk:"], ["data.eval_source: 'hf-disk:' names no path; write hf-disk:PATH"]),
])
def test_settings_that_cannot_apply_are_refused(extra, needles, tmp_path, capsys):
    code = cli.main(["train", *TINY, *extra, f"workdir={tmp_path / 'run'}"])
    assert code == 2
    one_line_error(capsys.readouterr().err, *needles)


def test_a_source_with_no_text_is_refused_before_training(tmp_path, capsys):
    """Empty documents once made packing spin on end-of-text tokens for more than 10 minutes."""
    source = _write_jsonl(tmp_path / "empty.jsonl", [""] * 40)
    code = cli.main(["train", *TINY, f"data.source=jsonl:{source}", f"workdir={tmp_path / 'run'}"])
    assert code == 2
    one_line_error(capsys.readouterr().err, "hold no text", "data.text_field")


def test_dangling_links_in_a_dir_source_are_skipped_and_counted(tmp_path, capsys):
    from metatrain.data.sources import open_source

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(5):
        os.symlink(tmp_path / f"gone{i}", docs / f"link{i}.txt")
    code = cli.main(["train", *TINY, f"data.source=dir:{docs}", f"workdir={tmp_path / 'run'}"])
    assert code == 2
    one_line_error(capsys.readouterr().err, "no readable files", "5 dangling links")
    for i in range(3):
        (docs / f"doc{i}.txt").write_text(f"document {i}")
    source = open_source(f"dir:{docs}")
    assert len(source) == 3 and sorted(source.doc_id(i) for i in range(3)) == ["doc0.txt", "doc1.txt", "doc2.txt"]
    assert "skipped 5 dangling links or unreadable files of 8" in capsys.readouterr().err


def test_a_run_that_fails_before_writing_leaves_no_work_dir(tmp_path, capsys):
    source = _write_jsonl(tmp_path / "empty.jsonl", [""] * 40)
    assert cli.main(["train", *TINY, f"data.source=jsonl:{source}", f"workdir={tmp_path / 'new'}"]) == 2
    assert not (tmp_path / "new").exists()


def test_eval_of_documents_with_no_token_is_one_line(shared_run, tmp_path, capsys):
    source = _write_jsonl(tmp_path / "empty.jsonl", ["", "", ""])
    assert cli.main(["eval", str(shared_run["workdir"]), "--data", f"jsonl:{source}"]) == 2
    one_line_error(capsys.readouterr().err, "has a token to predict")  # it printed loss 0.0000, perplexity 1.00


@pytest.mark.slow
def test_a_lora_run_resumes_only_on_the_base_it_was_trained_on(shared_run, tmp_path, capsys):
    """Two export dirs of the same shapes (the shared run's fine-tuned and baseline models): resuming a LoRA run with
    the other as inner.init_from is refused before anything compiles; with its own base it resumes. Also: the rows a
    run wrote after its last checkpoint are dropped from metrics.jsonl when it resumes from that checkpoint."""
    run = shared_run["workdir"]
    for what in ("inner", "baseline"):
        assert cli.main(["export", str(run), "--what", what, "--out", str(tmp_path / what)]) == 0
    capsys.readouterr()
    lora = [*TINY, "inner.lora.rank=2", f"workdir={tmp_path / 'run'}", "checkpoint_every=2", "log.wandb=false"]
    assert cli.main(["train", *lora, f"inner.init_from={tmp_path / 'inner'}", "steps=2"]) == 0
    identity = json.loads((tmp_path / "run" / "lora_base.json").read_text())
    assert identity["init_from"] == str(tmp_path / "inner") and len(identity["abs_sums"]) > 3
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:  # as if it had run on to step 3 and been killed
        f.write(json.dumps({"step": 3, "outer_loss": 9.0, "meta_grad_norm": 1.0}) + "\n" + '{"step": 4, "ou')
    capsys.readouterr()
    code = cli.main(["train", *lora, f"inner.init_from={tmp_path / 'baseline'}", "steps=3"])
    assert code == 2
    out = capsys.readouterr()
    one_line_error(out.err, "inner.init_from:", f"base weights of {tmp_path / 'inner'}", "holds other weights")
    assert "meta-gradient:" not in out.err  # refused before the outer step was compiled
    assert cli.main(["train", *lora, f"inner.init_from={tmp_path / 'inner'}", "steps=3"]) == 0
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r["step"] for r in rows if "meta_grad_norm" in r]
    assert steps == [1, 2, 3] and all(r.get("outer_loss") != 9.0 for r in rows)
    # its adapters in PEFT's format: refused as the merged model is, for a base (GELU MLP) transformers has no class for
    capsys.readouterr()
    peft = tmp_path / "peft"
    assert cli.main(["export", str(tmp_path / "run"), "--adapters", "--format", "hf", "--out", str(peft)]) == 2
    one_line_error(capsys.readouterr().err, "transformers has no Llama or Qwen2 class for a GELU MLP")
    assert not peft.exists()


def test_reading_a_run_logs_no_missing_metadata_warning(shared_run, tmp_path, caplog):
    """Orbax warned "Metadata file does not exist" for every read of a run's state, item by item."""
    with caplog.at_level(logging.WARNING):
        assert cli.main(["export", str(shared_run["workdir"]), "--out", str(tmp_path / "meta")]) == 0
    assert not [r for r in caplog.records if "Metadata file does not exist" in r.getMessage()]


def test_a_compiler_refusal_a_user_can_fix_is_one_line_naming_the_flag():
    """The TPU compiler's scoped-VMEM refusal (the LoRA 1B program hits it at libtpu's default limit) reached users as
    a traceback from `bench memory`, `compile` and `train`: every compile goes through `aot.compile`."""
    from metatrain import aot
    from metatrain.errors import TrainingError

    class Refused:
        def __init__(self, message):
            self.message = message

        def compile(self, compiler_options=None):
            raise RuntimeError(self.message)

    with pytest.raises(TrainingError) as e:
        aot.compile(Refused("INTERNAL: Mosaic failed: CompileTimeScopedVmemOom: used 20.5M of 16.0M scoped vmem\n..."))
    assert "LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=32768" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RuntimeError, match="something else"):  # other failures keep their traceback
        aot.compile(Refused("something else"))


def test_an_outer_step_past_the_memory_here_is_refused_before_its_first_step(tmp_path, capsys, monkeypatch):
    """`data.seq_len=100000` once compiled a 9 TiB outer step and died in JAX with RESOURCE_EXHAUSTED; the compiled
    peak is now held against the memory here (made small for the test) before anything runs."""
    from metatrain import aot

    monkeypatch.setattr(aot, "memory_here", lambda device: 0)
    code = cli.main(["train", *TINY, f"workdir={tmp_path / 'run'}"])
    assert code == 2
    one_line_error(capsys.readouterr().err, "the outer step needs", "at its peak", "more than the 0 bytes available",
                   "data.batch", "data.seq_len", "metatrain bench memory")
    assert not (tmp_path / "run").exists()


def test_running_out_of_memory_in_a_program_is_one_line(monkeypatch, capsys):
    import jax

    from metatrain.cli import check

    def out_of_memory(args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 320313613584 bytes.")

    monkeypatch.setattr(check, "cmd_check_grads", out_of_memory)
    assert cli.main(["check-grads", "--task", "maml"]) == 2
    one_line_error(capsys.readouterr().err, "metatrain check-grads: error: out of memory",
                   "Out of memory allocating 320313613584 bytes", "smaller batches")


def test_a_full_disk_while_writing_is_one_line(monkeypatch, capsys):
    import errno

    from metatrain.cli import check, run

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "runs/x/metrics.jsonl")

    monkeypatch.setattr(check, "cmd_check_grads", full)
    assert cli.main(["check-grads", "--task", "maml"]) == 2
    err = capsys.readouterr().err
    one_line_error(err, "metatrain check-grads: error: writing runs/x/metrics.jsonl failed (No space left on device); "
                   "make room there and run again")
    assert "--resume" not in err  # check-grads has none
    # a command that takes --resume says how it continues
    monkeypatch.setattr(run, "cmd_train", full)
    assert cli.main(["train", "steps=2"]) == 2
    one_line_error(capsys.readouterr().err, "metatrain train: error: writing runs/x/metrics.jsonl failed",
                   "make room there and run again (with --resume to continue the run from its last checkpoint, "
                   "if it saved one)")


def test_a_metatrain_run_or_export_given_as_hf_says_to_drop_the_prefix(shared_run, tmp_path, capsys):
    """hf:DIR on a metatrain run or export dir said only that config.json was not found."""
    from metatrain import hf
    from metatrain.errors import DataError

    run, export = shared_run["workdir"], tmp_path / "export"
    export.mkdir()
    (export / "export.json").write_text("{}")  # what tells an export dir (`metatrain export` writes it)
    for folder, what in ((run, "a run"), (export, "an export")):
        says = [f"{folder}/config.json not found", f"{folder} is {what} of metatrain: give it without hf:",
                "metatrain export RUN --format hf --out DIR"]
        assert cli.main(["generate", f"hf:{folder}", "--prompt", "hi"]) == 2
        one_line_error(capsys.readouterr().err, *says)
        with pytest.raises(DataError) as e:
            hf.load(str(folder))
        assert all(s in str(e.value) for s in says), e.value
    with pytest.raises(DataError) as e:  # any other folder: as before
        hf.load(str(tmp_path))
    assert str(e.value).endswith("give a local Hugging Face model dir (config.json + model.safetensors)")


def test_a_model_dir_given_as_hf_where_the_dir_itself_is_taken_says_to_drop_the_prefix(tmp_path, capsys,
                                                                                       monkeypatch):
    """`metatrain import hf hf:DIR` (as inner.init_from names it) said only that ./hf:DIR/config.json was not found."""
    from metatrain import hf
    from metatrain.errors import DataError

    monkeypatch.chdir(tmp_path)
    says = "drop the hf: prefix here (`metatrain import hf DIR` and hf.load(DIR) take the dir itself"
    assert cli.main(["import", "hf", "hf:models/m", "--out", "imported"]) == 2
    one_line_error(capsys.readouterr().err, f"{tmp_path}/hf:models/m/config.json not found", says)
    with pytest.raises(DataError, match=re.escape(says)):
        hf.load("hf:~/models/m")
    assert not (tmp_path / "imported").exists()


def test_a_data_flag_without_its_path_is_one_line(shared_run, tmp_path, capsys):
    for argv in (["eval", str(shared_run["workdir"]), "--data", "jsonl:"],
                 ["scores", str(shared_run["workdir"]), "--data", "parquet:", "--out", str(tmp_path / "s.jsonl")]):
        assert cli.main(argv) == 2
        kind = argv[3]
        one_line_error(capsys.readouterr().err, f"data source '{kind}' names no path; write {kind}PATH")
