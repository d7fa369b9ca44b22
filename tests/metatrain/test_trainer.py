"""The Trainer end to end on the shared tiny run: what it prints and logs, checked against independent
recomputations, and the same compiled program in the Trainer, `metatrain compile` and `bench memory`."""

import dataclasses
import json
import os
import struct

import jax
import numpy as np
import pytest
from helpers import TINY, one_line_error, saved_state

from metatrain import cli
from metatrain import config as config_lib
from metatrain.data.pipeline import Streams, to_global
from metatrain.tasks import make_task


def _lines(stdout):
    return {line.split(": ")[0]: line.split(": ", 1)[1] for line in stdout.strip().splitlines() if ": " in line}


def _rank_auc(scores, positive):
    """ROC AUC by the rank-sum formula (average ranks for ties): independent of the Trainer's pairwise count."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    n_pos, n_neg = positive.sum(), (~positive).sum()
    return (ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def test_closing_lines_match_an_independent_evaluation(shared_run):
    """The printed AUC and validation losses are recomputed here from the saved state and held-out data."""
    lines = _lines(shared_run["stdout"])
    workdir = shared_run["workdir"]
    cfg = config_lib.load(os.path.join(workdir, "config.yaml"))
    streams = Streams(cfg.data)
    model = cfg.model.replace(vocab_size=streams.tokenizer.vocab_size)
    task = make_task(cfg.task, model=model, inner_lr=cfg.inner_lr)
    state = saved_state(workdir, 4)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    batches = [to_global(b, device) for b in streams.test_batches(8, cfg.data.corrupt_fraction, seed=777)]
    scores, flags = [], []
    for b in batches:  # max(eval_batches, 8); this sample has both classes
        scores.append(np.asarray(task.scores(state["meta"], b)))
        flags.append(np.asarray(b["corrupted"]))
    scores, flags = np.concatenate(scores), np.concatenate(flags).astype(bool)
    assert 0 < flags.sum() < len(flags)
    assert float(lines["corrupted-example AUC"]) == round(_rank_auc(scores, ~flags), 3)

    test = [to_global(b, device) for b in streams.test_batches(cfg.eval_batches)]
    loss = lambda theta: float(np.mean([task.example_losses(theta, b).mean() for b in test]))
    start, end = (float(x) for x in lines["validation loss"].split(" -> "))
    assert abs(end - loss(state["inner"][0])) < 1e-4
    assert abs(float(lines["baseline validation loss"]) - loss(state["base"]["inner"][0])) < 1e-4
    assert abs(start - np.log(model.vocab_size)) < 0.5  # a fresh model: about uniform next-token guesses


def test_the_compile_is_said_before_it_starts_and_timed_after(shared_run):
    """Nothing was printed while the outer step compiled (seconds here, minutes for a large model): the run was silent
    from its start to its first lines."""
    err, out = shared_run["stderr"].splitlines(), shared_run["stdout"].splitlines()
    plan = next(i for i, line in enumerate(err) if line.startswith("meta-gradient: "))
    assert "compiling the outer step ..." in err and err.index("compiling the outer step ...") < plan
    compiled = [line for line in out if line.startswith("outer step compiled in ")]
    assert len(compiled) == 1 and float(compiled[0].split()[4]) > 0, compiled


def test_evaluation_rows_match_an_independent_evaluation(shared_run):
    """The step-4 evaluation row: the closing lines' figures, and weight statistics recomputed from the state."""
    lines = _lines(shared_run["stdout"])
    workdir = shared_run["workdir"]
    row = [json.loads(x) for x in open(workdir / "metrics.jsonl") if "eval_" in x][-1]
    assert row["step"] == 4 and f"{row['eval_auc']:.3f}" == lines["corrupted-example AUC"]
    assert f"{row['eval_validation_loss']:.4f}" == lines["validation loss"].split(" -> ")[1]
    assert f"{row['eval_baseline_validation_loss']:.4f}" == lines["baseline validation loss"]
    cfg = config_lib.load(os.path.join(workdir, "config.yaml"))
    streams = Streams(cfg.data)
    task = make_task(cfg.task, model=cfg.model.replace(vocab_size=streams.tokenizer.vocab_size), inner_lr=cfg.inner_lr)
    meta = saved_state(workdir, 4)["meta"]
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    batches = [to_global(b, device) for b in streams.test_batches(8, cfg.data.corrupt_fraction, seed=777)]
    weights = np.stack([np.asarray(task.weights(meta, b)) for b in batches])  # [8, batch]
    flags = np.stack([np.asarray(b["corrupted"]) for b in batches]).astype(bool)
    ess = np.mean(weights.sum(1) ** 2 / (weights ** 2).sum(1)) / weights.shape[1]
    assert abs(row["eval_weight_ess"] - ess) < 1e-5 and 0 < ess <= 1
    assert abs(row["eval_weight_clean"] - weights[~flags].mean()) < 1e-5
    assert abs(row["eval_weight_corrupted"] - weights[flags].mean()) < 1e-5
    saved = json.loads((workdir / "eval_weights.json").read_text())
    np.testing.assert_allclose(saved["weights"], weights.ravel(), rtol=1e-5)
    assert saved["corrupted"] == flags.ravel().astype(int).tolist()
    assert float(lines["evaluation"].split(" s ")[0]) > 0 and lines["plot"].endswith("curves.png")


