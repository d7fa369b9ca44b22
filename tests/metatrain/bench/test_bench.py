"""`bench time` (side-by-side step time of the Trainer's outer step) and `bench fit` (the ladder search, with a
stand-in compiler); variant names."""

import json

import pytest
from helpers import cli_run, one_line_error

from metatrain import aot, cli, models
from metatrain.bench import largest_fit
from metatrain.bench.variants import parse_variant
from metatrain.cli import common
from metatrain.errors import ConfigError, TrainingError

TINY_FLAGS = ["--model", "tiny", "--seq-len", "16", "--batch", "2"]


@pytest.mark.slow
def test_bench_time_runs_each_variants_real_step(tmp_path, capsys):
    """The rows say what ran: every variant's state went through warm-up + rounds outer steps, and its
    compiled program is the one `bench memory` compiles for that variant (so the two variants differ)."""
    out, mem = tmp_path / "time.json", tmp_path / "mem.json"
    assert cli.main(["bench", "time", *TINY_FLAGS, "--rounds", "3", "--warmup", "2", "--json", str(out),
                     "--profile", str(tmp_path / "prof"), "--profile-steps", "2"]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"autodiff+remat", "mixflow+remat+save"}
    # the steps timed, then those profiled
    assert all(r["steps_run"] == 2 + 3 + 2 and len(r["times_s"]) == 3 and min(r["times_s"]) > 0
               for r in rows.values())
    out = capsys.readouterr().out
    assert "| mixflow+remat+save |" in out and "| class | autodiff+remat: ms per step (share) |" in out
    for name, r in rows.items():  # where it ran; a CPU keeps no memory statistics
        assert r["device"] == "cpu" and r["versions"]["jax"] and "process_peak_bytes" not in r
        p = r["profile"]
        assert p["steps"] == 2 and p["trace"].startswith(str(tmp_path / "prof" / name.replace("+", "_")))
        assert 0 < sum(o["share"] for o in p["top_ops"]) <= 1 + 1e-9 and p["top_ops"][0]["ms_per_step"] > 0
        assert {o["module"] for o in p["top_ops"]} == {"jit_outer_step"}
        # every op by class: the shares add up, and the step's dots are matmuls (XLA's or YNNPACK's on a CPU)
        assert sum(c["share"] for c in p["by_class"]) == pytest.approx(1) and "matmul" in {
            c["class"] for c in p["by_class"]}, p["by_class"]
        # each top op found in the compiled program kept beside the trace: its shape and the JAX op it came from
        assert open(p["program"]).read().startswith("HloModule jit_outer_step")
        assert all(o["opcode"] and o["shape"] for o in p["top_ops"]), p["top_ops"]
        assert any(o["source"].startswith("jit(outer_step)/") for o in p["top_ops"]), p["top_ops"]
        # the kernels among them: what each moves and computes per step (the program's census), and the rate
        counted = [o for o in p["top_ops"] if "bytes_per_step" in o]
        assert counted and all(o["gb_per_s"] > 0 for o in counted), p["top_ops"]
    assert cli.main(["bench", "memory", *TINY_FLAGS, "--variants", "autodiff+remat,mixflow+remat+save",
                     "--json", str(mem)]) == 0
    peaks = {r["variant"]: r["peak_bytes"] for r in json.loads(mem.read_text())}
    assert {n: r["peak_bytes"] for n, r in rows.items()} == peaks
    plans = {r["variant"]: r["plan"] for r in json.loads(mem.read_text())}  # T=2: both steps under one VJP
    assert plans == {"autodiff+remat": "checkpointed+peeled", "mixflow+remat+save": "two_steps+peeled+seeded"}
    assert peaks["autodiff+remat"] != peaks["mixflow+remat+save"]
    # the census of the program profiled is that of the program compiled ahead of time
    products = {r["variant"]: r["census"]["flops"] for r in json.loads(mem.read_text())}
    assert {n: r["profile"]["census"]["flops"] for n, r in rows.items()} == products and all(products.values())


def test_one_variant_per_process_gives_the_peak_before_its_first_step(monkeypatch):
    """Where the device keeps memory statistics (here a stand-in: a CPU keeps none), a variant measured alone gets
    the process's peak before its first step (state initialised, program compiled: a GPU's autotuning included)
    beside the peak after its steps."""
    from metatrain.bench import steptime
    from metatrain.bench.variants import run_config

    class Runner:  # the compiled step, stood in: each call is one outer step
        def __init__(self, cfg, variant, seed, first=True):
            self.state, self.compiled = {"step": 0}, None

        def __call__(self):
            self.state["step"] += 1

    peaks = iter([100, 250])  # read after compiling, then after the timed rounds
    monkeypatch.setattr(steptime, "_Runner", Runner)
    monkeypatch.setattr(steptime, "device_peak_bytes", lambda: next(peaks))
    monkeypatch.setattr(steptime, "compiled_memory", lambda compiled: {"peak_bytes": 200})
    variant = parse_variant("mixflow+remat+save")
    (row,) = steptime.measure(run_config("maml", models.preset("tiny"), 16, 2, 2, variant=variant), [variant],
                              "mixflow+remat+save", rounds=2, warmup=1)
    assert (row["peak_before_steps_bytes"], row["measured_peak_bytes"], row["process_peak_bytes"]) == (100, 250, 250)
    assert row["peak_bytes"] == 200 and row["steps_run"] == 3


