"""Ahead-of-time memory of the Trainer's outer step at a small size: the accounting adds up against sizes counted
by hand, MixFlow's gain grows with depth; the grids, plots and the paper comparison of `bench memory`."""

import json

import pytest

from metatrain import cli, models
from metatrain.bench import memory
from metatrain.bench.variants import parse_variant, run_config

# The tests share shapes where they can, so that the session's compilation cache compiles each program once:
# SMALL at S=128 B=1 here, `tiny` at S=16 B=2 in the grids and in test_bench.py.
SMALL = models.ModelConfig(vocab_size=128, d_model=32, n_heads=2, d_ff=64, n_layers=1)
SMALL_FLAGS = ["--model", "bench", "--d-model", "32", "--n-heads", "2", "--d-ff", "64", "--vocab", "128",
               "--n-layers", "1", "--seq-len", "128", "--batch", "1"]
TINY_FLAGS = ["--model", "tiny", "--seq-len", "16", "--batch", "2"]
T, B, S = 2, 1, 128
VARIANTS = [parse_variant("autodiff+remat"), parse_variant("mixflow+remat+save")]


def _sequence_bytes(t, b, s):
    """int32 tokens, segment ids and positions [.., s+1]: inner [t, b, ..], outer [b, ..]."""
    return 4 * 3 * (s + 1) * (t * b + b)


@pytest.mark.slow
def test_rows_add_up_and_ratio_grows_with_layers():
    # T=3: a loop over inner steps is left (T=2 has none, and no static/dynamic split)
    configs = [run_config("maml", SMALL.replace(n_layers=n), S, B, 3) for n in (1, 4)]
    rows = memory.run(configs, VARIANTS)
    for r in rows:
        assert r["static_bytes"] + r["dynamic_bytes"] == r["peak_bytes"]
        # on CPU the peak is the sum of the compiled program's buffers (on TPU: the compiler's own high-water mark)
        assert r["peak_bytes"] == r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"]
        assert r["temp_sum_bytes"] == r["peak_bytes"]
        assert r["kept_bytes"] > 0 and r["dynamic_bytes"] > 0 and r["exact"] and r["static_from"] == "shapes"
    ratio = {(r["n_layers"], r["variant"]): r["temp_ratio"] for r in rows}
    assert ratio[(1, "autodiff+remat")] == 1.0
    # MixFlow's gain grows with depth; at one layer it is the compiler's to win or lose (XLA:CPU of jaxlib 0.10.2:
    # 1.31 at one layer, 2.52 at four; of jaxlib 0.11.2, which keeps fewer temporaries for autodiff: 0.73 and 2.44)
    assert ratio[(4, "mixflow+remat+save")] > max(ratio[(1, "mixflow+remat+save")], 1.0)


@pytest.mark.slow
def test_sizes_counted_by_hand():
    """MAML's state is η and the meta-optimizer's two Adam moments (3 float32 copies of the parameters, two int32
    counters); the arguments are that plus the batches' sequences (MAML never reads the per-example `corrupted`
    flags, and jit drops unused arguments), all donated but the batches; the kept inner states are θ and
    Adam's two moments, but the first step's (the outer step's own inputs), plus T θ-sized saved gradients with
    +save. T=2 leaves no loop and these leaves are too small to be told apart in the buffer assignment: no
    static/dynamic split."""
    rows = {r["variant"]: r for r in memory.run([run_config("maml", SMALL, S, B, T)],
                                                [parse_variant("mixflow+remat"), parse_variant("mixflow+remat+save")],
                                                baseline="mixflow+remat")}
    p = models.param_count(SMALL) * 4  # float32 bytes
    for r in rows.values():
        assert r["argument_bytes"] == 3 * p + 2 * 4 + _sequence_bytes(T, B, S)
        assert r["alias_bytes"] == 3 * p + 2 * 4  # the state is donated: its buffers are the new state's
        assert r["param_bytes"] == r["grad_bytes"] == p and r["meta_opt_bytes"] == 2 * p + 4
    assert rows["mixflow+remat"]["kept_bytes"] == (T - 1) * (3 * p + 4)
    assert rows["mixflow+remat+save"]["kept_bytes"] == (T - 1) * (3 * p + 4) + T * p
    assert all(r["static_bytes"] is None is r["dynamic_bytes"] for r in rows.values())


