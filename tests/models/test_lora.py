"""LoRA adapters: fresh ones change nothing, trained ones equal their merged weights, and bad settings are refused."""

import jax
import numpy as np
import pytest
from flax import nnx

from metatrain import models
from metatrain.errors import ConfigError
from metatrain.models import LoRAConfig, split_adapters
from metatrain.models.lora import merge

# every projection has an adapter: q, k, v (grouped-query), o, and the SwiGLU MLP's up, gate, down
CFG = models.preset("tiny-llama")
LORA = LoRAConfig(rank=3, alpha=6.0)


def _pure(state):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(state))


def _tokens():
    return jax.random.randint(jax.random.key(5), (2, 12), 0, CFG.vocab_size)


def test_adapters_sit_beside_each_targeted_weight_stacked_over_layers():
    graphdef, state = models.init(CFG, jax.random.key(0), LORA)
    base, adapters = split_adapters(state)
    names = sorted(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(_pure(adapters))[0])
    expected = sorted(f"['blocks']['{m}']['lora_{t}_{ab}']" for m, ts in (("attn", "qkvo"), ("mlp", ("up", "gate",
                                                                                                       "down")))
                      for t in ts for ab in "ab")
    assert names == expected
    assert all(x.shape[0] == CFG.n_layers for x in jax.tree.leaves(adapters))
    _, plain = models.init(CFG, jax.random.key(0))
    assert jax.tree.structure(_pure(base)) == jax.tree.structure(_pure(plain))  # the base is a plain model
    gelu = models.init(models.preset("tiny"), jax.random.key(0), LORA)[1]
    assert not any("gate" in jax.tree_util.keystr(p) for p, _ in
                   jax.tree_util.tree_flatten_with_path(_pure(split_adapters(gelu)[1]))[0])  # no gate in GELU MLPs


def test_fresh_adapters_give_the_base_models_logits():
    graphdef, state = models.init(CFG, jax.random.key(0), LORA)
    base, adapters = split_adapters(state)
    plain_graphdef, _ = models.abstract_init(CFG)
    with_lora = nnx.merge(graphdef, base, adapters)(_tokens())
    without = nnx.merge(plain_graphdef, base)(_tokens())
    np.testing.assert_array_equal(np.asarray(with_lora), np.asarray(without))


def test_merged_weights_give_the_adapted_models_logits():
    graphdef, state = models.init(CFG, jax.random.key(0), LORA)
    base, adapters = split_adapters(state)
    noise = jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters)))  # every A and B non-zero
    leaves, treedef = jax.tree.flatten(adapters)
    adapters = jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, noise)])
    adapted = np.asarray(nnx.merge(graphdef, base, adapters)(_tokens()))
    plain_graphdef, plain = models.abstract_init(CFG)
    nnx.replace_by_pure_dict(plain, merge(_pure(base), _pure(adapters), LORA.scale))
    merged = np.asarray(nnx.merge(plain_graphdef, plain)(_tokens()))
    assert np.abs(adapted - nnx.merge(plain_graphdef, base)(_tokens())).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(merged, adapted, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fields, field", [({"rank": -1}, "rank"), ({"rank": 4, "alpha": 0.0}, "alpha"),
                                           ({"rank": 4, "targets": "q,x"}, "targets"),
                                           ({"rank": 4, "targets": " , "}, "targets")])
def test_bad_settings_name_the_field(fields, field):
    with pytest.raises(ConfigError, match=f"inner.lora.{field}"):
        LoRAConfig(**fields)

