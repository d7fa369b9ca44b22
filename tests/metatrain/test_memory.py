"""Ahead-of-time memory profile at a small size: the accounting adds up and MixFlow's gain grows with depth."""

import json

import models
from metatrain import cli, memory
from metatrain.problem import Shapes, parse_variant

SMALL = models.ModelConfig(vocab_size=128, d_model=32, n_heads=2, d_ff=64, n_layers=1)
SHAPES = Shapes(inner_steps=2, batch=1, seq_len=256)
VARIANTS = [parse_variant("default+remat"), parse_variant("mixflow+remat+save")]


def test_rows_add_up_and_ratio_grows_with_layers():
    rows = memory.run("maml", [(SMALL.replace(n_layers=n), SHAPES) for n in (1, 4)], VARIANTS)
    for r in rows:
        assert r["static_bytes"] + r["dynamic_bytes"] == r["peak_bytes"]
        assert r["peak_bytes"] == r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"]
        assert r["checkpoint_bytes"] > 0 and r["dynamic_bytes"] > 0
    ratio = {(r["n_layers"], r["variant"]): r["temp_ratio"] for r in rows}
    assert ratio[(1, "default+remat")] == 1.0
    assert ratio[(4, "mixflow+remat+save")] > ratio[(1, "mixflow+remat+save")] > 1.0


def test_checkpoints_count_saved_gradients():
    rows = {r["variant"]: r for r in memory.run("maml", [(SMALL, SHAPES)], [parse_variant("mixflow+remat"),
                                                                            parse_variant("mixflow+remat+save")],
                                                baseline="mixflow+remat")}
    n_params = models.param_count(SMALL) * 4  # float32 bytes
    # per step: θ and Adam's two moments, plus θ-sized saved gradients with +save
    assert rows["mixflow+remat"]["checkpoint_bytes"] == SHAPES.inner_steps * (3 * n_params + 4)
    assert rows["mixflow+remat+save"]["checkpoint_bytes"] == SHAPES.inner_steps * (4 * n_params + 4)


def test_cli_json(tmp_path, capsys):
    out = tmp_path / "mem.json"
    argv = ["bench", "memory", "--d-model", "32", "--n-heads", "2", "--d-ff", "64", "--vocab", "128",
            "--n-layers", "2", "--seq-len", "64", "--batch", "1", "--variants", "default+remat,mixflow+remat+save",
            "--json", str(out)]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["default+remat", "mixflow+remat+save"]
    for key in ("temp_bytes", "argument_bytes", "output_bytes", "peak_bytes", "static_bytes", "dynamic_bytes", "flops"):
        assert all(key in r for r in rows)
    assert "| maml | 2 | mixflow+remat+save |" in capsys.readouterr().out


def test_cli_bad_variant(capsys):
    assert cli.main(["bench", "memory", "--model", "tiny", "--variants", "mixflow+fast"]) == 2
    assert "unknown option(s) ['fast']" in capsys.readouterr().err
