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


def _latest_state(workdir: str) -> tuple[str, int, dict]:
    """(the latest checkpoint's state dir, its step, its metadata tree)."""
    step = config_lib.latest_step(workdir)
    if step is None:
        raise ValueError(f"{workdir} has no checkpoint (expected {config_lib.checkpoint_dir(workdir)}/<step>/); "
                         f"is it a metatrain work dir?")
    state_dir = os.path.join(config_lib.checkpoint_dir(workdir), str(step), "state")
    return state_dir, step, ocp.PyTreeCheckpointer().metadata(state_dir).item_metadata.tree


def _restore_part(state_dir: str, saved: dict, key: str, target=None):
    """One top-level entry of a saved state (`saved`: its metadata tree), onto `target`'s shapes and
    shardings (default: the first device, as saved)."""
    if key not in saved:
        raise ValueError(f"{state_dir} has no {key!r} entry (it has {sorted(saved)})")
    if target is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved[key])
    item = {key: target}
    args = ocp.args.PyTreeRestore(item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                  partial_restore=True)
    return ocp.PyTreeCheckpointer().restore(state_dir, args=args)[key]


def _check_matches(saved, target):
    """Refuse a checkpoint whose parameter names or shapes differ from the target's, naming the first."""
    def names(tree):  # nnx Variables (attribute `value`) and saved dicts (key 'value') read alike
        return {"/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path):
                tuple(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}

    have, want = names(saved), names(target)
    for name, shape in want.items():
        if name not in have:
            raise ValueError(f"it has no parameter {name}")
        if have[name] != shape:
            raise ValueError(f"{name} has shape {have[name]}, this run's model needs {shape}")


def export(workdir: str, out: str | None = None) -> str:
    """Write the latest checkpoint's meta-parameters (pretrain runs: the parameters) to `out`."""
    cfg = config_lib.load(config_lib.workdir_config_path(workdir))
    state_dir, step, saved = _latest_state(workdir)
    kind = "pretrain" if "params" in saved else "meta-train"
    params = _restore_part(state_dir, saved, "params" if kind == "pretrain" else "meta")
    from data.tokenizer import load_tokenizer

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
            _check_matches(checkpointer.metadata(params_dir).item_metadata.tree, target)
            return checkpointer.restore(params_dir, target)
    state_dir, _, saved = _latest_state(path)
    if "params" not in saved:
        raise ValueError("it is not a `metatrain pretrain` work dir (no 'params' in its checkpoint)")
    _check_matches(saved["params"], target)
    return _restore_part(state_dir, saved, "params", target)
