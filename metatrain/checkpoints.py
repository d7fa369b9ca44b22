"""A run's Orbax checkpoints: async saves that are never left half-written, and restore from the newest intact one.

- `save` skips a step that is already saved (a stop right after a periodic save), and `close` waits
  for every save in flight and shuts the async checkpointer down: the Trainer calls it on every exit
  path (the end, SIGTERM/SIGINT, a non-finite stop, any error).
- `restore` tries the newest checkpoint first. One whose layout differs from the run's state belongs
  to another configuration: that is refused naming the first differing entry. One that cannot be read
  (a truncated or zeroed file, a missing `_METADATA`) is damaged: it is moved aside to
  `checkpoints/damaged-<step>` with a line saying why, and the next older one is tried.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import warnings

import jax
import orbax.checkpoint as ocp

from metatrain import paths
from metatrain import workdir as workdir_lib
from metatrain.errors import ConfigError, DataError, TrainingError


def leaf_shapes(tree) -> dict[str, tuple]:
    """`{"meta/blocks/mlp/w_in/value": shape}`: nnx Variables (attribute `value`) and saved dicts (key `value`)
    read alike, so a run's abstract state and a checkpoint's metadata tree can be compared."""
    def name(path):
        return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)

    return {name(path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
            if hasattr(leaf, "shape")}


def first_layout_difference(saved, target, target_is: str = "this run") -> str | None:
    """The first parameter name or shape where `saved` (a checkpoint's metadata) and `target` differ, in words that
    call the target `target_is`; None where they agree."""
    have, want = leaf_shapes(saved), leaf_shapes(target)
    for key, shape in want.items():
        if key not in have:
            return f"{target_is} has {key}, the checkpoint does not"
        if have[key] != shape:
            return f"{key} has shape {have[key]} in the checkpoint, {shape} in {target_is}"
    extra = sorted(set(have) - set(want))
    return f"the checkpoint has {extra[0]}, {target_is} does not" if extra else None


class _NoItemMetadataFilter(logging.Filter):
    """Orbax warns that a checkpoint item has no `_CHECKPOINT_METADATA` each time one is read item by item: a
    CheckpointManager writes that file for the whole step only. Every read of a run's state said it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        # (and a damaged checkpoint's missing metadata, which `saved_tree` reports in its own words)
        return not ((message.startswith("Metadata file does not exist") and message.endswith("_CHECKPOINT_METADATA"))
                    or message.startswith("Failed to get item metadata from directory"))


logging.getLogger("absl").addFilter(_NoItemMetadataFilter())


def first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def saved_tree(state_dir: str) -> dict:
    """The metadata tree of a checkpoint's saved state; a DataError where it cannot be read."""
    metadata = ocp.PyTreeCheckpointer().metadata(state_dir).item_metadata
    if metadata is None:
        raise DataError(f"no metadata in {state_dir}")
    return metadata.tree


# What a failed read of a damaged checkpoint, or a failed write of one in flight (a full disk), leaves behind:
# TensorStore's other reads or writes fail too, or finish after Orbax closed the event loop they report to. Their
# errors surface one by one, as asyncio's "exception was never retrieved" and Orbax's (absl) log records, through
# `sys.unraisablehook` and through `sys.excepthook` (a callback into a closed loop), a traceback each, some of them
# after training resumed or at exit. The failure itself reaches the Trainer (a restore that raises; a save's
# `wait_until_finished`) and is said once, in one line; the stray errors are dropped: those that start like Orbax's
# (`_STRAY`), name a file of a checkpoint found damaged (`_DAMAGED`, its directory; TensorStore's own, e.g.
# "OUT_OF_RANGE: Error reading ... at local file <dir>/<step>/state/...") or of one being written (Orbax's temporary
# folders), and Orbax's own records of a background save that failed (`_SAVE_FAILED`).
_STRAY = ("Encountered error while reading", "Event loop is closed",
          "sys.meta_path is None, Python is likely shutting down")  # a failed write's coroutines, at exit
