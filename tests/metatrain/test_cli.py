"""The command line: its signal handling where Python drops the exception a signal raises; its help page."""

import argparse
import io
import os
import signal
import sys
import time

import pytest

from metatrain import cli


def _commands(monkeypatch, **commands):
    """`cli.main` runs these commands (name -> fn) instead of metatrain's."""
    parser = argparse.ArgumentParser(prog="metatrain")
    sub = parser.add_subparsers(dest="command")
    for name, fn in commands.items():
        sub.add_parser(name).set_defaults(fn=fn)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)


class SignalledInAFinalizer:
    """Sends SIGTERM to this process from its finalizer: the handler's exception is raised there, where Python can
    only drop it (as in JAX's gc callback)."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)


def test_a_stop_dropped_in_a_finalizer_still_stops_the_command(monkeypatch, capsys):
    finished = []

    def command(args):
        SignalledInAFinalizer()  # finalized at once
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.01)
        finished.append(True)
        return 0

    _commands(monkeypatch, slow=command)
    started = time.monotonic()
    assert cli.main(["slow"]) == 128 + signal.SIGTERM
    assert not finished and time.monotonic() - started < 5
    assert capsys.readouterr().err.strip().splitlines()[-1] == "metatrain slow: stopped by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


class FailsWhenInterrupted:
    """A library's context manager whose clean-up fails when a signal interrupted its block (as Flax's
    `split_rngs` did with SIGTERM during a model's init: "'RngStream' object has no attribute 'key'")."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        raise AttributeError("'RngStream' object has no attribute 'key'")