def test_bench_time_bad_variants_and_baseline(capsys):
    from metatrain.bench import steptime

    assert cli.main(["bench", "time", *TINY_FLAGS, "--variants", "mixflow+fast"]) == 2
    assert "unknown option(s) ['fast']" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--baseline revfwd is not among the variants"):
        steptime.measure(None, [parse_variant("mixflow")], "revfwd")  # refused before anything compiles


def _fake_compile(limits, seen=None):
    """A stand-in for compile_report where a preset fits when its parameter count is under the mode's limit. Above
    it the peak is 98.5% of HBM (the chip would hold it, the 98% margin does not) up to twice the limit, then 150%
    (refused first, compiled past the limit)."""
    def compile_report(cfg, topology, built=None):
        n, limit, hbm = models.param_count(cfg.model), limits(cfg), 95.74 * 2**30
        if seen is not None:
            seen.append((cfg.metagrad.mode, cfg.metagrad.kept_states, cfg.model.attention, cfg.model.compute_dtype,
                         cfg.model.remat))
        peak = hbm * (0.975 if n <= limit else 0.985 if n <= 2 * limit else 1.5)
        report = {"fits": peak <= hbm, "exact": True, "hbm_bytes": hbm, "peak_bytes": peak}
        return report | ({"refused_bytes": peak * 1.1, "message": "RESOURCE_EXHAUSTED"} if peak > hbm else {})
    return compile_report


def test_bench_time_past_the_memory_is_one_line_naming_the_variant(monkeypatch, capsys):
    """`bench time --model 6.8b` on a CPU ended in a JaxRuntimeError traceback from the state's allocation ("Out of
    memory allocating 45214600068 bytes"). Each variant's state is held against the memory here before it is
    allocated (on CPU: what the variants before it left), and an allocation the device refuses all the same is one
    line naming the variant."""
    import jax

    from metatrain import hostmem
    from metatrain.bench import steptime

    monkeypatch.setattr(hostmem, "available", lambda: 2**14)  # the tiny preset's state: 62,408 bytes
    code, _, err = cli_run(capsys, "bench", "time", *TINY_FLAGS, "--variants", "autodiff,mixflow",
                           "--baseline", "autodiff")
    assert code == 2
    one_line_error(err, "metatrain bench time: error: autodiff's state takes ", "available on this machine; use a "
                   "smaller model (--model, --n-layers)")
    runner = steptime._Runner.__new__(steptime._Runner)
    runner.name = "mixflow+remat+save"
    with pytest.raises(TrainingError, match=r"^mixflow\+remat\+save ran out of memory \(RESOURCE_EXHAUSTED: Out of "
                                            r"memory while trying to allocate 130\.22GiB\); time fewer variants"):
        with runner._out_of_memory():
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 130.22GiB.\n"
                                             "more lines")
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"), runner._out_of_memory():
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")  # not memory: as it was


def test_bench_fit_binary_search(monkeypatch, capsys):
    """Memory grows with the preset's size: the search must find the boundary with a handful of compiles."""
    compiled = []
    limits = {"autodiff": 300e6, "mixflow": 2.1e9}
    fake = _fake_compile(lambda cfg: limits[cfg.metagrad.mode], compiled)
    monkeypatch.setattr(largest_fit.compile_lib, "compile_report", fake)
    monkeypatch.setattr(aot, "libtpu_installed", lambda: True)  # the stand-in compiles: no libtpu needed
    assert cli.main(["bench", "fit", "--topology", "v5p:1x1x1"]) == 0
    out = capsys.readouterr().out
    assert "a preset fits when its exact peak is at most 98% of the chip's HBM" in out
    assert "does NOT fit: peak 94.30 GiB of 95.74 (98.5%)" in out  # on the chip, but not within the margin
    assert "largest that fits, autodiff+remat: 278m" in out
    assert "largest that fits, mixflow+remat+save: 2b" in out
    ratio = models.param_count(models.preset("2b")) / models.param_count(models.preset("278m"))
    assert f"ratio of parameter counts (mixflow+remat+save / autodiff+remat): {ratio:.2f}x" in out
    assert len(compiled) <= 2 * 6  # a binary search over 22 presets, not a sweep