_WRITING = ".orbax-checkpoint-tmp"
_SAVE_FAILED = ("raised an exception", "in background save thread", "Save Finalize thread")
_DAMAGED: set[str] = set()


def _stray(text: str) -> bool:
    return text.startswith(_STRAY) or _WRITING in text or any(path in text for path in _DAMAGED)


def _from_failed_read(e: BaseException | None) -> bool:
    return e is not None and _stray(str(e))


class _FailedReadFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and _from_failed_read(record.exc_info[1]):
            return False
        message = record.getMessage()
        if f"{os.sep}orbax{os.sep}checkpoint{os.sep}" in record.pathname and record.levelno >= logging.ERROR \
                and any(what in message for what in _SAVE_FAILED):
            return False
        return not (_WRITING in message or any(path in message for path in _DAMAGED))


def _into_closed_loop(tb) -> bool:
    """Whether a traceback ends in asyncio refusing a callback because its loop is closed."""
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_name == "_check_closed"


def drop_stray_read_errors() -> None:
    """Drops the stray errors of failed reads and writes (see above) from now on; other unraisable exceptions, uncaught
    ones and log records go where they went. Called before a checkpoint is read or written: TensorStore's late reads
    can report to a closed event loop before the failed restore's exception reaches us."""
    for name in ("asyncio", "absl"):  # absl: Orbax's own threads log the failures they pass on
        if not any(isinstance(f, _FailedReadFilter) for f in logging.getLogger(name).filters):
            logging.getLogger(name).addFilter(_FailedReadFilter())
    if not getattr(sys.unraisablehook, "drops_failed_reads", False):  # ours, unless something replaced it since
        previous = sys.unraisablehook

        def hook(unraisable):
            if not _from_failed_read(unraisable.exc_value):
                previous(unraisable)

        hook.drops_failed_reads = True
        sys.unraisablehook = hook
    if not getattr(sys.excepthook, "drops_failed_reads", False):
        previous_except = sys.excepthook

        def excepthook(kind, value, tb):  # TensorStore's callbacks into Orbax's closed loop, printed from C++
            if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed" and _into_closed_loop(tb)):
                previous_except(kind, value, tb)

        excepthook.drops_failed_reads = True
        sys.excepthook = excepthook


def save_params(path: str, tree) -> None:
    """`tree` written as an Orbax checkpoint at `path` (an export's or an import's `params/`) and waited for. A write
    that fails (a full disk) raises its error once, without the stray tracebacks of its other writes."""
    drop_stray_read_errors()
    with ocp.StandardCheckpointer() as checkpointer:  # leaving the block waits for the async write
        checkpointer.save(path, tree, force=True)


def silence_failed_reads(checkpoint: str) -> None:
    """From the first failed read of `checkpoint` (a step's directory) on, the stray errors of the other reads are
    dropped (`drop_stray_read_errors`), also those naming its files; those already pending are collected now."""
    _DAMAGED.add(os.path.join(checkpoint, ""))
    drop_stray_read_errors()
    with warnings.catch_warnings():  # the failed read's tasks that never ran
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
        gc.collect()


class WriteFailed(TrainingError):
    """A checkpoint that could not be written (`Checkpoints._failed_save`)."""