# leaves of 64K elements or more: the buffer assignment can tell θ-sized buffers from activations (`bench.buffers`)
WIDE = models.ModelConfig(vocab_size=512, d_model=128, n_heads=2, d_ff=512, n_layers=4)


@pytest.mark.slow
def test_two_steps_split_by_the_checkpoints_the_compiler_kept():
    """T=2 leaves no loop: the static part counts the kept inner states live at the peak in the compiled
    program (parameter-sized, written before the outer backward pass), never more than the shapes count (with a
    loop left they are counted from shapes: `test_rows_add_up_and_ratio_grows_with_layers`)."""
    for r in memory.run([run_config("maml", WIDE, 64, 1, 2)], VARIANTS):
        entry = r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"]
        assert r["static_bytes"] + r["dynamic_bytes"] == r["peak_bytes"] and r["dynamic_bytes"] > 0
        assert r["static_from"] == "buffers" and r["backward_start"] > 0
        assert r["kept_live_bytes"] > 0
        kept = min(r["kept_live_bytes"], r["kept_bytes"])
        assert r["static_bytes"] == entry + kept + r["grad_bytes"]


@pytest.mark.slow
def test_cli_json_and_table(tmp_path, capsys):
    out = tmp_path / "mem.json"
    argv = ["bench", "memory", *SMALL_FLAGS, "--variants", "autodiff+remat,mixflow+remat+save", "--json", str(out)]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["autodiff+remat", "mixflow+remat+save"]
    default, mixflow = rows
    assert mixflow["peak_ratio"] == default["peak_bytes"] / mixflow["peak_bytes"] and default["peak_ratio"] == 1
    assert default["argument_bytes"] == mixflow["argument_bytes"]  # same state and batches
    text = capsys.readouterr().out
    assert text.startswith("bench memory: grid=ablation")
    mib = lambda b: f"{b / 2**20:,.1f}"
    # T=2, leaves too small to tell apart from activations in the buffer assignment: no split
    assert f"| 1 | mixflow+remat+save | {mib(mixflow['peak_bytes'])} | - | - |" in text


@pytest.mark.slow
def test_resume_keeps_measured_rows_and_compiles_the_rest(tmp_path, capsys):
    out = tmp_path / "mem.json"
    argv = ["bench", "memory", *SMALL_FLAGS, "--json", str(out), "--variants"]
    assert cli.main([*argv, "mixflow+remat+save", "--baseline", "mixflow+remat+save"]) == 0
    first = json.loads(out.read_text())
    capsys.readouterr()
    assert cli.main([*argv, "mixflow+remat,mixflow+remat+save", "--resume", "--baseline", "mixflow+remat"]) == 0
    assert "resuming: 1 of 2 rows already measured, 1 to compile" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["mixflow+remat", "mixflow+remat+save"]
    assert rows[1]["compile_s"] == first[0]["compile_s"]  # the row kept, not compiled again
    assert rows[1]["peak_ratio"] == rows[0]["peak_bytes"] / rows[1]["peak_bytes"]  # ratios against the new baseline
    assert cli.main([*argv, "mixflow+remat", "--resume", "--baseline", "mixflow+remat"]) == 0
    kept = {r["variant"]: r for r in json.loads(out.read_text())}  # a run over fewer variants keeps the other rows
    assert sorted(kept) == ["mixflow+remat", "mixflow+remat+save"] and kept["mixflow+remat+save"] == rows[1]
    out.write_text("{not json")
    assert cli.main([*argv, "mixflow+remat", "--resume"]) == 2
    assert f"--resume: cannot read {out}" in capsys.readouterr().err
    assert cli.main(["bench", "memory", "--model", "tiny", "--resume"]) == 2
    assert "--resume keeps the rows of the --json file: give --json PATH too" in capsys.readouterr().err


