"""Helpers shared by the tests: the tiny run config, running metatrain in a subprocess, reading a run's saved
state and comparing parameters."""

import json
import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp

TESTS = os.path.dirname(os.path.abspath(__file__))

# a tiny loss-weighting run: well under a second per step on CPU; held-out evaluation at the end only (the shared
# run sets eval_every=2 where periodic rows are checked). One layer: the outer step compiles in half the time of the
# preset's two (the tests of layer stacking, remat and scan over layers set their own models). The default shuffle
# window (2048 rows): a smaller one holds a few documents only, and a held-out sample of one document has no AUC
TINY = ["task=loss_weighting", "model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.d_ff=32",
        "data.vocab_size=300", "data.seq_len=16", "data.batch=8", "data.corrupt_fraction=0.3",
        "eval_batches=1", "eval_every=100000", "log_every=1", "inner_lr=0.01"]


def cuda_plugin_path() -> str | None:
    """Where JAX's CUDA plugin imports from: "" where it is installed here, the checkout's .cuda_plugin folder where
    CI put it (.ci/run), else None."""
    import glob

    import jaxlib

    from metatrain import aot

    if aot.cuda_plugin_installed():
        return ""
    folder = os.path.join(os.path.dirname(TESTS), ".cuda_plugin")
    # a folder left by another venv: JAX refuses a plugin of another jaxlib version (and may crash on it)
    built = [os.path.basename(d).removesuffix(".dist-info").split("-")[1]
             for d in glob.glob(os.path.join(folder, "jax_cuda1*_plugin-*.dist-info"))]
    return folder if os.path.isdir(os.path.join(folder, "jax_plugins")) and jaxlib.__version__ in built else None


def env(devices: int | None = 1, **extra) -> dict:
    """The environment of a metatrain subprocess: CPU with `devices` simulated devices (None: as the run's
    `mesh.cpu_devices` says), this test directory's task modules importable, and the session's compilation cache
    (set by conftest)."""
    path = os.pathsep.join([TESTS, os.path.join(TESTS, "metatrain"), os.environ.get("PYTHONPATH", "")])
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    count = "" if devices is None else f" --xla_force_host_platform_device_count={devices}"
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path, XLA_FLAGS=f"{flags}{count}".strip(), **extra)


def metatrain(*args, devices: int | None = 1, background: bool = False, cwd=None, extra_env=None,
              file_limit_kib: int | None = None):
    """`metatrain ARGS...` in a subprocess: its CompletedProcess (text), or the Popen when `background`.
    `file_limit_kib`: the files it writes hold at most that many KiB (`ulimit -f`, SIGXFSZ ignored), so a longer write
    fails (EFBIG) as on a full disk, without root."""
    cmd = [sys.executable, "-m", "metatrain.cli", *map(str, args)]
    if file_limit_kib is not None:
        cmd = ["bash", "-c", f'trap "" XFSZ; ulimit -f {file_limit_kib}; exec "$@"', "bash", *cmd]
    e = env(devices, **(extra_env or {}))
    if background:
        return subprocess.Popen(cmd, env=e, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=e, cwd=cwd, capture_output=True, text=True)


def train(workdir, *extra, devices: int | None = 1, resume: bool = False, command: str = "train") -> str:
    """A tiny run in a subprocess that must succeed; returns its stdout."""
    res = metatrain(command, *TINY, f"workdir={workdir}", *extra, *(["--resume"] if resume else []), devices=devices)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def checkpoints(workdir) -> list[int]:
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def saved_state(workdir, step):
    """The saved state on this process's one device, whatever mesh wrote it."""
    import jax

    path = os.path.abspath(os.path.join(workdir, "checkpoints", str(step), "state"))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path).item_metadata.tree
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
        return ckptr.restore(path, target)


def leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# A run in float64 (jax_enable_x64 in the subprocess, float64 parameters): 1 vs N devices or processes then differ only
# by the order of float64 reductions, which a bound can be derived for. In float32 they do not: Adam turns a gradient
# entry that cancels to ~0 into a step of about ±lr whose sign follows the reduction order, so which entries differ
# depends on the machine's rounding.
FLOAT64 = ["model.param_dtype=float64"]
FLOAT64_ENV = {"JAX_ENABLE_X64": "1"}


def saved_float64_state(workdir, step):
    """`saved_state` of a float64 run, as numpy arrays (read with float64 switched on for the read only)."""
    import jax

    with jax.enable_x64(True):
        return jax.tree.map(np.asarray, saved_state(workdir, step))


