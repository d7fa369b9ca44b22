"""The one outer-step program: its batch spec is what the data pipeline yields, and test batches follow it."""

import dataclasses

import jax
import numpy as np
import pytest

from metatrain import step
from metatrain.data.pipeline import DEVICE_FEATURES, DataConfig, Streams


def test_batch_specs_are_what_the_pipeline_yields():
    """The Trainer runs a program compiled for `batch_specs`: the real batches must have its keys, shapes, dtypes."""
    data = DataConfig(vocab_size=300, seq_len=16, batch=4, inner_steps=3, corrupt_fraction=0.3, shuffle_window=64)
    specs = step.batch_specs(data)
    real = Streams(data, 0, 1).next()
    for spec, batch in zip(specs, real):
        # doc: host-side; loss_mask: read by the step only for conversations (for text it is all ones)
        assert set(spec) == set(DEVICE_FEATURES) and set(batch) == set(DEVICE_FEATURES) | {"doc", "loss_mask"}
        for k in spec:
            got = jax.numpy.asarray(batch[k])
            assert (got.shape, got.dtype) == (spec[k].shape, spec[k].dtype), k
    fake = step.random_batches(data, 300, jax.random.key(0))
    assert jax.tree.structure(fake) == jax.tree.structure(specs)
    assert all(f.shape == s.shape and f.dtype == s.dtype for f, s in zip(jax.tree.leaves(fake), jax.tree.leaves(specs)))
    inner = fake[0]
    assert int(inner["tokens"].max()) < 300 and not np.asarray(inner["corrupted"]).any()
    np.testing.assert_array_equal(inner["positions"][1, 2], np.arange(17))
    chat_inner, chat_outer = step.batch_specs(dataclasses.replace(data, format="chat"))
    assert chat_inner["loss_mask"].shape == (3, 4, 17) and chat_outer["loss_mask"].shape == (4, 17)
    assert np.asarray(step.random_batches(dataclasses.replace(data, format="chat"), 300,
                                          jax.random.key(0))[0]["loss_mask"]).all()


def test_batch_specs_carry_the_meshs_shardings():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp"))
    inner, outer = step.batch_specs(DataConfig(seq_len=8, batch=2), mesh)
    assert inner["tokens"].sharding.spec == jax.sharding.PartitionSpec(None, ("data", "fsdp"))
    assert outer["tokens"].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))


@pytest.mark.slow
def test_meta_optimizer_state_and_eta_in_host_memory_give_the_same_steps_and_checkpoints(tmp_path):
    """meta_opt.offload_moments=true: the compiled step takes and returns the meta-optimizer's matrices in pinned host
    memory, with meta_opt.offload_params=true η's too; two outer steps give the same state, bit for bit, as without
    them; an Orbax checkpoint of that state comes back in host memory with the same values; `step.on_device` brings η
    back for evaluation."""
    import orbax.checkpoint as ocp

    from metatrain import config as config_lib
    from metatrain.checkpoints import Checkpoints
    from metatrain.sharding import abstract, make_mesh

    states, programs = {}, {}
    placements = {"none": [], "opt": ["meta_opt.offload_moments=true"],
                  "all": ["meta_opt.offload_moments=true", "meta_opt.offload_params=true"]}
    for name, flags in placements.items():
        cfg = config_lib.load(None, ["task=maml", "model.d_model=16", "model.n_heads=2", "model.d_ff=32",
                                     "model.vocab_size=64", "data.seq_len=8", "data.batch=2", *flags])
        program = programs[name] = step.meta_program(cfg, make_mesh(cfg.mesh))
        state, compiled = step.init(program, jax.random.key(0)), step.lower(program).compile()
        for k in range(2):
            state, metrics = compiled(state, *step.random_batches(cfg.data, 64, jax.random.key(k + 1)))
            assert bool(metrics["finite"])
        states[name] = state
    kind = lambda tree: {(x.ndim >= 2, x.sharding.memory_kind) for x in jax.tree.leaves(tree)}
    on_host, on_device = {(True, "pinned_host"), (False, "device")}, {(True, "device"), (False, "device")}
    assert kind(states["all"]["meta_opt"]) == kind(states["opt"]["meta_opt"]) == on_host
    assert kind(states["none"]["meta_opt"]) == on_device
    assert kind(states["opt"]["meta"]) == on_device and kind(states["all"]["meta"]) == on_host
    assert kind(step.on_device(states["all"]["meta"])) == on_device
    for name in ("opt", "all"):
        for a, b in zip(jax.tree.leaves(states[name]), jax.tree.leaves(states["none"])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    ckpt = Checkpoints(str(tmp_path), keep=1)
    ckpt.save(2, {"state": ocp.args.StandardSave(states["all"])})
    ckpt.close()
    target = abstract(states["all"], programs["all"].state_shardings)
    _, restored = Checkpoints(str(tmp_path), keep=1).restore(target, {})
    assert kind(restored["state"]["meta_opt"]) == kind(restored["state"]["meta"]) == on_host
    for a, b in zip(jax.tree.leaves(restored["state"]), jax.tree.leaves(states["none"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
