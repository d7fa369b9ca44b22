"""The `metatrain` command line: meta-training, pretraining, export, gradient checks, benchmarks, data.

Each command group registers its own subcommands (`run`, `check`, `bench`, `data`). A problem with the
user's input (`MetatrainError`: a config field, a task, a data source, a work dir) is printed as one
line naming what to change, with exit code 2, and so are XLA running out of memory while a program runs and a
write that a full disk refused; anything else keeps its traceback. SIGTERM (a scheduler, `timeout`, `docker
stop`) and SIGHUP (a terminal closed, unless under `nohup`) stop a command as Ctrl-C does (`stops`): what it was
writing is cleaned up, and it exits 128 + the signal's number. An output whose reader is gone (`| head`, a dropped
ssh connection) is discarded from then on, never a reason to fail (`streams`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
import warnings
from importlib.metadata import PackageNotFoundError, version

from metatrain import argtypes, collector, platforms, streams
from metatrain.errors import MetatrainError, RenamedWarning, StoppedBySignal

with collector.paused():  # importing the commands' libraries (JAX, Flax, Orbax, ...) leaves nothing to collect
    from metatrain.cli import bench, check, data, experiment, generate, run

GROUPS = (run, check, bench, data, experiment, generate)


def freeze_imported() -> None:
    """Moves every object alive now (the modules imported so far: JAX, Flax, Optax, Orbax, ...) out of the garbage
    collector's reach, for a process about to run one command, and makes its full collections rarer
    (`metatrain.collector.freeze`)."""
    collector.freeze()


def _version() -> str:
    try:
        return version("metatrain")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "(not installed: run from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metatrain", description=__doc__.split("\n\n")[0],
                                     epilog="`metatrain COMMAND --help` for each command's flags; "
                                            "`python -m metatrain.reference` for every config key")
    parser.add_argument("--version", action="version", version=f"metatrain {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # a missing command is named by its choices, not "command"
    _describe(sub)
    for name, command in sub.choices.items():  # `bench memory`, `data stats`, ...: named in full, as argparse does
        command.set_defaults(command_parser=command)
        argtypes.refuse_empty(command)
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                action.metavar = "{" + ",".join(action.choices) + "}"
                _describe(action)
                for leaf, leaf_parser in action.choices.items():
                    leaf_parser.set_defaults(command_name=f"{name} {leaf}", command_parser=leaf_parser)
                    argtypes.refuse_empty(leaf_parser)
    return parser


def _describe(sub: argparse._SubParsersAction) -> None:
    """Each command's `--help` opens with what it does: the line the command list gives it, where the command has
    no description of its own."""
    for choice in sub._choices_actions:
        command = sub.choices[choice.dest]
        if command.description is None and choice.help:
            text = choice.help[0].upper() + choice.help[1:]
            command.description = text if text.endswith((".", "?")) else text + "."


def _stopped(command: str, stop: KeyboardInterrupt) -> int:
    signum = getattr(stop, "signum", signal.SIGINT)
    note = getattr(stop, "note", "")  # what a command that can continue kept, and how
    print(f"metatrain {command}: stopped by {signal.Signals(signum).name}{'; ' * bool(note)}{note}", file=sys.stderr)
    return 128 + signum


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT, raised where the program is (as SIGINT raises KeyboardInterrupt), so that the same clean-up
    runs."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__()
        self.signum = signum


_stopping: list[int] = []  # the signal that stops the running command, until `main` has caught it
_command: list[str] = []  # the running command's name (`bench memory`), as its stop lines say it
_deferred: list[bool] = []  # a stop waits for a compile, said once


def _running() -> str:
    """`metatrain COMMAND`, the running command as its stop lines name it."""
    return f"metatrain {_command[0] if _command else ''}".rstrip()


def _compiling(frame) -> bool:
    """Whether the main thread is waiting for XLA to compile a program: cut there, the compile goes on in XLA's
    threads while the interpreter shuts down, and crashes it (a segmentation fault instead of the exit code)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "backend_compile_and_load" and "jax" in code.co_filename or \
                code.co_name == "_wait_for_compile" and code.co_filename.endswith(os.path.join("metatrain", "aot.py")):
            return True  # JAX's compile call, or `aot.compile` waiting for its thread
        frame = frame.f_back
    return False