def test_a_stop_says_which_rows_are_kept_and_how_to_measure_the_rest(tmp_path, capsys, monkeypatch):
    """SIGTERM after the first of two rows: the file holds it, and the stop's line says so and names --resume (it
    said only "stopped by SIGTERM")."""
    import os
    import signal

    from metatrain.cli import common

    out, write = tmp_path / "mem.json", common.write_json

    def write_then_stop(path, payload, quiet=False):
        write(path, payload, quiet)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(common, "write_json", write_then_stop)
    argv = ["bench", "memory", *SMALL_FLAGS, "--json", str(out), "--variants", "mixflow+remat,mixflow+remat+save",
            "--baseline", "mixflow+remat"]
    assert cli.main(argv) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"metatrain bench memory: stopped by SIGTERM; 1 row in {out}; the same command with --resume measures the rest")
    assert [r["variant"] for r in json.loads(out.read_text())] == ["mixflow+remat"]
    monkeypatch.setattr(common, "write_json", write)
    assert cli.main([*argv, "--resume"]) == 0
    assert [r["variant"] for r in json.loads(out.read_text())] == ["mixflow+remat", "mixflow+remat+save"]


@pytest.mark.slow
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


@pytest.mark.parametrize("flags, says", [
    (["--grid", "layers", "--layers", "abc"], "argument --layers: must be a comma list of whole numbers, e.g. 2,8; "
                                              "got 'abc'"),
    (["--grid", "layers", "--layers", "0,2"], "argument --layers: must be whole numbers >= 1, got 0,2"),
    # a grid's list given for another grid was left out without a word (the ablation grid ran instead)
    (["--layers", "2,4"], "--layers is for --grid layers; add --grid layers (this run's grid is ablation)"),
    (["--models", "tiny"], "--models is for --grid ladder; add --grid ladder (this run's grid is ablation)"),
    (["--grid", "ladder", "--tasks", "maml"], "--tasks is for --grid tasks; add --grid tasks (this run's grid is "
                                              "ladder)"),
    # an empty list ran the default one
    (["--grid", "tasks", "--tasks", ""], "argument --tasks: empty (as an unset shell variable leaves it)"),
    (["--grid", "ladder", "--models", ""], "argument --models: empty (as an unset shell variable leaves it)"),
    # a figure matplotlib cannot write failed after every compile (the rows lost without --json)
    (["--plot", "grid.doc"], "grid.doc ends in .doc, which matplotlib does not write"),
    (["--timeline", "t.txt"], "t.txt ends in .txt, which matplotlib does not write"),
])
def test_a_grid_flag_that_is_malformed_or_for_another_grid_is_one_line(flags, says, capsys):
    try:
        code = cli.main(["bench", "memory", "--model", "tiny", *flags])
    except SystemExit as e:  # argparse's errors exit, the command's return
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "compiling" not in err and "Traceback" not in err, err
    # named as argparse names the command ("metatrain bench: error:" before, for the command's own errors)
    assert err.splitlines()[-1].startswith("metatrain bench memory: error: "), err


@pytest.mark.parametrize("command", [["bench", "memory"], ["compile"]])
def test_model_overrides_that_flags_would_shadow_are_refused(command, capsys):
    """`model.d_model=16` after the flags would be replaced by the --model preset's model: an error, not a silent
    44m."""
    assert cli.main([*command, "--model", "tiny", "model.d_model=16", "data.batch=2"]) == 2
    err = capsys.readouterr().err
    assert "model.d_model=16, data.batch=2: the model, task and batch shapes come from flags here" in err
    assert "--d-model" in err and "--batch" in err


