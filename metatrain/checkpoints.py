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

import gc
import logging
import os
import sys
import warnings

import jax
import orbax.checkpoint as ocp

from metatrain import workdir as workdir_lib
from metatrain.errors import ConfigError, DataError, TrainingError


def leaf_shapes(tree) -> dict[str, tuple]:
    """`{"meta/blocks/mlp/w_in/value": shape}`: nnx Variables (attribute `value`) and saved dicts (key `value`)
    read alike, so a run's abstract state and a checkpoint's metadata tree can be compared."""
    def name(path):
        return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)

    return {name(path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
            if hasattr(leaf, "shape")}


def first_layout_difference(saved, target) -> str | None:
    have, want = leaf_shapes(saved), leaf_shapes(target)
    for key, shape in want.items():
        if key not in have:
            return f"the run's state has {key}, the checkpoint does not"
        if have[key] != shape:
            return f"{key} has shape {have[key]} in the checkpoint, {shape} in this run"
    extra = sorted(set(have) - set(want))
    return f"the checkpoint has {extra[0]}, this run's state does not" if extra else None


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


# What a failed read of a damaged checkpoint leaves behind: TensorStore's other reads of it fail too, or finish after
# Orbax closed the event loop they report to. Their errors surface one by one, as asyncio's "exception was never
# retrieved" log records and through `sys.unraisablehook`, a traceback each, some of them after training resumed. The
# failure is reported once, in one line: errors that start like Orbax's (`_FAILED_READ`) or name a file of a checkpoint
# found damaged (`_DAMAGED`, its directory; TensorStore's own, e.g. "OUT_OF_RANGE: Error reading ... at local file
# <dir>/<step>/state/...") are dropped.
_FAILED_READ = ("Encountered error while reading", "Event loop is closed")
_DAMAGED: set[str] = set()


def _from_failed_read(e: BaseException | None) -> bool:
    if e is None:
        return False
    text = str(e)
    return text.startswith(_FAILED_READ) or any(path in text for path in _DAMAGED)


class _FailedReadFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _from_failed_read(record.exc_info[1]))


def drop_stray_read_errors() -> None:
    """Drops the stray errors of failed reads (those `_FAILED_READ` starts and those naming a damaged checkpoint) from
    now on; other unraisable exceptions and asyncio records go where they went. Called before a checkpoint is read:
    TensorStore's late reads can report to a closed event loop before the failed restore's exception reaches us."""
    if not any(isinstance(f, _FailedReadFilter) for f in logging.getLogger("asyncio").filters):
        logging.getLogger("asyncio").addFilter(_FailedReadFilter())
    if not getattr(sys.unraisablehook, "drops_failed_reads", False):  # ours, unless something replaced it since
        previous = sys.unraisablehook

        def hook(unraisable):
            if not _from_failed_read(unraisable.exc_value):
                previous(unraisable)

        hook.drops_failed_reads = True
        sys.unraisablehook = hook


def silence_failed_reads(checkpoint: str) -> None:
    """From the first failed read of `checkpoint` (a step's directory) on, the stray errors of the other reads are
    dropped (`drop_stray_read_errors`), also those naming its files; those already pending are collected now."""
    _DAMAGED.add(os.path.join(checkpoint, ""))
    drop_stray_read_errors()
    with warnings.catch_warnings():  # the failed read's tasks that never ran
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
        gc.collect()


class Checkpoints:
    def __init__(self, workdir: str, keep: int):
        self.workdir = workdir
        self.dir = workdir_lib.checkpoint_dir(workdir)
        self.manager = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True))
        self.last_saved = self.manager.latest_step()

    def save(self, step: int, items: dict) -> bool:
        """Start an async save of `items` (name -> Orbax save args) at `step`; False when `step` is already saved."""
        if step == self.last_saved:
            return False
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self.last_saved = step
        return True

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
        """Wait for any save in flight, then shut the async checkpointer down (idempotent)."""
        if self.manager is not None:
            self.manager.wait_until_finished()
            self.manager.close()
            self.manager = None