def _stop(signum, frame):
    if _stopping and _compiling(frame):  # a second stop while XLA compiles: at once, as a kill would
        _exit_now(signum)
    _stopping[:] = [signum]
    _again(signum, frame)


def _again(_signum, frame):
    """Raises the stop where the program is; while XLA compiles, 50 ms later (SIGALRM) instead, having said once that
    it waits (a compile of a large model takes minutes) and that a second stop ends the command at once."""
    if _stopping:
        if _compiling(frame):
            if not _deferred:
                _deferred.append(True)
                name = signal.Signals(_stopping[0]).name
                print(f"{_running()}: {name}: stopping once XLA has compiled the program in progress (a compile "
                      "cannot be cut); a second SIGINT or SIGTERM stops at once, without cleaning up", file=sys.stderr,
                      flush=True)
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            return
        raise Stopped(_stopping[0])


def _exit_now(signum: int) -> None:
    """Ends the process at once with 128 + `signum`, while XLA compiles: `os._exit`, which neither shuts the
    interpreter down (it would crash on the compile going on in XLA's threads) nor runs any clean-up."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        print(f"{_running()}: stopped by {signal.Signals(signum).name} at once, while XLA compiled; nothing was "
              "cleaned up", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def _raise_dropped_stops_again(previous):
    """A `sys.unraisablehook` for a stop that Python dropped: one raised in a gc callback (JAX has one) or a
    finalizer cannot leave it, and the command would run on. It is raised again 10 ms later (SIGALRM), in the code
    running then; anything else goes to `previous`."""
    def hook(unraisable):
        if _stopping and isinstance(unraisable.exc_value, KeyboardInterrupt):
            signal.setitimer(signal.ITIMER_REAL, 0.01)
        else:
            previous(unraisable)
    return hook


def _stop_behind(error: BaseException) -> KeyboardInterrupt | None:
    """The stop (Ctrl-C, SIGTERM) that `error` was raised while handling, if any: a signal raised in the middle of a
    library's clean-up (a context manager's `__exit__` restoring its state) can make that clean-up fail in turn."""
    seen = error.__context__
    while seen is not None and not isinstance(seen, KeyboardInterrupt):
        seen = seen.__context__
    return seen


# how a command that takes --resume continues after a failed write, by command
RESUMES = {"train": "the run from its last checkpoint, if it saved one",
           "pretrain": "the run from its last checkpoint, if it saved one",
           "bench": "with the rows already measured"}


def _out_of_room(error: BaseException, command: str = "") -> str | None:
    """One line for XLA running out of device (or host) memory while a program runs, or for a write that a full disk
    (a quota, a file size limit) refused, else None. `command`: the one that ran (the hint names its --resume, if it
    has one)."""
    again = "make room there and run again"
    if command in RESUMES:
        again += f" (with --resume to continue {RESUMES[command]})"
    from metatrain.paths import REFUSED_ERRNOS, refused_words

    if isinstance(error, OSError) and error.errno in REFUSED_ERRNOS:
        return f"writing {error.filename or 'a file'} failed ({error.strerror}); {again}"
    text = str(error)
    why = refused_words(text)
    if why:  # TensorStore's (Orbax's writes): "... Error writing local file \"PATH\": ... No space left on device"
        file = re.search(r'local file "([^"]+)"', text) or re.search(r'Failed writing:? "([^"]+)"', text)
        return f"writing {file.group(1) if file else 'a file'} failed ({why}); {again}"
    if type(error).__name__ not in ("JaxRuntimeError", "XlaRuntimeError") or "RESOURCE_EXHAUSTED" not in text:
        return None
    said = " ".join(text.split("RESOURCE_EXHAUSTED:", 1)[1].split())[:200]
    return (f"out of memory ({said}); use smaller batches, shorter sequences or a smaller model (`metatrain bench "
            f"memory` compares the settings that need less)")


@contextlib.contextmanager
def _renames_said():
    """Inside, each `RenamedWarning` (an old name given: a key, a flag, a variant) is one line on stderr,
    `metatrain COMMAND: warning: ...`, once per message; other warnings are shown as Python shows them. Yields a
    one-item list: the start of those lines, the command's name once it is known."""
    prefix, said = ["metatrain"], set()
    with warnings.catch_warnings():
        warnings.simplefilter("always", RenamedWarning)
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if not issubclass(category, RenamedWarning):
                return shown(message, category, filename, lineno, file, line)
            if str(message) not in said:
                said.add(str(message))
                print(f"{prefix[0]}: warning: {message}", file=sys.stderr)

        warnings.showwarning = show
        yield prefix


