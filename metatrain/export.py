"""Parameters out of a run: `export` writes a run's meta-parameters (or a pretrain run's parameters)
alone; `load_params` reads a pretrained model for `inner.init_from`.

An export directory holds `params/` (an Orbax checkpoint of the pytree) and `export.json` (the
run's kind, task, step and model config), so `nnx.merge(models.abstract_init(cfg)[0], params)`
rebuilds the model elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import orbax.checkpoint as ocp

from metatrain import config as config_lib
from metatrain import workdir as workdir_lib
from metatrain.checkpoints import first_layout_difference
from metatrain.errors import ConfigError, DataError


def _latest_state(workdir: str) -> tuple[str, int, dict]:
    """(the latest checkpoint's state dir, its step, its metadata tree)."""
    if not os.path.isdir(workdir) and not workdir_lib.is_remote(workdir):
        raise DataError(f"{workdir}: no such directory; give a metatrain work dir (a run's `workdir=`)")
    step = workdir_lib.latest_step(workdir)
    if step is None:
        raise DataError(f"{workdir} is not a metatrain run: it has no checkpoint "
                        f"(expected {workdir_lib.checkpoint_dir(workdir)}/<step>/)")
    state_dir = os.path.join(workdir_lib.checkpoint_dir(workdir), str(step), "state")
    return state_dir, step, ocp.PyTreeCheckpointer().metadata(state_dir).item_metadata.tree


def _restore_part(state_dir: str, saved: dict, key: str, target=None):
    """One top-level entry of a saved state (`saved`: its metadata tree), onto `target`'s shapes and
    shardings (default: the first device, as saved)."""
    if key not in saved:
        raise DataError(f"{state_dir} has no {key!r} entry (it has {sorted(saved)})")
    if target is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved[key])
    item = {key: target}
    args = ocp.args.PyTreeRestore(item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                  partial_restore=True)
    return ocp.PyTreeCheckpointer().restore(state_dir, args=args)[key]


def _check_matches(path: str, saved, target):
    """Refuse a checkpoint whose parameter names or shapes differ from the target's, naming the first."""
    difference = first_layout_difference(saved, target)
    if difference:
        raise ConfigError(f"inner.init_from: {path} does not hold parameters of this run's model ({difference}); "
                          f"pretrain with the same model.* and data.vocab_size settings")


def export(workdir: str, out: str | None = None) -> str:
    """Write the latest checkpoint's meta-parameters (pretrain runs: the parameters) to `out`."""
    state_dir, step, saved = _latest_state(workdir)
    if config_lib.read_text(workdir_lib.config_path(workdir)) is None:
        raise DataError(f"{workdir} has checkpoints but no config.yaml: it was not written by `metatrain train` or "
                        f"`metatrain pretrain`")
    cfg = config_lib.load(workdir_lib.config_path(workdir))
    kind = "pretrain" if "params" in saved else "meta-train"
    params = _restore_part(state_dir, saved, "params" if kind == "pretrain" else "meta")
    from metatrain.data.tokenizer import load_tokenizer

    model = cfg.model.replace(vocab_size=load_tokenizer(cfg.data.tokenizer, cfg.data.vocab_size).vocab_size)
    out = os.path.abspath(out or os.path.join(workdir, "export"))
    with ocp.StandardCheckpointer() as checkpointer:  # leaving the block waits for the async write
        checkpointer.save(os.path.join(out, "params"), params, force=True)
    with open(os.path.join(out, "export.json"), "w") as f:
        json.dump({"kind": kind, "task": cfg.task, "step": step, "model": dataclasses.asdict(model)}, f,
                  indent=1)
    return out


def load_params(path: str, target):
    """Pretrained parameters from a `metatrain pretrain` work dir (its latest checkpoint) or an export
    directory, restored onto `target` (ShapeDtypeStructs with shardings)."""
    if os.path.exists(os.path.join(path, "export.json")):
        with ocp.StandardCheckpointer() as checkpointer:
            params_dir = os.path.join(path, "params")
            _check_matches(path, checkpointer.metadata(params_dir).item_metadata.tree, target)
            return checkpointer.restore(params_dir, target)
    try:
        state_dir, _, saved = _latest_state(path)
    except DataError as e:
        raise ConfigError(f"inner.init_from: {e}") from None
    if "params" not in saved:
        raise ConfigError(f"inner.init_from: {path} is not a `metatrain pretrain` work dir or an export dir (no "
                          f"'params' in its checkpoint, no export.json)")
    _check_matches(path, saved["params"], target)
    return _restore_part(state_dir, saved, "params", target)
