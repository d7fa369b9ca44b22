"""The README and the docs run as a user runs them: the command blocks marked `<!-- test: NAME -->` (in README.md and
docs/*.md), as written, in bash, from a folder outside the checkout, with relative paths and `~`, on the package
built as a wheel and installed (not editable) in a virtual environment of its own.

Only the sizes change: a `metatrain` shell function puts tiny model and data overrides after the preset of every
`train` / `pretrain` (2 steps; a `steps=N` the README gives, as when a run is continued, becomes 4) and checks just
one variant in `check-grads`. Every marked block is run by a test here, so a block that stops working fails the
suite.
"""

import fcntl
import json
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_hf_checkpoint

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- test: (\S+) -->\n```(\w+)\n(.*?)```", re.S)
# the sizes of helpers.TINY (its default shuffle window included)
SMALL = ("model.n_layers=1 model.d_model=16 model.n_heads=2 model.d_ff=32 data.vocab_size=300 data.seq_len=16 "
         "data.batch=8 eval_batches=1 log_every=1")
PRELUDE = f"""set -euo pipefail
metatrain() {{
  local cmd="$1"; shift
  case "$cmd" in
    train|pretrain)
      local args=() steps=2 preset=()
      for a in "$@"; do case "$a" in steps=*) steps=4;; *) args+=("$a");; esac; done
      if [ ${{#args[@]}} -gt 0 ] && [[ "${{args[0]}}" != *=* && "${{args[0]}}" != -* ]]; then
        preset=("${{args[0]}}"); args=("${{args[@]:1}}")
      fi
      command metatrain "$cmd" "${{preset[@]}}" {SMALL} "steps=$steps" "${{args[@]}}";;
    check-grads) command metatrain "$cmd" "$@" --variants mixflow+remat+save;;
    *) command metatrain "$cmd" "$@";;
  esac
}}
"""


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def readme_blocks() -> dict[str, tuple[str, str]]:
    """The marked blocks of the README and the docs pages, by name (each name once)."""
    found = [block for page in PAGES for block in BLOCK.findall(page.read_text())]
    assert len({name for name, _, _ in found}) == len(found), "a block name is used twice"
    return {name: (lang, body) for name, lang, body in found}


SOURCES = ("pyproject.toml", "README.md", "metatrain", "models", "data", "launch", "configs")


def _install(root: Path) -> Path:
    """A virtual environment in `root` with metatrain installed from a wheel of this checkout (built from a copy of
    its sources, so nothing is written into the checkout). Its dependencies are this interpreter's (a .pth file
    points at them): nothing is downloaded, and nothing of the source tree is imported."""
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree
                                         else {}))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(root / "wheel"), str(src)], check=True, capture_output=True)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "metatrain_test_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    wheel = next((root / "wheel").glob("metatrain-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True)
    where = subprocess.run([python, "-c", "import metatrain.configs; print(metatrain.configs.__file__)"],
                           check=True, capture_output=True, text=True, cwd=root).stdout.strip()
    assert where.startswith(purelib), where  # the installed package, not the checkout
    return venv


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """The installed package's virtual environment, made once for all xdist workers."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "installed"
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "venv" / "bin" / "metatrain").exists():
            _install(root)
    return root / "venv"


def run(text: str, installed: Path, cwd: Path) -> subprocess.CompletedProcess:
    """`text` in bash (PRELUDE first) in `cwd`, with the installed package first on PATH and HOME at cwd/home."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{installed / 'bin'}:{env['PATH']}", HOME=str(cwd / "home"), JAX_PLATFORMS="cpu")
    res = subprocess.run(["bash", "-c", PRELUDE + text], cwd=cwd, env=env, capture_output=True, text=True)
    assert res.returncode == 0, f"failed:\n{text}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def run_block(name: str, installed: Path, cwd: Path) -> subprocess.CompletedProcess:
    lang, body = readme_blocks()[name]
    assert lang == "bash", name
    return run(body, installed, cwd)


def test_every_marked_block_has_a_test():
    here = Path(__file__).read_text()
    names = set(readme_blocks())
    assert {"quickstart", "training", "huggingface", "own-data", "task-module", "task-commands", "chat"} <= names
    assert all(f'"{name}"' in here for name in names)