def _tensorboard_scalars(logdir):
    """{tag: [(step, value)]} read from the TFRecord-framed Event protos tensorboardX wrote."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for name in os.listdir(logdir):
        data = open(os.path.join(logdir, name), "rb").read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
    return scalars


def test_metrics_reach_jsonl_tensorboard_and_wandb_alike(shared_run):
    workdir = shared_run["workdir"]
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    rows, evals = [r for r in rows if "outer_loss" in r], [r for r in rows if "eval_validation_loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["meta_grad_norm"]) for r in rows)
    assert [r["step"] for r in evals] == [2, 4]  # eval_every=2
    scalars = _tensorboard_scalars(workdir / "tensorboard")
    for key in ("outer_loss", "baseline_outer_loss", "meta_grad_norm"):
        assert scalars[key] == [(r["step"], np.float32(r[key])) for r in rows]
    calls = [json.loads(line) for line in open(shared_run["wandb"])]
    init = calls[0]
    assert init["call"] == "init" and init["resume"] == "allow" and init["name"] == "run"
    assert init["id"] == (workdir / "wandb_id").read_text().strip() and "model.d_model" in init["config_keys"]
    logged = [c for c in calls if c["call"] == "log" and "outer_loss" in c["data"]]
    assert [(c["step"], c["data"]["outer_loss"]) for c in logged] == [(r["step"], r["outer_loss"]) for r in rows]
    assert calls[-1]["call"] == "finish"
    assert (workdir / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [2, 4]


@pytest.mark.slow
def test_trainer_compile_and_bench_memory_compile_the_same_program(shared_run, tmp_path, capsys):
    """One config, three tools: equal memory_analysis() figures (a different program would differ)."""
    trainer = json.loads((shared_run["workdir"] / "outer_step.json").read_text())
    model_flags = ["--task", "loss_weighting", "--model", "tiny", "--vocab", "300", "--d-model", "16", "--n-heads",
                   "2", "--d-ff", "32", "--n-layers", "1", "--seq-len", "16", "--batch", "8", "--inner-steps", "2"]
    model_flags += ["--no-scan-layers"]  # the default preset's model.scan_layers=false
    same_run = ["baseline=uniform", "inner_lr=0.01", "steps=4"]  # and the default preset's model.remat=false
    assert cli.main(["compile", *model_flags, "--no-remat", "--json", str(tmp_path / "c.json"), *same_run]) == 0
    said = capsys.readouterr().out  # a tiny peak in MiB (it was "0.00 GiB per device")
    peak = json.loads((tmp_path / "c.json").read_text())["peak_bytes"]
    assert f"the peak, {peak / 2**20:.1f} MiB per device, is this process's memory" in said, said
    census = json.loads((tmp_path / "c.json").read_text())["census"]  # its kernels, read off the compiled program
    assert f"kernels: {census['kernels']:,} per call, " in said and census["flops"] > 0 and census["trip_counts_known"]
    assert cli.main(["bench", "memory", *model_flags, "--variants", "mixflow+save", "--baseline", "mixflow+save",
                     "--json", str(tmp_path / "m.json"), *same_run]) == 0
    compiled = json.loads((tmp_path / "c.json").read_text())
    (bench,) = json.loads((tmp_path / "m.json").read_text())
    keys = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes")
    assert trainer["mode"] == "mixflow" and trainer["alias_bytes"] > 0  # the state is donated
    assert trainer["plan"] == "two_steps+peeled"  # T=2, saved gradients; no block remat in the default preset
    assert [trainer[k] for k in keys] == [compiled[k] for k in keys] == [bench[k] for k in keys]
    # a different program is told apart: block remat on changes the temporaries
    assert cli.main(["compile", *model_flags, "--json", str(tmp_path / "other.json"), *same_run]) == 0
    assert json.loads((tmp_path / "other.json").read_text())["temp_bytes"] != trainer["temp_bytes"]


def test_compile_config_compiles_the_runs_own_program(shared_run, tmp_path, capsys):
    """`metatrain compile --config WORKDIR` compiles the run's own config (its saved config.yaml holds the model's
    default vocabulary: the run's follows its tokenizer's 300 ids, as here): the program the Trainer compiled, to
    the byte. Beside --config the problem flags are refused, and what is not a run config is named."""
    trainer = json.loads((shared_run["workdir"] / "outer_step.json").read_text())
    assert cli.main(["compile", "--config", str(shared_run["workdir"]), "--json", str(tmp_path / "c.json")]) == 0
    compiled = json.loads((tmp_path / "c.json").read_text())
    keys = ("mesh", "plan", "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes")
    assert [trainer[k] for k in keys] == [compiled[k] for k in keys]
    assert compiled["model"]["vocab_size"] == 300 and "model=" + str(shared_run["workdir"]) in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    (tmp_path / "auto.yaml").write_text("metagrad:\n  mode: auto\n")
    for argv, says in [(["--batch", "8"], "--batch with --config: the run config gives the task, model, shapes and "
                                          "mesh; change them as overrides after it (e.g. data.batch=8"),
                       (["--model", "44m"], "--model with --config"),
                       (["--no-remat"], "--no-remat with --config"),
                       (["data.batch=16", "mesh"], "override 'mesh': write overrides as key=value"),
                       ]:
        assert cli.main(["compile", "--config", str(shared_run["workdir"]), *argv]) == 2
        one_line_error(capsys.readouterr().err, says)
    for config, says in [(tmp_path / "empty", "a folder without config.yaml; give a run's work dir, a YAML file"),
                         ("nothere", "--config: no config 'nothere'; choose one of"),
                         (tmp_path / "auto.yaml", "metagrad.mode / metagrad.kept_states auto: a run picks one")]:
        assert cli.main(["compile", "--config", str(config)]) == 2
        one_line_error(capsys.readouterr().err, says)


@pytest.mark.slow
def test_mode_auto_picks_the_lowest_peak_of_the_real_candidates(tmp_path):
    """metagrad.mode=auto and metagrad.kept_states=auto: six candidates, their figures those of the programs `compile`
    makes (checked on two of them), and the one the run uses is the lowest peak (ties within 1%: fewest FLOPs)."""
    from metatrain import auto
    from metatrain.bench.compile import compile_report
    from metatrain.sharding import make_mesh

    # two layers: with TINY's one, the kept states are too small beside the logits for sqrt's saving to show in the
    # peak under every compiler (jax 0.11: sqrt 1,770,549 bytes, every_step 1,770,237)
    cfg = config_lib.load(None, [*TINY, "task=maml", "model.n_layers=2", "metagrad.mode=auto",
                                 "metagrad.kept_states=auto", "data.inner_steps=4", f"workdir={tmp_path}"])
    cfg = dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=300))
    choice, program, _ = auto.choose(cfg, make_mesh(cfg.mesh))
    figures = choice["candidates"]
    assert set(figures) == {f"{m}+{s}" for m in ("autodiff", "mixflow", "revfwd") for s in ("every_step", "sqrt")}
    # the chosen candidate and one other, compiled as `metatrain compile` does (all six: twelve compiles, ~100 s)
    other = next(n for n, f in figures.items() if f["mode"] != choice["mode"])
    for name in (f"{choice['mode']}+{choice['kept_states']}", other):
        f = figures[name]
        one = dataclasses.replace(cfg, metagrad=dataclasses.replace(cfg.metagrad, mode=f["mode"],
                                                                    kept_states=f["kept_states"]))
        assert compile_report(one)["peak_bytes"] == f["peak_bytes"], name
    lowest = min(f["peak_bytes"] for f in figures.values())
    tied = {n: f for n, f in figures.items() if f["peak_bytes"] <= 1.01 * lowest}
    best = min(tied, key=lambda n: tied[n]["flops"])
    assert (choice["mode"], choice["kept_states"]) == (figures[best]["mode"], figures[best]["kept_states"])
    assert program.method.mode == choice["mode"] and program.method.kept_states == choice["kept_states"]
    # at T=4 keeping 2 segment starts instead of 4 states must show: sqrt's best peak is below every_step's
    peak = lambda s: min(f["peak_bytes"] for f in figures.values() if f["kept_states"] == s)
    assert peak("sqrt") < peak("every_step")


@pytest.mark.slow
def test_a_resumed_auto_run_takes_its_first_starts_choice(tmp_path, monkeypatch, capsys):
    """`metatrain train metagrad.mode=auto` (it stopped at the state's shapes: "unknown meta-gradient mode 'auto'")
    compiles its three candidates and runs the lowest peak; a resume on the same devices compiles the chosen one
    alone; where the devices, mesh, JAX or memory settings differ it chooses again. (The chosen program is the one
    the first start ran, so the resumed steps are those of an uninterrupted run, as tests/metatrain/test_resume.py
    shows for any program.)"""
    from metatrain import auto

    run = [*TINY, "task=maml", "metagrad.mode=auto", "checkpoint_every=2", "eval_every=0", f"workdir={tmp_path}"]
    assert cli.main(["train", *run, "steps=2"]) == 0
    choice = json.loads((tmp_path / "mode_auto.json").read_text())
    assert len(choice["candidates"]) == 3 and choice["where"]["mesh"] == {"data": 1, "fsdp": 1}
    said = capsys.readouterr()
    assert "auto: autodiff peak" in said.err and f"meta-training maml (auto: {choice['mode']})" in said.out
    assert json.loads((tmp_path / "outer_step.json").read_text())["mode"] == choice["mode"]

    def refused(*args):
        raise AssertionError("chose again")

    monkeypatch.setattr(auto, "choose", refused)
    assert cli.main(["train", *run, "steps=4", "--resume"]) == 0
    assert (f"auto: metagrad.mode={choice['mode']} metagrad.kept_states={choice['kept_states']}, the choice of the "
            f"run's first start ({tmp_path / 'mode_auto.json'})") in capsys.readouterr().err
    assert json.loads((tmp_path / "outer_step.json").read_text())["mode"] == choice["mode"]
    # other memory settings (metagrad.* may change on resume), or another JAX, devices or mesh: chosen again
    with pytest.raises(AssertionError, match="chose again"):
        cli.main(["train", *run, "steps=6", "metagrad.save_inner_grads=false", "--resume"])
    (tmp_path / "mode_auto.json").write_text(json.dumps(choice | {"where": choice["where"] | {"jax": "0.0.0"}}))
    with pytest.raises(AssertionError, match="chose again"):
        cli.main(["train", *run, "steps=6", "--resume"])


def test_roc_auc_against_the_rank_formula():
    from metatrain.tasks.weight_eval import roc_auc

    rng = np.random.default_rng(0)
    scores = np.round(rng.normal(size=200), 1)  # many ties
    positive = rng.random(200) < 0.3
    assert abs(roc_auc(scores, positive) - _rank_auc(scores, positive)) < 1e-12
    assert roc_auc(np.array([1.0, 2.0, 3.0]), np.array([0, 1, 1])) == 1.0
    assert np.isnan(roc_auc(np.array([1.0, 2.0]), np.array([1, 1])))
