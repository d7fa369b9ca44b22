"""Ahead-of-time memory profile at a small size: the accounting adds up and MixFlow's gain grows with depth;
the grids, plots and the paper comparison of `bench memory`."""

import json

import pytest

import models
from metatrain import cli, memory
from metatrain.problem import Shapes, parse_variant

SMALL = models.ModelConfig(vocab_size=128, d_model=32, n_heads=2, d_ff=64, n_layers=1)
SHAPES = Shapes(inner_steps=2, batch=1, seq_len=256)
VARIANTS = [parse_variant("default+remat"), parse_variant("mixflow+remat+save")]


def test_rows_add_up_and_ratio_grows_with_layers():
    rows = memory.run(["maml"], [(SMALL.replace(n_layers=n), SHAPES) for n in (1, 4)], VARIANTS)
    for r in rows:
        assert r["static_bytes"] + r["dynamic_bytes"] == r["peak_bytes"]
        assert r["peak_bytes"] == r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"]
        assert r["checkpoint_bytes"] > 0 and r["dynamic_bytes"] > 0
    ratio = {(r["n_layers"], r["variant"]): r["temp_ratio"] for r in rows}
    assert ratio[(1, "default+remat")] == 1.0
    assert ratio[(4, "mixflow+remat+save")] > ratio[(1, "mixflow+remat+save")] > 1.0


def test_checkpoints_count_saved_gradients():
    rows = {r["variant"]: r for r in memory.run(["maml"], [(SMALL, SHAPES)], [parse_variant("mixflow+remat"),
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
    out = capsys.readouterr().out
    assert "| 2 | mixflow+remat+save |" in out and out.startswith("bench memory: grid=ablation")


def test_blockwise_variant_beside_dense(tmp_path):
    """`+blockwise` in a variant name profiles the blockwise model, in the dense baseline's ratio group;
    at S=256 with blocks of 32 it no longer holds [B, H, S, S] scores, so its temporaries are smaller."""
    out = tmp_path / "mem.json"
    assert cli.main(["bench", "memory", "--model", "tiny", "--seq-len", "256", "--batch", "1", "--attention-block",
                     "32", "--variants", "mixflow+remat+save,mixflow+remat+save+blockwise", "--baseline",
                     "mixflow+remat+save", "--json", str(out)]) == 0
    dense, blockwise = json.loads(out.read_text())
    assert (dense["attention"], blockwise["attention"]) == ("dense", "blockwise")
    assert blockwise["variant"] == "mixflow+remat+save+blockwise" and blockwise["temp_ratio"] > 1.0


def test_cli_bad_variant(capsys):
    assert cli.main(["bench", "memory", "--model", "tiny", "--variants", "mixflow+fast"]) == 2
    assert "unknown option(s) ['fast']" in capsys.readouterr().err


def test_tasks_grid_with_plot(tmp_path, capsys):
    out, png = tmp_path / "tasks.json", tmp_path / "tasks.png"
    assert cli.main(["bench", "memory", "--grid", "tasks", "--tasks", "maml,loss_weighting", "--model", "tiny",
                     "--seq-len", "16", "--batch", "1", "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())
    assert {(r["task"], r["variant"]) for r in rows} == {
        (t, v) for t in ("maml", "loss_weighting") for v in ("default+remat", "mixflow+remat+save")}
    assert all(r["dynamic_ratio"] > 1 for r in rows if r["variant"] == "mixflow+remat+save")
    assert png.read_bytes()[:4] == b"\x89PNG"


def _row(params, variant, peak, static, checkpoints):
    return {"params": params, "variant": variant, "peak_bytes": peak, "static_bytes": static,
            "dynamic_bytes": peak - static, "param_bytes": 2**30, "adam_bytes": 2**31, "checkpoint_bytes": checkpoints,
            "fits": True, "task": "maml", "batch": 4, "seq_len": 2048, "inner_steps": 2, "backend": "tpu"}


def test_paper_comparison_names_static_and_where_it_dominates():
    from metatrain.bench_report import GiB, paper_comparison

    rows = [_row(44e6, "default+remat", 20 * GiB, 2 * GiB, GiB),
            _row(44e6, "mixflow+remat+save", 8 * GiB, 2 * GiB, GiB),
            _row(489e6, "default+remat", 90 * GiB, 20 * GiB, 10 * GiB),
            _row(489e6, "mixflow+remat+save", 40 * GiB, 25 * GiB, 12 * GiB)]
    text = paper_comparison(rows, {44e6: "44m", 489e6: "489m"}, "default+remat", "mixflow+remat+save")
    assert "| 44m | 44M | 20.0 (18.0) | 8.0 (6.0) | 2.50x | 3.00x | 32.8 -> 12.9 |" in text
    assert "| 489m |" in text and "123.7 -> 46.9" in text and "| 62% |" in text
    assert "| 1.0 + 1.0 + 12.0 (υ 4.0) + 11.0 = 25.0 |" in text  # η, ∇η, T=2 checkpoints holding 2 υ, the rest
    assert "static memory is about half or more of mixflow+remat+save's peak from 489m on" in text


def test_ladder_grid_on_cpu(tmp_path, capsys):
    png = tmp_path / "ladder.png"
    assert cli.main(["bench", "memory", "--grid", "ladder", "--models", "tiny", "--seq-len", "16",
                     "--batch", "1", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| tiny |" in out and "paper's figures are for MAML on TPU" in out
    assert png.exists()


def test_tpu_backend_rows_are_per_chip(tmp_path):
    pytest.importorskip("libtpu", reason="needs the tpu extra (CI installs it): pip install -e '.[tpu]'")
    out = tmp_path / "tpu.json"
    assert cli.main(["bench", "memory", "--backend", "tpu", "--topology", "v5p:1x1x1", "--model", "tiny",
                     "--seq-len", "64", "--batch", "2", "--variants", "default+remat,mixflow+remat+save",
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert all(r["backend"] == "tpu" and r["topology"] == "v5p:1x1x1" and r["fits"] for r in rows)
    assert all(r["hbm_bytes"] > 90 * 2**30 and 0 < r["dynamic_bytes"] < r["peak_bytes"] for r in rows)


def test_resource_exhausted_figure_is_parsed():
    from metatrain.tpu_compile import required_bytes

    err = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                       "temporaries (134.00G) exceeds available HBM (95.74G)")
    assert required_bytes(err) == 134 * 2**30 and required_bytes(RuntimeError("other")) is None