def main(argv=None) -> int:
    with _renames_said() as prefix, streams.kept(prefix):
        return _main(argv, prefix)


def _named(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    """The command `argv` names (`train`, `bench memory`), read before parsing: what an old name's warning line
    starts with while the flags are parsed."""
    words = []
    for token in argv:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None:
            break
        if token in sub.choices:
            words.append(token)
            parser = sub.choices[token]
    return " ".join(["metatrain", *words])


def _main(argv, prefix: list[str]) -> int:
    parser = build_parser()
    prefix[0] = _named(parser, sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, with its usage (the top-level one said "metatrain: error:")
        said = " ".join(repr(a) if not a.strip() else a for a in unknown)  # '' would say nothing
        if any(not a.strip() for a in unknown):
            said += " (an empty argument, as an unset shell variable leaves it)"
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {said}")
    name = getattr(args, "command_name", args.command)  # `bench memory`, as argparse's own errors name it
    prefix[0] = f"metatrain {name}"
    handled = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if handled:
        _command[:], _deferred[:] = [name], []
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _stop),
                    signal.SIGALRM: signal.signal(signal.SIGALRM, _again)}
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, _stop)
        if signal.getsignal(signal.SIGHUP) == signal.SIG_DFL:  # a terminal closed; `nohup` leaves it ignored
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, _stop)
        unraisable = sys.unraisablehook
        sys.unraisablehook = ours = _raise_dropped_stops_again(unraisable)
    try:
        topology, backend = getattr(args, "topology", None), getattr(args, "backend", None)
        if topology or backend not in (None, "cpu"):
            # ahead of time, checked before the command's first line: --topology's spelling and the compiler it needs
            # (a --backend that disagrees with it is refused by the command, naming both)
            from metatrain import aot

            if topology:
                aot.check_topology(topology)
            want = aot.topology_backend(topology) or backend
            if backend in (None, want):
                aot.check_compiler(want, f"--topology {topology!r}" if topology else f"--backend {backend}")
            if "JAX_PLATFORMS" not in os.environ and not platforms.backends_started():
                # no accelerator backend is needed, and JAX's CUDA plugin registers itself without a GPU only where
                # JAX is kept to the CPU (else it stops at its CUDA checks)
                platforms.use_cpu()
        if getattr(args, "json", None):  # every command's --json: checked (its folder made) before any work
            from metatrain import paths

            args.json = paths.output_file(args.json, "--json")
        return args.fn(args)
    except MetatrainError as e:
        said = " ".join(str(e).split())
        for prefix in (f"{name}: ", f"{args.command}: "):  # the library's own prefix (for Python callers), said once
            said = said.removeprefix(prefix)
        if isinstance(e, StoppedBySignal):  # a run saved and stopped: as every stopped command, not an error
            print(f"metatrain {name}: {said}", file=sys.stderr)
            return 128 + e.signum
        print(f"metatrain {name}: error: {said}", file=sys.stderr)
        return 2
    except Exception as e:
        stop = _stop_behind(e)
        if stop is None:
            said = _out_of_room(e, args.command if getattr(args, "resume", None) is not None else "")
            if said is None:
                raise
            print(f"metatrain {name}: error: {said}", file=sys.stderr)
            return 2
        return _stopped(name, stop)
    except KeyboardInterrupt as e:
        return _stopped(name, e)
    finally:
        if handled:
            _stopping.clear()
            _command.clear()
            _deferred.clear()
            signal.setitimer(signal.ITIMER_REAL, 0)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if sys.unraisablehook is ours:  # else another hook wraps it since (ours then passes everything on)
                sys.unraisablehook = unraisable