def assert_same_float64(a, b, what: str = "") -> None:
    """Two float64 parameter trees of one run on different meshes agree entry by entry to 1e-5 of the largest entry.
    The bound is the worst case of reduction order: a sum of n terms in another order differs by at most
    n·u·Σ|terms| (u = 1.1e-16, n <= 1e4 here: ~1e-12 of the gradients' scale G <= 1); Adam maps a gradient error
    δ to a step error of at most lr·δ/eps (|d/dg g/(|g|+eps)| <= 1/eps = 1e8), so 4 steps of the inner (lr 1e-2)
    and meta (lr 1e-3) optimizers move an entry by at most 4·1.1e-2·1e-12/1e-8 ~ 4.4e-6. Measured: 5e-13. A float32
    run's flipped entries (~lr = 1e-2) or a wrong sharding (O(1)) are far outside it."""
    floats = []
    for x, y in zip(leaves(a), leaves(b), strict=True):
        if np.issubdtype(x.dtype, np.integer):  # step counters
            np.testing.assert_array_equal(x, y)
            continue
        assert x.dtype == np.float64 and y.dtype == np.float64, (what, x.dtype, y.dtype)
        floats.append((x.ravel(), y.ravel()))
    x, y = (np.concatenate(v) for v in zip(*floats))
    worst = np.abs(x - y).max() / np.abs(x).max()
    assert worst <= 1e-5, f"{what}: entries differ by up to {worst:.2e} of the largest"


def metrics(workdir) -> list[dict]:
    """The training rows of a run's metrics.jsonl (not the evaluation rows)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "meta_grad_norm" in r]


def assert_same_first_meta_gradient(a, b) -> None:
    """The first outer step's meta-gradient norm of two float64 runs (the same state, before any meta-update) agrees
    to 1e-12 relative: one computation in another reduction order, n·u with n <= 1e4 (measured: 1.4e-14)."""
    x, y = metrics(a)[0], metrics(b)[0]
    assert x["step"] == y["step"] == 1
    assert abs(x["meta_grad_norm"] - y["meta_grad_norm"]) <= 1e-12 * abs(x["meta_grad_norm"]), (x, y)


class StoppedScoring:
    """A stand-in for `metatrain.scores.score_stream` (set it with monkeypatch): the real stream's documents, each
    one's offset added to `scored`; Ctrl-C (a KeyboardInterrupt) once `stop` documents were, if `stop` is given."""

    def __init__(self, real, scored: list, stop: int | None = None):
        self.real, self.scored, self.stop = real, scored, stop

    def __call__(self, *args):
        for item in self.real(*args):
            if len(self.scored) == self.stop:
                raise KeyboardInterrupt
            self.scored.append(item[0].offset)
            yield item


def cli_run(capsys, *argv) -> tuple[int, str, str]:
    """`metatrain ARGV...` in this process (`cli.main`): (exit code, stdout, stderr)."""
    from metatrain import cli

    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(err: str, *needles: str) -> None:
    """A CLI error as users must see it: one line, no traceback, saying each of `needles`."""
    lines = [line for line in err.strip().splitlines() if line.startswith("metatrain ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ---- tiny Hugging Face checkpoints, made with transformers (the `hf` test extra) ----------------------------------
HF_VOCAB = 320  # the model's vocabulary: larger than the tokenizer's 300, as in real checkpoints
HF_TEXT = [f"document {i}: the {w} quick brown fox jumps over the lazy dog, {i * 7 % 13} times; résumé"
           for i, w in enumerate(["red", "green", "blue", "small", "large", "old", "new"] * 20)]


def hf_tokenizer(directory) -> int:
    """A byte-level BPE of 300 tokens trained on HF_TEXT, saved in `directory`; returns its EOS id."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(HF_TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(directory)
    return tok.token_to_id("<|endoftext|>")


def make_hf_checkpoint(directory, kind: str = "llama", options: dict | None = None, seed: int = 0):
    """A tiny random `llama` or `qwen2` model (3 layers, d=64, noise on every weight) with its tokenizer, saved in
    `directory` as transformers saves it; returns the transformers model."""
    import torch
    import transformers

    eos = hf_tokenizer(directory)
    common = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                  vocab_size=HF_VOCAB, eos_token_id=eos, bos_token_id=eos, rms_norm_eps=1e-5)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, **(options or {})))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, **(options or {})))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model