class Checkpoints:
    def __init__(self, workdir: str, keep: int):
        self.workdir = workdir
        self.dir = workdir_lib.checkpoint_dir(workdir)
        self.manager = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True))
        self.last_saved = self.manager.latest_step()
        self.failed = False
        drop_stray_read_errors()  # a write that fails (a full disk) leaves stray errors too

    def save(self, step: int, items: dict) -> bool:
        """Start an async save of `items` (name -> Orbax save args) at `step`; False when `step` is already saved.
        A save that failed (the one in flight, which this waits for first) is a TrainingError (`_failed_save`)."""
        if step == self.last_saved:
            return False
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # noqa: BLE001 — a write that failed: one line, the half-written step removed
            self._failed_save(e)
        self.last_saved = step
        return True

    def _failed_save(self, error: Exception) -> None:
        """A checkpoint Orbax could not write (a full disk, a quota, a lost mount): its half-written folder removed,
        the stray errors of its other writes dropped, and one TrainingError line naming the newest intact one."""
        from etils import epath

        half = sorted(epath.Path(self.dir).glob(f"*{_WRITING}*"), key=lambda p: (len(p.name), p.name))
        for path in half:
            _DAMAGED.add(str(path))
        drop_stray_read_errors()
        if jax.process_index() == 0:
            for path in half:
                if paths.is_remote(str(path)):
                    with contextlib.suppress(Exception):  # else the next run's Orbax skips it
                        path.rmtree()
            # the failed save's other writes may still be landing
            paths.remove_settled(*(str(path) for path in half if not paths.is_remote(str(path))))
        self.failed = True
        text = str(error)
        reason = paths.refused_words(text) or ("Read-only file system" if "Read-only file system" in text else
                                               first_line(error))
        step = half[0].name.split(".")[0] if half else "?"
        latest = workdir_lib.latest_step(self.workdir)
        then = (f"checkpoint {latest} is the newest intact one: make room there (or lower keep_checkpoints) and run "
                f"again with --resume" if latest is not None else
                "no checkpoint was written before it: make room there and run the command again")
        raise WriteFailed(f"checkpoint {step} could not be written in {self.dir} ({reason}); {then}") from None

    def restore(self, state_target, other_items: dict, log=lambda line: print(line, file=sys.stderr)):
        """(step, restored Composite) from the newest intact checkpoint; `state_target` are ShapeDtypeStructs."""
        damaged = []
        drop_stray_read_errors()
        for step in sorted(self.manager.all_steps(), reverse=True):
            state_dir = os.path.join(self.dir, str(step), "state")
            try:
                saved = saved_tree(state_dir)
            except Exception as e:  # noqa: BLE001 — any unreadable checkpoint counts as damaged
                damaged.append((step, first_line(e)))
                continue
            difference = first_layout_difference(saved, state_target)
            if difference:
                raise ConfigError(f"workdir: {self.workdir} holds a run of another configuration ({difference}); "
                                  f"use a new workdir")
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(state_target), **other_items))
            except Exception as e:  # noqa: BLE001
                silence_failed_reads(os.path.join(self.dir, str(step)))
                damaged.append((step, first_line(e)))
                continue
            self._set_aside(damaged, log)
            if damaged:
                log(f"resuming from checkpoint {step}, the newest intact one")
            return step, restored
        self._set_aside(damaged, log)
        raise TrainingError(f"no intact checkpoint in {self.dir} ("
                            + "; ".join(f"{s}: {why}" for s, why in damaged) + "); start a new run in another workdir")

    def _set_aside(self, damaged: list, log) -> None:
        """Move damaged checkpoints to `damaged-<step>` (kept for a look, out of Orbax's way: a later save of
        the same step would otherwise find it taken)."""
        if not damaged:
            return
        if jax.process_index() == 0:
            from etils import epath

            for step, why in damaged:
                log(f"checkpoint {step} in {self.dir} is damaged ({why}); moved to damaged-{step}")
                src, dst = epath.Path(self.dir) / str(step), epath.Path(self.dir) / f"damaged-{step}"
                if dst.exists():
                    dst.rmtree()
                src.rename(dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("metatrain: damaged checkpoints set aside")
        self.manager.reload()
        self.last_saved = self.manager.latest_step()

    def close(self) -> None:
        """Wait for any save in flight, then shut the async checkpointer down (idempotent). A save that failed is a
        TrainingError (`_failed_save`), said once."""
        if self.manager is None:
            return
        manager, self.manager = self.manager, None
        try:
            if not self.failed:
                manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._failed_save(e)
        finally:
            try:
                manager.close()
            except Exception:  # noqa: BLE001 — the failed save again, said already
                if not self.failed:
                    raise