def test_a_stop_that_breaks_a_librarys_clean_up_still_stops_the_command(monkeypatch, capsys):
    def command(args):
        with FailsWhenInterrupted():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        return 0

    def broken(args):
        with FailsWhenInterrupted():
            pass

    _commands(monkeypatch, init=command, broken=broken)
    assert cli.main(["init"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines()[-1] == "metatrain init: stopped by SIGTERM"
    with pytest.raises(AttributeError):  # without a stop, an error in clean-up is a bug: its traceback stays
        cli.main(["broken"])


def test_a_stop_waits_for_the_xla_compile_in_flight(monkeypatch, capsys):
    """A stop that comes while XLA compiles is raised once the compile returns: cut there, the compile went on in
    XLA's threads while the interpreter shut down and crashed it (exit 139 instead of 143; `metatrain filter` sent
    SIGTERM 1.4-1.6 s after its start, 7 of 12 times). JAX's compile call is stood in for by a function of that name
    in a file of jax."""
    namespace = {"os": os, "signal": signal, "time": time}
    exec(compile("def backend_compile_and_load(done):\n"
                 "    os.kill(os.getpid(), signal.SIGTERM)\n"
                 "    deadline = time.monotonic() + 0.3\n"
                 "    while time.monotonic() < deadline:\n"
                 "        pass\n"
                 "    done.append(True)\n", os.path.join("site-packages", "jax", "_src", "compiler.py"), "exec"),
         namespace)
    compiled, after = [], []

    def command(args):
        namespace["backend_compile_and_load"](compiled)
        time.sleep(5)
        after.append(True)
        return 0

    _commands(monkeypatch, fit=command)
    assert cli.main(["fit"]) == 128 + signal.SIGTERM
    assert compiled == [True] and after == []
    assert capsys.readouterr().err.strip().splitlines()[-1] == "metatrain fit: stopped by SIGTERM"


class _Exited(BaseException):
    """`os._exit`, stood in for: the code it was given."""


def test_a_second_stop_while_xla_compiles_ends_the_command_at_once(monkeypatch, capsys):
    """The first stop that comes while XLA compiles says that the command stops once the compile returns (a large
    model's compile takes minutes: SIGTERM to `compile --model 1b` for a TPU chip ended it 58 s later, and nothing
    said why); a second one ends it at once through `os._exit`, which does not shut the interpreter down (the compile
    going on in XLA's threads would crash it). JAX's compile call is stood in for as above."""
    namespace = {"os": os, "signal": signal, "time": time}
    exec(compile("def backend_compile_and_load(done):\n"
                 "    for wait in (0.2, 5):\n"
                 "        os.kill(os.getpid(), signal.SIGTERM)\n"
                 "        deadline = time.monotonic() + wait\n"
                 "        while time.monotonic() < deadline:\n"
                 "            pass\n"
                 "    done.append(True)\n", os.path.join("site-packages", "jax", "_src", "compiler.py"), "exec"),
         namespace)
    compiled = []

    def exit_now(code):
        raise _Exited(code)

    _commands(monkeypatch, fit=lambda args: namespace["backend_compile_and_load"](compiled))
    monkeypatch.setattr(os, "_exit", exit_now)
    tic = time.monotonic()
    with pytest.raises(_Exited) as e:
        cli.main(["fit"])
    assert e.value.args == (128 + signal.SIGTERM,) and compiled == [] and time.monotonic() - tic < 4
    said = capsys.readouterr().err.strip().splitlines()
    assert said == ["metatrain fit: SIGTERM: stopping once XLA has compiled the program in progress (a compile cannot "
                    "be cut); a second SIGINT or SIGTERM stops at once, without cleaning up",
                    "metatrain fit: stopped by SIGTERM at once, while XLA compiled; nothing was cleaned up"]


def test_a_compile_of_minutes_hears_a_stop_while_it_runs(monkeypatch, capsys):
    """`aot.compile` compiles on a thread of its own while the main thread waits in Python: a stop's handler runs
    during the compile (on the main thread, a compile of a 1b model for a TPU chip heard two SIGTERMs only when it
    returned, 58 s later). A one-line wait, then the second stop ends the command at once; a single stop, once the
    compile has returned."""
    from metatrain import aot

    class Lowered:
        def __init__(self, stops: int):
            self.stops, self.compiled = stops, []

        def compile(self, compiler_options=None):
            for _ in range(self.stops):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.3)
            time.sleep(1.5)
            self.compiled.append(True)
            return "executable"

    def exit_now(code):
        raise _Exited(code)

    twice, once, after = Lowered(2), Lowered(1), []
    _commands(monkeypatch, twice=lambda args: aot.compile(twice),
              once=lambda args: (aot.compile(once), time.sleep(5), after.append(True)))
    monkeypatch.setattr(os, "_exit", exit_now)
    with pytest.raises(_Exited) as e:
        cli.main(["twice"])
    assert e.value.args == (128 + signal.SIGTERM,) and twice.compiled == []
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("metatrain twice: stopped by SIGTERM at once, while "
                                                                "XLA compiled; nothing was cleaned up")
    assert cli.main(["once"]) == 128 + signal.SIGTERM
    assert once.compiled == [True] and after == []
    said = capsys.readouterr().err.strip().splitlines()
    assert said[0].startswith("metatrain once: SIGTERM: stopping once XLA has compiled") and \
        said[-1] == "metatrain once: stopped by SIGTERM"


def test_an_error_names_its_command_once(monkeypatch, capsys):
    """The library prefixes some errors with the command for Python callers ("scores: ..."); the command line names
    the command already ("metatrain scores: error:") and leaves that prefix out."""
    from metatrain.errors import ConfigError, DataError

    def scores(args):
        raise DataError("scores: data.jsonl holds no documents")

    def generate(args):
        raise ConfigError("generate --what inner: run is a pretrain run")  # a flag named: kept

    _commands(monkeypatch, scores=scores, generate=generate)
    assert cli.main(["scores"]) == 2
    assert capsys.readouterr().err == "metatrain scores: error: data.jsonl holds no documents\n"
    assert cli.main(["generate"]) == 2
    assert capsys.readouterr().err == "metatrain generate: error: generate --what inner: run is a pretrain run\n"


@pytest.mark.parametrize("argv, says", [
    (["data", "make-noisy", "--out", "n", "--fraction", "2"],
     "metatrain data make-noisy: error: unrecognized arguments: --fraction 2"),
    (["eval", "run", "--batches", "0"], "metatrain eval: error: unrecognized arguments: --batches 0"),
])
def test_an_unknown_flag_is_named_by_its_commands_parser(argv, says, capsys):
    """argparse's top-level parser said "metatrain: error: unrecognized arguments", with the top-level usage."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1] == says and err[0].startswith(f"usage: metatrain {argv[0]}"), err


EMPTY = "empty (as an unset shell variable leaves it)"


@pytest.mark.parametrize("argv, says", [
    # a traceback (FileNotFoundError: '')
    (["data", "make-noisy", "--out", ""], f"argument --out: {EMPTY}; give one"),
    (["data", "make-chat", "--out", ""], f"argument --out: {EMPTY}; give one"),
    # the default instead: the run's own data, its scores.jsonl, its export dir, the built-in corpus
    (["scores", "run", "--data", "", "--out", "s.jsonl"], f"argument --data: {EMPTY}; give one, or leave out --data "
                                                          "for its default"),
    (["scores", "run", "--out", ""], f"argument --out: {EMPTY}; give one, or leave out --out for its default"),
    (["export", "run", "--out", ""], f"argument --out: {EMPTY}"),
    (["data", "stats", "--source", ""], f"argument --source: {EMPTY}"),
    # the flags' problem (MAML, 44m) compiled instead of a run config
    (["compile", "--config", ""], f"argument --config: {EMPTY}"),
    # an empty preset ran the default one
    (["train", "", "steps=1"], f"argument PRESET|KEY=VALUE: {EMPTY}; give one, or leave it out"),
    (["pretrain", ""], f"argument PRESET|KEY=VALUE: {EMPTY}"),
    # a path named '': "no such directory", "has no metrics.jsonl", "config.json not found"
    (["eval", ""], f"argument RUN: {EMPTY}; give one"),
    (["plot", ""], f"argument WORKDIR: {EMPTY}"),
    (["import", "hf", "", "--out", "x"], f"argument DIR: {EMPTY}"),
    (["experiment", "curation", ""], f"argument DIR: {EMPTY}"),
    # an empty list checked every variant, as if --variants were not given (then: "unknown mode ''")
    (["check-grads", "--variants", ""], f"argument --variants: {EMPTY}"),
    # one of a required pair: no default to fall back on
    (["generate", "run", "--prompts", ""], f"argument --prompts: {EMPTY}; give one"),
    # a command without positional arguments: "unrecognized arguments: " and nothing after it
    (["bench", "time", "--model", "tiny", ""], "unrecognized arguments: '' (an empty argument, as an unset shell "
                                               "variable leaves it)"),
])
def test_an_empty_argument_is_refused_before_any_work(argv, says, capsys, tmp_path, monkeypatch):
    """An argument given as '' (`--out "$OUT"` with OUT unset) is one line naming it, before anything is read or
    written: it stood for the argument's default, or for a path named ''."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    name = " ".join(argv[:2]) if argv[0] in ("data", "import", "experiment", "bench") else argv[0]
    assert e.value.code == 2 and err[-1].startswith(f"metatrain {name}: error: {says}"), err
    assert "Traceback" not in "\n".join(err) and not list(tmp_path.iterdir())


def test_version_and_a_missing_command_named_by_its_choices(capsys, monkeypatch):
    """There was no --version; a missing command was "the following arguments are required: command" ("bench" for
    `metatrain bench`)."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"metatrain {version('metatrain')}\n"
    # a source tree on PYTHONPATH, never installed: every command still runs
    from importlib.metadata import PackageNotFoundError

    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(cli, "version", missing)
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert capsys.readouterr().out == "metatrain (not installed: run from a source tree)\n"
    for argv, choices in (([], "{train,pretrain,"), (["bench"], "{memory,time,generate,fit}")):
        with pytest.raises(SystemExit):
            cli.main(argv)
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith(f"metatrain{' ' * bool(argv)}{' '.join(argv)}: error: the following arguments are "
                               f"required: {choices}"), last


def test_the_top_level_help_points_only_at_what_an_installed_package_has():
    """`metatrain --help` names no file of the source tree (a wheel has no README.md), and each `python -m MODULE` it
    names is a module of the package."""
    import importlib.util
    import re

    epilog = cli.build_parser().epilog
    assert not re.search(r"\w+\.(md|txt|rst)\b", epilog), epilog
    modules = re.findall(r"python -m ([\w.]+)", epilog)
    assert modules and all(importlib.util.find_spec(m) for m in modules), modules


def test_the_help_page_holds_every_commands_help_at_its_own_width(monkeypatch):
    """docs/cli.md's sections (written when the site is built): one per command and launcher, each the command's
    `--help`, wrapped at the page's width whatever the terminal of the machine that builds the site."""
    import re

    from metatrain.cli import help_page
    from metatrain.launch import local

    monkeypatch.setenv("COLUMNS", "40")
    page = help_page.markdown()
    assert os.environ["COLUMNS"] == "40"
    monkeypatch.setenv("COLUMNS", "300")
    assert help_page.markdown() == page
    titles = re.findall(r"(?m)^#+ `(.*)`$", page)
    assert titles[:3] == ["metatrain", "metatrain train", "metatrain pretrain"]
    assert {"metatrain bench memory", "metatrain data make-chat", "metatrain experiment curation",
            "metatrain import hf", "python -m metatrain.launch.local", "python -m metatrain.launch.tpu"} <= set(titles)
    for title in titles:
        assert f"usage: {title} [-h]" in page or f"usage: {title}\n" in page, title
    commands_part = page.split("## `python -m")[0]  # the launchers print their docstrings as written
    wrapped = [line for line in commands_part.splitlines() if len(line) > help_page.WIDTH and "{" not in line]
    assert not wrapped, wrapped  # only argparse's unbreakable lists of choices are wider
    commands = [title for title in titles if title.startswith("metatrain ")]
    assert commands == [f"metatrain {' '.join(path)}" for path in _command_paths(cli.build_parser())]
    assert "--processes PROCESSES" in page and "--grace GRACE" in page and local.__doc__.split("\n")[0] in page


def _command_paths(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                yield [*path, name]
                yield from _command_paths(command, [*path, name])


@pytest.mark.parametrize("reader", ["pipe", "terminal"])
def test_an_output_whose_reader_is_gone_is_discarded_and_said_once(monkeypatch, reader):
    """`metatrain ... | head`, or a `tee` stopped by the same Ctrl-C (a pipe), or a terminal that hung up: the next
    write raised BrokenPipeError (EIO) wherever it was (a progress bar in a run's clean-up) and ended the command with
    a traceback. Its stdout is now /dev/null from then on (the descriptor too, which C code writes to), the command
    goes on, and stderr says so once."""
    read, write = os.pipe() if reader == "pipe" else os.openpty()  # a terminal: (its master, its slave)
    out, err = open(write, "w"), io.StringIO()  # noqa: SIM115
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    finished = []

    def command(args):
        os.close(read)  # while it runs, the reader goes: a pipe's read end, a terminal's master
        print("x" * 100_000)  # more than a pipe holds: written at once
        print("more", flush=True)
        os.write(write, b"from C\n")  # the descriptor goes to /dev/null too
        finished.append(True)
        return 0

    _commands(monkeypatch, talk=command)
    assert cli.main(["talk"]) == 0 and finished
    why = "Broken pipe" if reader == "pipe" else "Input/output error"
    assert err.getvalue() == (f"metatrain talk: warning: standard output has no reader any more ({why}): the "
                              "rest of it is discarded\n")
    assert sys.stdout is out
    out.close()


def test_an_output_on_a_full_disk_is_an_error_that_names_it(monkeypatch, capsys):
    """`metatrain train > log` on a full disk (here /dev/full): one line naming standard output, exit 2 (it said
    "writing a file failed")."""
    full = open("/dev/full", "w")  # noqa: SIM115 — every write: ENOSPC
    monkeypatch.setattr(sys, "stdout", full)

    def command(args):
        print("a line", flush=True)
        return 0

    _commands(monkeypatch, talk=command)
    assert cli.main(["talk"]) == 2
    assert capsys.readouterr().err == ("metatrain talk: error: writing standard output failed (No space left on "
                                       "device); make room there and run again\n")