@pytest.mark.slow
def test_tasks_grid_with_plot(tmp_path):
    out, png = tmp_path / "tasks.json", tmp_path / "tasks.png"
    assert cli.main(["bench", "memory", "--grid", "tasks", "--tasks", "maml,learned_lr", *TINY_FLAGS,
                     "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())
    assert {(r["task"], r["variant"]) for r in rows} == {
        (t, v) for t in ("maml", "learned_lr") for v in ("autodiff+remat", "mixflow+remat+save")}
    # learned_lr carries its inner state (θ, υ) in and out; MAML restarts from η and carries none
    carried = {r["task"]: r["inner_bytes"] for r in rows}
    assert carried["maml"] == 0 and carried["learned_lr"] == 3 * models.param_count(models.preset("tiny")) * 4 + 4
    assert all(r["peak_ratio"] > 1 for r in rows if r["variant"] == "mixflow+remat+save")
    assert png.read_bytes()[:4] == b"\x89PNG"


def _row(params, variant, peak, static, checkpoints):
    return {"params": params, "variant": variant, "peak_bytes": peak, "static_bytes": static,
            "dynamic_bytes": peak - static, "param_bytes": 2**30, "meta_opt_bytes": 2**31, "grad_bytes": 2**30,
            "inner_bytes": 0, "adam_bytes": 2**31, "kept_bytes": checkpoints, "fits": True, "exact": True,
            "task": "maml", "batch": 4, "seq_len": 2048, "inner_steps": 2, "backend": "tpu",
            "inner_peeled": True}


def test_paper_comparison_names_static_and_where_it_dominates():
    from metatrain.aot import GiB
    from metatrain.bench.report import paper_comparison

    rows = [_row(44e6, "autodiff+remat", 20 * GiB, 5 * GiB, GiB),
            _row(44e6, "mixflow+remat+save", 8 * GiB, 3 * GiB, GiB),
            _row(489e6, "autodiff+remat", 90 * GiB, 20 * GiB, 10 * GiB),
            _row(489e6, "mixflow+remat+save", 40 * GiB, 25 * GiB, 12 * GiB)]
    text = paper_comparison(rows, {44e6: "44m", 489e6: "489m"}, "autodiff+remat", "mixflow+remat+save")
    assert "| 44m | 44M | 20.0 (15.0) | 8.0 (5.0) | 2.50x | 3.00x | 32.8 -> 12.9 |" in text
    assert "| 489m |" in text and "123.7 -> 46.9" in text and "| 62% |" in text
    # η, meta-optimizer state, ∇η, T=2 checkpoints holding one υ (the first step's is an input), carried inner
    # state, the rest
    assert "| 1.0 + 2.0 + 1.0 + 12.0 (υ 2.0) + 0.0 + 9.0 = 25.0 |" in text
    assert "static memory is about half or more of mixflow+remat+save's peak from 489m on" in text
    assert "which state no task or shapes" in text
    unsplit = [r | {"static_bytes": None, "dynamic_bytes": None} for r in rows]  # no loop left: peaks only
    text = paper_comparison(unsplit, {44e6: "44m"}, "autodiff+remat", "mixflow+remat+save")
    assert "| 44m | 44M | 20.0 (-) | 8.0 (-) | 2.50x | - | 32.8 -> 12.9 | - (not split) | - |" in text


def test_ablation_beside_the_papers_table():
    from metatrain.aot import GiB
    from metatrain.bench.report import ABLATION, ablation_comparison

    rows = [_row(44e6, v, (40 - 4 * i) * GiB, GiB, GiB) for i, v in enumerate(ABLATION)]  # 40, 36, 32, ... GiB
    rows[0]["fits"] = False
    text = ablation_comparison(rows, "44m")
    assert "| - | - | - | autodiff | 40.00 (over HBM) | 70.2 | 0.80x | 0.47x |" in text  # 32 ÷ 40; 32.8 ÷ 70.2
    assert "| + | + | + | mixflow+remat+save | 12.00 | 12.9 | 2.67x | 2.54x |" in text
    assert "Table 3 ('Case study for 44M transformer')" in text
    other = ablation_comparison([r | {"seq_len": 1024} for r in rows], "44m")  # not the setting we assume for it
    assert "| 12.00 | - | 2.67x | - |" in other and "no paper figures" in other


@pytest.mark.slow
def test_ladder_grid_on_cpu(tmp_path, capsys):
    png, timeline, out_json = tmp_path / "ladder.png", tmp_path / "timeline.png", tmp_path / "rows.json"
    # +unroll last: a row without a static/dynamic split, in the tables and the plot
    assert cli.main(["bench", "memory", "--grid", "ladder", "--models", "tiny", "--seq-len", "16", "--batch", "2",
                     "--variants", "autodiff+remat,mixflow+remat+save,mixflow+remat+save+unroll", "--plot", str(png),
                     "--timeline", str(timeline), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "| tiny |" in out and "shown only beside MAML on TPU" in out
    assert "| mixflow+remat+save+unroll | " in out and "mixflow+remat+save peak (dyn.)" in out
    assert "| compiled peak GiB | live at peak |" in out
    assert png.exists() and timeline.exists()
    for r in json.loads(out_json.read_text()):  # the timeline's peak is the breakdown's, within the compiled peak
        t, b = r["timeline"], r["breakdown"]
        assert max(t["live_bytes"]) == b["live_bytes"] <= r["peak_bytes"]
        assert max(t["argument_bytes"]) == b["argument_bytes"] > 0 and len(t["live_bytes"]) > 1


@pytest.mark.slow
@pytest.mark.tpu_backend
def test_tpu_backend_rows_are_per_chip(tmp_path):
    pytest.importorskip("libtpu", reason="needs the tpu extra (CI installs it): pip install -e '.[tpu]'")
    out = tmp_path / "tpu.json"
    # T=3: the first step before a loop of two, whose checkpoints are [2, ...] stacks. Two heads: libtpu compiles the
    # four programs in 36 s instead of 50 s with the preset's eight, and every leaf per chip keeps 64K elements
    flags = ["--model", "44m", "--n-layers", "1", "--n-heads", "2", "--d-ff", "512", "--vocab", "1024",
             "--seq-len", "64", "--batch", "4", "--inner-steps", "3"]
    assert cli.main(["bench", "memory", "--backend", "tpu", "--topology", "v5p:2x2x1", *flags, "--variants",
                     "mixflow+remat+save,mixflow+remat+save+bf16_state,"
                     "mixflow+remat+save+bf16_state+offload_states+offload_moments,"
                     "mixflow+remat+save+bf16_state+offload_states+offload_moments+offload_params",
                     "--baseline", "mixflow+remat+save", "--breakdown", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["mixflow+remat+save", "mixflow+remat+save+bf16_state",
                                            "mixflow+remat+save+bf16_state+offload_states+offload_moments",
                                            "mixflow+remat+save+bf16_state+offload_states+offload_moments+offload_params"]
    p = models.param_count(models.preset("44m", n_layers=1, n_heads=2, d_ff=512, vocab_size=1024)) * 4
    for r in rows:
        assert r["backend"] == "tpu" and r["topology"] == "v5p:2x2x1" and r["fits"] and r["exact"]
        assert r["hbm_bytes"] > 90 * 2**30 and 0 < r["dynamic_bytes"] < r["peak_bytes"]
        # FSDP: each of the 4 chips holds a quarter of η (+offload_params: in host memory, but its vectors)
        assert r["param_bytes"] + r.get("offloaded_param_bytes", 0) == p // 4
        # the buffer assignment's peak: the arguments live (all but a few scalars: the bytes memory_analysis counts),
        # θ-sized temporaries among the rest, the kept inner states ([T-1=2, ...] stacks of a layer weight) with them
        b = r["breakdown"]
        assert 0.99 * r["argument_bytes"] <= b["argument_bytes"] <= r["argument_bytes"]
        assert b["live_bytes"] <= r["peak_bytes"]
        assert b["param_sized_bytes"] > 0 and b["other_bytes"] > 0 and b["param_units"] >= 1
        stacks = [s for s in b["param_sized_shapes"] if s.split("[")[1].startswith("2,1,128,")]
        if "offload_states" in r["variant"].split("+"):  # the kept states' matrices are in host memory, not on the chip
            assert not stacks and 0 < r["offloaded_bytes"] <= r["host_temp_bytes"], (r, b["param_sized_shapes"])
            continue
        # +bf16_state: every checkpoint is bfloat16 in the compiled program (on CPU, XLA widens them back); without
        # it Adam's state and the saved gradients are float32 (θ_i may be kept as the bfloat16 copy the matmuls use)
        f32 = [s for s in stacks if s.startswith("f32")]
        assert stacks and (not f32 if r["variant"].endswith("+bf16_state") else f32), b["param_sized_shapes"]
        assert r["host_temp_bytes"] == r["offloaded_bytes"] == 0
    full, half, opt_too, eta_too = rows
    assert half["kept_bytes"] < 0.51 * full["kept_bytes"] and half["peak_bytes"] < full["peak_bytes"]
    # +offload_states: the kept states' matrices are host temporaries (not peeled: T states of them, where the device
    # keeps T - 1, the first step's being the inputs); the vectors stay on the chip
    assert opt_too["offloaded_bytes"] > half["kept_bytes"] > 100 * opt_too["kept_bytes"]
    # +offload_moments: the meta-optimizer's matrices are host arguments (donated: their outputs in the same place),
    # gone from the chip's arguments and its peak (the compiler's sizes include its tiles' padding, ours do not)
    assert half["host_io_bytes"] == half["offloaded_opt_bytes"] == 0
    assert 0 < opt_too["offloaded_opt_bytes"] <= opt_too["host_io_bytes"] < 2 * opt_too["offloaded_opt_bytes"]
    assert opt_too["argument_bytes"] == half["argument_bytes"] - opt_too["host_io_bytes"]
    assert opt_too["peak_bytes"] < half["peak_bytes"]
    # +offload_params: η's matrices too; the chip still holds ∇η, and η while the first inner step reads it
    moved = eta_too["offloaded_param_bytes"]
    assert 0 < moved and eta_too["host_io_bytes"] - opt_too["host_io_bytes"] >= moved
    assert eta_too["argument_bytes"] + eta_too["host_io_bytes"] == opt_too["argument_bytes"] + opt_too["host_io_bytes"]
    assert eta_too["peak_bytes"] <= opt_too["peak_bytes"]


def test_resource_exhausted_figure_is_parsed():
    from metatrain.aot import required_bytes

    err = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                       "temporaries (134.00G) exceeds available HBM (95.74G)")
    assert required_bytes(err) == 134 * 2**30 and required_bytes(RuntimeError("other")) is None


@pytest.mark.slow
@pytest.mark.tpu_backend
def test_a_program_over_hbm_is_compiled_past_the_limit_and_a_fitting_one_is_unchanged():
    """`aot.compile_exact`: libtpu refuses a program over the v5p chip's 95.74 GiB; compiled past the limit it gives
    the buffer assignment's figures. A program that fits gives the same figures with and without that option."""
    pytest.importorskip("libtpu", reason="needs the tpu extra (CI installs it): pip install -e '.[tpu]'")
    import jax
    import jax.numpy as jnp

    from metatrain.aot import PAST_HBM, compile_exact, compiled_memory, topology_devices

    devices, hbm = topology_devices("v5p:1x1x1")
    replicated = jax.sharding.NamedSharding(jax.sharding.Mesh(devices[:1], ("x",)), jax.sharding.PartitionSpec())

    def lowered(gib):  # x and three elementwise temporaries of its size, all live at the reduction
        def f(x):
            a = jnp.sin(x)
            b = jnp.cos(a) * x
            c = jnp.exp(b) + a
            d = jnp.tanh(c) * b
            return (a * b * c * d).sum() + sum(jnp.sort(y[:1024])[0] for y in (a, b, c, d))
        n = int(gib * 2**30 / 16)
        return jax.jit(f).lower(jax.ShapeDtypeStruct((n,), jnp.float32, sharding=replicated))

    small = lowered(20)
    compiled, refused, _ = compile_exact(small, tpu=True)
    assert refused is None
    assert compiled_memory(compiled) == compiled_memory(small.compile(compiler_options=PAST_HBM))
    big = lowered(200)
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        big.compile()
    compiled, refused, message = compile_exact(big, tpu=True)
    m = compiled_memory(compiled)
    assert refused > hbm and "exceeds available HBM" in message
    assert m["argument_bytes"] == 50 * 2**30 and m["peak_bytes"] > hbm and m["temp_bytes"] >= 3 * 50 * 2**30


@pytest.mark.tpu_backend
def test_tpu_peak_is_the_figure_the_compiler_holds_to_the_hbm(tmp_path):
    """On TPU `peak_bytes` is the compiler's `peak_memory_in_bytes`: the high-water mark of the dumped buffer
    assignment, and the figure libtpu checks against the HBM: under a limit between it and arguments + outputs +
    temp (libtpu's temp counts more than the assignment holds on a loop over stacked buffers) the program
    compiles, under one below it the compiler refuses and quotes it."""
    pytest.importorskip("libtpu", reason="needs the tpu extra (CI installs it): pip install -e '.[tpu]'")
    import jax
    import jax.numpy as jnp

    from metatrain.aot import compiled_memory, required_bytes, topology_devices
    from metatrain.bench import buffers

    devices, _ = topology_devices("v5p:1x1x1")
    replicated = jax.sharding.NamedSharding(jax.sharding.Mesh(devices[:1], ("x",)), jax.sharding.PartitionSpec())

    def f(w, x):  # a loop over 8 layers whose matmul outputs are stacked
        def body(c, wl):
            h = c @ wl
            return jnp.sin(h), h
        c, hs = jax.lax.scan(body, x, w)
        return hs.sum() + c.sum()

    n = 2048
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=replicated)
    lowered = jax.jit(f).lower(shape(8, n, n), shape(n, n))
    m = compiled_memory(lowered.compile(compiler_options=buffers.dump_options(str(tmp_path))))
    regions, length = buffers.read_dump(str(tmp_path))
    assert m["peak_bytes"] == pytest.approx(int(buffers.timeline(regions, length).max()), rel=1e-3)
    assert m["temp_sum_bytes"] > 1.05 * m["peak_bytes"]
    mib = lambda b: int(b / 2**20)
    limit = (mib(m["peak_bytes"]) + mib(m["temp_sum_bytes"])) // 2
    between = lowered.compile(compiler_options={"xla_tpu_max_hbm_size_mib": limit})
    # the same figure: libtpu 0.0.48 (jax 0.11) lays the program out again under the limit, 512 bytes apart
    assert compiled_memory(between)["peak_bytes"] == pytest.approx(m["peak_bytes"], rel=1e-5)
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as refused:
        lowered.compile(compiler_options={"xla_tpu_max_hbm_size_mib": mib(0.9 * m["peak_bytes"])})
    assert required_bytes(refused.value) == pytest.approx(m["peak_bytes"], rel=0.01)


@pytest.mark.slow
@pytest.mark.tpu_backend
@pytest.mark.parametrize("donate", [False, True])
def test_tpu_peak_leaves_out_arguments_and_outputs_in_host_memory(tmp_path, donate):
    """libtpu's `peak_memory_in_bytes` adds the arguments and outputs placed in host memory (pinned_host), which the
    HBM does not hold: `peak_bytes` takes them out again and is the dumped buffer assignment's high-water mark, and
    the compiler accepts the program under an HBM limit between the two figures."""
    pytest.importorskip("libtpu", reason="needs the tpu extra (CI installs it): pip install -e '.[tpu]'")
    import jax
    import jax.numpy as jnp

    from metatrain.aot import compiled_memory, topology_devices
    from metatrain.bench import buffers

    devices, _ = topology_devices("v5p:1x1x1")
    on_chip = jax.sharding.NamedSharding(jax.sharding.Mesh(devices[:1], ("x",)), jax.sharding.PartitionSpec())
    on_host = on_chip.with_memory_kind("pinned_host")

    def f(w, x, moment):  # a moment kept in host memory, brought in for an update, sent back
        hs = jax.lax.scan(lambda c, wl: (jnp.sin(c @ wl), c @ wl), x, w)[1]
        return hs.sum(), 0.9 * jax.device_put(moment, jax.memory.Space.Device) + hs.sum(0)

    n = 2048
    shape = lambda *s, where=on_chip: jax.ShapeDtypeStruct(s, jnp.float32, sharding=where)
    lowered = jax.jit(f, donate_argnums=(2,) if donate else (), out_shardings=(on_chip, on_host)).lower(
        shape(8, n, n), shape(n, n), shape(n, n, where=on_host))
    compiled = lowered.compile(compiler_options=buffers.dump_options(str(tmp_path)))
    m, reported = compiled_memory(compiled), compiled.memory_analysis().peak_memory_in_bytes
    regions, length = buffers.read_dump(str(tmp_path))
    assert m["peak_bytes"] == pytest.approx(int(buffers.timeline(regions, length).max()), rel=1e-3)
    assert m["host_io_bytes"] == (1 if donate else 2) * n * n * 4 and reported == m["peak_bytes"] + m["host_io_bytes"]
    between = (m["peak_bytes"] + reported) // 2 // 2**20
    lowered.compile(compiler_options={"xla_tpu_max_hbm_size_mib": between})  # accepted: what counts is on the chip
