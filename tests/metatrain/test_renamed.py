"""Names from before a rename still work, for at least one release, each with a RenamedWarning naming the new one:
config keys (overrides, YAML files), the mode `default` (now `autodiff`), MetaGradMethod's arguments, variant tokens
and flags. The `metatrain` command says each as one warning line."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from metatrain import cli, config, mixflow
from metatrain.bench.variants import parse_variant
from metatrain.errors import RenamedWarning
from metatrain.unroll import MetaGradMethod

OLD = ["mode=default", "save_inner_grads=false", "inner_checkpoint=sqrt", "checkpoint_dtype=bfloat16",
       "checkpoint_offload=true", "inner_unroll=true", "meta_opt.offload=true"]
NEW = ["metagrad.mode=autodiff", "metagrad.save_inner_grads=false", "metagrad.kept_states=sqrt",
       "metagrad.state_dtype=bfloat16", "metagrad.offload_states=true", "metagrad.unroll=true",
       "meta_opt.offload_moments=true"]


def _said(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, RenamedWarning)]


def test_old_keys_in_overrides_and_yaml_give_the_config_of_the_new_ones(tmp_path):
    new = config.load(None, ["metagrad.save_inner_grads=true", *NEW[2:]])  # bfloat16 states need saved gradients
    with pytest.warns(RenamedWarning) as record:
        old = config.load(None, ["save_inner_grads=true", *OLD[2:]])
    assert old == new
    assert "inner_checkpoint is now metagrad.kept_states" in _said(record)[1]
    yaml = tmp_path / "old.yaml"
    yaml.write_text("mode: default\ninner_checkpoint: binomial\nmeta_opt: {offload: true, lr: 0.002}\n")
    with pytest.warns(RenamedWarning) as record:
        from_yaml = config.load(str(yaml), ["steps=7"])
    g = from_yaml.metagrad
    assert (g.mode, g.kept_states, from_yaml.meta_opt.offload_moments, from_yaml.meta_opt.lr, from_yaml.steps) == (
        "autodiff", "binomial", True, 0.002, 7)
    said = _said(record)
    assert f"mode (in {yaml}) is now metagrad.mode" in said[0]
    assert any(s.startswith(f"metagrad.mode: default (in {yaml}) is now metagrad.mode: autodiff;") for s in said)
    with pytest.warns(RenamedWarning, match="metagrad.mode=default is now metagrad.mode=autodiff"):
        assert config.load(None, ["metagrad.mode=default"]).metagrad.mode == "autodiff"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names: no warning
        config.load(None, NEW[:1])


def test_meta_grad_method_takes_and_gives_its_old_argument_names():
    with pytest.warns(RenamedWarning) as record:
        old = MetaGradMethod(mode="default", inner_checkpoint="sqrt", checkpoint_dtype="bfloat16",
                             checkpoint_offload=True)
    assert old == MetaGradMethod(mode="autodiff", kept_states="sqrt", state_dtype="bfloat16", offload_states=True)
    said = _said(record)
    assert "MetaGradMethod(inner_checkpoint=...) is now MetaGradMethod(kept_states=...)" in said[0]
    assert any("MetaGradMethod(mode='default') is now MetaGradMethod(mode='autodiff')" in s for s in said)
    assert record[0].filename == __file__  # the warning points at the caller's line
    with pytest.warns(RenamedWarning, match="MetaGradMethod.inner_checkpoint is now MetaGradMethod.kept_states"):
        assert old.inner_checkpoint == "sqrt"
    with pytest.raises(TypeError, match="give kept_states only"):
        MetaGradMethod(kept_states="sqrt", inner_checkpoint="sqrt")


def test_the_default_mode_is_autodiff_in_the_engine():
    loss = lambda p, x: jnp.sum(jnp.sin(p * x) ** 2)
    p, x = jnp.arange(1.0, 4.0), jnp.full(3, 0.5)
    with pytest.warns(RenamedWarning, match="mode='default' is now mode='autodiff'"):
        old = mixflow.value_and_grad(loss, mode="default")(p, x)
    for a, b in zip(old, mixflow.value_and_grad(loss, mode="autodiff")(p, x)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("old, new", [("default+remat", "autodiff+remat"),
                                      ("mixflow+remat+save+offload+offload_opt",
                                       "mixflow+remat+save+offload_states+offload_moments")])
def test_old_variant_tokens_name_the_new_variant(old, new):
    with pytest.warns(RenamedWarning, match=f"variant {old.replace('+', '[+]')} is now {new.replace('+', '[+]')}"):
        assert parse_variant(old) == parse_variant(new)


def test_the_command_says_each_old_name_as_one_warning_line(tmp_path, capsys):
    """Here each command then stops on a bad value of another setting, before any work: the old names were taken."""
    code = cli.main(["train", "mode=default", "inner_checkpoint=sqrt", "steps=0", f"workdir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "metatrain train: warning: mode is now metagrad.mode; the old name still works in this release and will be "
        "removed in a later one",
        "metatrain train: warning: metagrad.mode=default is now metagrad.mode=autodiff; the old name still works in "
        "this release and will be removed in a later one",
        "metatrain train: warning: inner_checkpoint is now metagrad.kept_states; the old name still works in this "
        "release and will be removed in a later one",
        "metatrain train: error: steps: must be >= 1, got 0"], err
    code = cli.main(["check-grads", "--task", "maml", "--inner-checkpoint", "sqrt", "--modes", "default",
                     "--variants", "default+remat+bf16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[0].startswith("metatrain check-grads: warning: --inner-checkpoint is now --kept-states;"), err
    assert err[1].startswith("metatrain check-grads: warning: variant default+remat+bf16 is now autodiff+remat+bf16;")
    assert err[-1].startswith("metatrain check-grads: error: --variants: check-grads runs in float64"), err
    # a flag's old name is said while the flags are parsed: named by the command all the same, nested ones in full
    with pytest.raises(SystemExit):
        cli.main(["bench", "memory", "--inner-checkpoint", "sqrt", "--batch", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("metatrain bench memory: warning: --inner-checkpoint is now --kept-states;"), err
    assert err[-1].startswith("metatrain bench memory: error: argument --batch: must be >= 1"), err