def test_bench_fit_variant_model_options(monkeypatch, capsys, tmp_path):
    """`+sqrt+blockwise+bf16` reach the compiled program: the stand-in fits more only with all three."""
    seen = []
    full = lambda cfg: (cfg.metagrad.kept_states, cfg.model.attention, cfg.model.compute_dtype) == (
        "sqrt", "blockwise", "bfloat16")
    monkeypatch.setattr(largest_fit.compile_lib, "compile_report",
                        _fake_compile(lambda cfg: 4e9 if full(cfg) else 300e6, seen))
    monkeypatch.setattr(aot, "libtpu_installed", lambda: True)
    out = tmp_path / "fit.json"
    assert cli.main(["bench", "fit", "--topology", "v5p:1x1x1", "--json", str(out), "--variants",
                     "autodiff+remat,mixflow+remat+save,mixflow+remat+save+sqrt+blockwise+bf16"]) == 0
    text = capsys.readouterr().out
    assert "largest that fits, mixflow+remat+save: 278m" in text
    assert "largest that fits, mixflow+remat+save+sqrt+blockwise+bf16: 3.8b" in text
    assert "(mixflow+remat+save+sqrt+blockwise+bf16 / autodiff+remat)" in text
    assert ("mixflow", "sqrt", "blockwise", "bfloat16", True) in seen
    assert ("autodiff", "every_step", "dense", "", True) in seen
    assert [r["largest"] for r in json.loads(out.read_text())["results"]] == ["278m", "278m", "3.8b"]


def test_bench_fit_refuses_auto(capsys, monkeypatch):
    monkeypatch.setattr(aot, "libtpu_installed", lambda: True)
    assert cli.main(["bench", "fit", "--topology", "v5p:1x1x1", "metagrad.kept_states=auto"]) == 2
    assert "name the variants to compare instead" in capsys.readouterr().err


def test_parse_variant_names_round_trip():
    for name in ("autodiff", "mixflow+remat+save", "mixflow+remat+save+sqrt+blockwise+bf16", "revfwd+binomial"):
        assert parse_variant(name).name == name
    v = parse_variant("mixflow+bf16+blockwise+remat")  # any order; the name comes out canonical
    assert v.name == "mixflow+remat+blockwise+bf16" and v.model_options == ("blockwise", "bf16")
    tiny = models.preset("tiny")
    m = v.model(tiny)
    assert (m.attention, m.compute_dtype, m.remat) == ("blockwise", "bfloat16", True) and not tiny.remat
    for bad, says in (("mixflo+remat", "unknown mode"), ("mixflow+flash", "unknown option"),
                      ("mixflow+sqrt+binomial", "one kept-states schedule")):
        with pytest.raises(ConfigError, match=says):
            parse_variant(bad)


def test_rows_of_earlier_versions_resume_under_todays_names(tmp_path):
    """A --json file written before the renames (mode `default`, `+offload`, `+offload_opt`, `inner_checkpoint`) is
    read with today's names, so `--resume` keeps its rows."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps([{"variant": "default+remat", "inner_checkpoint": "every_step", "mode": "default"},
                                {"variant": "mixflow+remat+save+bf16_state+offload+offload_opt"}]))
    rows = common.read_rows(str(path))
    assert rows[0] == {"variant": "autodiff+remat", "kept_states": "every_step", "mode": "autodiff"}
    assert rows[1]["variant"] == "mixflow+remat+save+bf16_state+offload_states+offload_moments"
    assert parse_variant(rows[1]["variant"]).name == rows[1]["variant"]


def test_bench_generate_checks_the_cache_gives_the_uncached_tokens(tmp_path, capsys):
    """The two ways of generating give the same greedy tokens (timings are the benchmark's, not checked here)."""
    out = tmp_path / "gen.json"
    assert cli.main(["bench", "generate", "--model", "tiny", "--prompt-len", "5", "--new-tokens", "9", "--batch", "2",
                     "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["same_tokens"] is True and r["new_tokens"] == 9 and r["batch"] == 2
    assert r["seconds_per_token_cached"] > 0 and r["seconds_per_token_uncached"] > 0
    assert "ms/token with the KV cache" in capsys.readouterr().out


def test_bench_generate_on_a_model_past_the_memory_is_one_line(monkeypatch, capsys):
    """`bench generate --model 6.8b` on a 24 GiB machine: its parameters were allocated, then the process was killed
    for memory. They are held against the memory here first: the tiny preset's 5,200 float32 parameters."""
    from metatrain import hostmem

    monkeypatch.setattr(hostmem, "available", lambda: 5200 * 4 - 1)
    code, _, err = cli_run(capsys, "bench", "generate", "--model", "tiny")
    assert code == 2
    one_line_error(err, "metatrain bench generate: error: the model's parameters take 20.3 KiB, more than the 20.3 KiB "
                   "available on this machine; use a smaller model (--model, --n-layers) or fewer tokens")
    monkeypatch.setattr(hostmem, "available", lambda: 5200 * 4)
    assert cli_run(capsys, "bench", "generate", "--model", "tiny", "--prompt-len", "2", "--new-tokens", "2")[0] == 0