def test_quickstart():
    """The first line installs and runs the main job, the second runs the suite. The install is the `installed`
    fixture's; the main job runs as the first line of the `training` block (`test_training` checks what it prints),
    so it is checked here to be that command, not run twice."""
    install, tests = readme_blocks()["quickstart"][1].strip().splitlines()
    assert install.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install ")
    assert tests == "python -m pytest"
    main_job = install.rsplit("&& ", 1)[1]
    assert main_job == "metatrain train"
    assert readme_blocks()["training"][1].splitlines()[0].split("#")[0].strip() == main_job


def test_training(installed, tmp_path):
    """The training block; its first line is the main job of the README's quickstart."""
    res = run_block("training", installed, tmp_path)
    runs = tmp_path / "runs"
    # the main job: its closing lines and its run report
    assert "corrupted-example AUC:" in res.stdout and "baseline validation loss:" in res.stdout
    assert re.search(r"\nvalidation loss: \d+\.\d+ -> \d+\.\d+\n", res.stdout)
    assert f"plot: {runs / 'default' / 'curves.png'}\n" in res.stdout
    assert "resuming the run in" in res.stdout and "from step 2" in res.stdout
    assert sorted(p.name for p in (runs / "default" / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    assert f"inner model from {runs / 'pretrain'}" in res.stdout
    assert (runs / "maml" / "curves.png").is_file() and (runs / "meta" / "params").is_dir()
    assert json.loads((runs / "meta" / "export.json").read_text())["what"] == "meta"


def test_huggingface(installed, tmp_path):
    """import hf from `~`, train from the relative export dir, export for transformers, which loads it."""
    transformers = pytest.importorskip("transformers", reason="the hf test extra is not installed")
    make_hf_checkpoint(tmp_path / "home" / "models" / "SmolLM2-135M")
    res = run_block("huggingface", installed, tmp_path)
    assert f"inner model from {tmp_path / 'runs' / 'smollm2'}" in res.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "smollm2-hf")
    assert type(model).__name__ == "LlamaForCausalLM"


def test_chat(installed, tmp_path):
    """Chat data and a trusted set, generation before and after LoRA fine-tuning, the adapters loaded by peft, on a
    tiny model whose tokenizer has a ChatML template."""
    pytest.importorskip("peft", reason="the hf test extra is not installed")
    from metatrain.data.chat_data import CHATML

    model = tmp_path / "home" / "models" / "SmolLM2-135M-Instruct"
    make_hf_checkpoint(model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    res = run_block("chat", installed, tmp_path)
    assert (tmp_path / "chat" / "trusted.jsonl").is_file()
    assert "inner model from" in res.stdout and re.search(r"\nvalidation loss: \d+\.\d+ -> \d+\.\d+\n", res.stdout)
    assert (tmp_path / "runs" / "chat-adapters" / "adapter_model.safetensors").is_file()
    assert "PeftModelForCausalLM loaded the adapters" in res.stdout


def test_own_data(installed, tmp_path):
    pytest.importorskip("transformers", reason="the hf test extra is not installed")
    shutil.copytree(ROOT / "examples", tmp_path / "examples")  # a user who cloned the repository has them
    res = run_block("own-data", installed, tmp_path)
    auc = float(re.search(r"ROC AUC of -score: (\d\.\d+)", res.stdout).group(1))
    assert 0.0 <= auc <= 1.0
    assert re.search(r"inner model \(fine-tuned\) +loss \d", res.stdout)
    diff = float(re.search(r"max \|logits - metatrain's\| = (\S+)", res.stdout).group(1))
    assert diff < 1e-4  # transformers and metatrain agree on the exported model (float32 logits of a tiny model)
    with open(tmp_path / "runs" / "own" / "scores.jsonl") as f:
        assert sum(1 for _ in f) == sum(1 for _ in open(tmp_path / "runs" / "own" / "inner.jsonl"))


def test_defining_a_task(installed, tmp_path):
    """The README's task module copied verbatim into the file its first line names, then its commands."""
    lang, module = readme_blocks()["task-module"]
    assert lang == "python"
    name = module.splitlines()[0].removeprefix("# ").strip()
    (tmp_path / name).write_text(module)
    res = run_block("task-commands", installed, tmp_path)
    assert "variants within tolerance" in res.stdout and "\nvalidation loss: " in res.stdout
