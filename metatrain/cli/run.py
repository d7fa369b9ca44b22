"""`metatrain train | pretrain | export | import | plot`: runs, and models in and out of them."""

from __future__ import annotations

import argparse
import os

from metatrain import paths
from metatrain.cli import common
from metatrain.config import presets
from metatrain.export import FORMATS, WHATS

TEXT_FIELD_HELP = ("the field (JSONL) or column (Parquet, hf-disk) holding a document's text (default: the run's "
                   "data.text_field)")


def _refuse_the_other_kind(command: str, workdir: str) -> None:
    """`train` on a pretrain run's work dir (or `pretrain` on a meta-training run's) is refused before compiling,
    saying which command continues it."""
    from metatrain.errors import ConfigError
    from metatrain.run import PRETRAIN, Run

    kind = Run.kind_of(workdir)
    if kind is None:  # no run yet; or no config.yaml, no intact checkpoint: `run_config` or the Trainer says so
        return
    other = "train" if command == "pretrain" else "pretrain"
    if (kind == PRETRAIN) != (command == "pretrain"):
        start = f" (inner.init_from={workdir} starts a meta-training run from it)" if kind == PRETRAIN else ""
        raise ConfigError(f"workdir: {workdir} holds a `metatrain {other}` run; continue it with `metatrain {other}`, "
                          f"or give `metatrain {command}` a new workdir{start}")


def run_settings(args) -> tuple[str | None, list[str], str]:
    """(preset or None, key=value overrides, the command's default preset) of parsed `train`/`pretrain` arguments:
    a first argument without `=` is the preset; `--baseline` is the `baseline=` override."""
    preset, overrides = None, list(args.overrides)
    if overrides and "=" not in overrides[0]:
        preset, overrides = overrides[0], overrides[1:]
    if getattr(args, "baseline", None):
        overrides.append(f"baseline={args.baseline}")
    return preset, overrides, "pretrain" if args.command == "pretrain" else "default"


def cmd_train(args) -> int:
    """`train` and `pretrain`: the same loop, with or without a meta level."""
    from metatrain import config as config_lib
    from metatrain import distributed, tracking
    from metatrain import workdir as workdir_lib
    from metatrain.errors import ConfigError
    from metatrain.plot import plot_runs

    joined = distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout)
    preset, overrides, default_preset = run_settings(args)
    try:
        cfg, resume = workdir_lib.run_config(preset, overrides, args.resume, default_preset=default_preset)
    except ConfigError:  # a run of the other command is named as such, not by the settings where it differs
        _refuse_the_other_kind(args.command, config_lib.load(preset or default_preset, overrides).workdir)
        raise
    if joined == distributed.SINGLE:
        from metatrain.sharding import cpu_device_count, split_cpu

        split_cpu(cpu_device_count(cfg.mesh, cfg.data.batch, cfg.population.axis))
    # after the split: reading a checkpoint's metadata (Orbax) starts JAX's backends, and a resumed run would get
    # one CPU device where its first start had the split
    _refuse_the_other_kind(args.command, cfg.workdir)
    if args.command == "pretrain":
        from metatrain.pretrain import Pretrainer

        trainer = Pretrainer(cfg)
        what = f"pretraining for {cfg.steps} steps of {cfg.data.inner_steps} batches"
    else:
        from metatrain.trainer import Trainer

        trainer = Trainer(cfg)
        method = trainer.program.method  # under metagrad.mode=auto, the candidate chosen
        mode = cfg.metagrad.mode if method is None or method.mode == cfg.metagrad.mode else (
            f"{cfg.metagrad.mode}: {method.mode}")
        what = f"meta-training {cfg.task} ({mode}) for {cfg.steps} outer steps"
        p = cfg.population
        if p.size > 1:
            what += (f", a population of {p.size} (reduce {p.reduce}"
                     + (f", each reset every {p.lifetime} steps, staggered" if p.lifetime else "")
                     + (", side by side over the population mesh axis)" if p.axis else ")"))
    if resume:
        step = trainer.restore()
        if trainer.is_main:
            print(f"resuming the run in {cfg.workdir} from step {step} (its saved config, with your overrides)")
    if trainer.is_main:
        config_lib.write_text(workdir_lib.config_path(cfg.workdir), config_lib.to_yaml(cfg))
        m = trainer.memory
        print(f"{what} in {cfg.workdir}, {trainer.mesh.shape['data']}x{trainer.mesh.shape['fsdp']} "
              f"(data x fsdp) {trainer.mesh.devices.flat[0].device_kind} devices, {joined}"
              + (f", inner model from {cfg.inner.init_from}" if cfg.inner.init_from else ""))
        print(f"outer step compiled in {trainer.compile_seconds:.1f} s: peak {m['peak_bytes'] / 2**20:,.1f} MiB per "
              f"device (arguments {m['argument_bytes'] / 2**20:,.1f}, temporaries {m['temp_bytes'] / 2**20:,.1f})",
              flush=True)
    summary = trainer.train()
    if trainer.is_main:
        log_dir = workdir_lib.log_dir(cfg.workdir)
        plot = plot_runs([log_dir])
        tracking.copy_logs(log_dir, cfg.workdir)
        seconds = summary["seconds"]
        extremes = summary.get("weight_extremes")
        if extremes:
            for title, rows in (("lowest", extremes[0]), ("highest", extremes[1])):
                print(f"{title}-weighted held-out documents (id, weight, text):")
                for r in rows:
                    print(f"  {str(r['id'])[:40]:<12} {r['weight']:6.3f}  {r['text']}")
        print(f"evaluation: {summary['eval_seconds']:.1f} s ({100 * summary['eval_seconds'] / max(seconds, 1e-9):.1f}% "
              f"of the run's time)")
        print(f"time: {seconds:.0f} s, skipped updates: {summary['skipped_updates']}")
        auc = summary.get("corrupted_auc")
        if auc is not None:
            print(f"corrupted-example AUC: {auc:.3f}" if auc == auc else
                  "corrupted-example AUC: n/a (the held-out sample has only one class; raise data.shuffle_window)")
        if "baseline_validation_loss" in summary:
            print(f"baseline validation loss: {summary['baseline_validation_loss']:.4f}")
        print(f"validation loss: {summary['start_validation_loss']:.4f} -> {summary['end_validation_loss']:.4f}")
        print(f"plot: {plot}")
    return 0


def cmd_export(args) -> int:
    from metatrain.export import export

    out, what = export(args.src, args.out, args.what, args.format, args.adapters, args.overwrite)
    print(f"wrote {out}: {what}")
    return 0


def cmd_import_hf(args) -> int:
    from metatrain.export import import_hf
    from metatrain.models import param_count

    out, cfg = import_hf(args.dir, args.out, args.overwrite)
    print(f"wrote {out}: {param_count(cfg):,} parameters ({cfg.n_layers} layers, d_model {cfg.d_model}, vocab "
          f"{cfg.vocab_size}); train from it with inner.init_from={out}")
    return 0


def cmd_scores(args) -> int:
    from metatrain.scores import scores

    out, n = scores(args.workdir, args.data, args.out, args.max_rows, args.overwrite, args.text_field)
    print(f"wrote {out}: score and weight of {n:,} documents")
    return 0


def cmd_filter(args) -> int:
    from metatrain import distributed
    from metatrain.data.pipeline import DataConfig
    from metatrain.filtering import filter_corpus

    # SIGTERM stays with this program: filter stops as it does alone (each process keeps the scores it has)
    distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout,
                           preemption_notices=False)
    m = filter_corpus(args.run, args.data, args.out, args.drop, args.method, args.batch, args.seed, args.cdf_sample,
                      args.score_batch, args.max_rows, args.text_field)
    import jax

    if jax.process_index() == 0:
        d, t = m["documents"], m["tokens"]
        print(f"kept {d['kept']:,} of {d['in']:,} documents ({100 * d['kept_fraction']:.2f}%), {t['kept']:,} of "
              f"{t['in']:,} tokens; {m['documents_per_second']:,.0f} documents/s"
              + (f" (going on from {m['documents_scored_before']:,} scored before)" if m["documents_scored_before"]
                 else ""))
        out = paths.local(args.out)
        field = "" if m["text_field"] == DataConfig.text_field else f" data.text_field={m['text_field']}"
        print(f"wrote {os.path.join(out, 'manifest.json')} and {', '.join(m['outputs']) or 'no file'}; train on them "
              f"with data.source={m['format']}:{os.path.join(out, '*.' + m['format'])}{field}")
    return 0


def cmd_eval(args) -> int:
    from metatrain.scores import evaluate, perplexity

    results = evaluate(args.workdir, args.data, args.max_docs, args.max_rows, args.text_field)
    where = args.data or "the run's validation documents"
    print(f"next-token loss on {where}:")
    for name, loss in results:
        print(f"  {name:<26} loss {loss:.4f}  perplexity {perplexity(loss):,.2f}")
    return 0


def cmd_plot(args) -> int:
    from metatrain.plot import plot_runs

    print(f"wrote {plot_runs(args.workdirs, args.out)}")
    return 0


def _add_distributed_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("multi-host", "explicit multi-process start (TPU VM slices and SLURM are detected)")
    g.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (env METATRAIN_COORDINATOR)")
    g.add_argument("--num-processes", type=common.positive_int, default=None, help="env METATRAIN_NUM_PROCESSES")
    g.add_argument("--process-id", type=common.nonnegative_int, default=None, help="env METATRAIN_PROCESS_ID")
    g.add_argument("--heartbeat-timeout", type=common.positive_int, default=60,
                   help="seconds without heartbeats after which a process counts as dead and the job stops")


def register(sub) -> None:
    names = ", ".join(sorted(presets()))
    p = sub.add_parser("train", help="meta-training; no arguments: the built-in default job")
    p.add_argument("overrides", nargs="*", metavar="PRESET|KEY=VALUE",
                   help=f"[PRESET] key=value ... (presets: {names}; or a .yaml path)")
    p.add_argument("--resume", action="store_true", help="continue the run in the work dir (needs a checkpoint)")
    p.add_argument("--baseline", choices=["none", "uniform"], default=None,
                   help="also train with η frozen (loss weighting: exactly uniform weights) on the same data")
    _add_distributed_args(p)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("pretrain", help="plain next-token training with the same stack (a base model)")
    p.add_argument("overrides", nargs="*", metavar="PRESET|KEY=VALUE",
                   help="[PRESET] key=value ... (default preset: pretrain)")
    p.add_argument("--resume", action="store_true", help="continue the run in the work dir (needs a checkpoint)")
    _add_distributed_args(p)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("export", help="a run's (or an export/import dir's) parameters, as an export dir or a "
                                      "Hugging Face model dir")
    p.add_argument("src", metavar="SRC", help="a run's work dir, or an export / import dir")
    p.add_argument("--what", choices=WHATS, default=None,
                   help="inner: the fine-tuned model; meta: η; baseline: the uniform baseline's model "
                        "(default: inner for --format hf, meta for orbax; a pretrain run's model either way)")
    p.add_argument("--format", choices=FORMATS, default="orbax",
                   help="orbax: an export dir for inner.init_from; hf: config.json + model.safetensors (+ tokenizer "
                        "files) that transformers loads")
    p.add_argument("--out", default=None, help="output dir, new or empty (default SRC/export or SRC/hf)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --out (never files that metatrain did not write)")
    p.add_argument("--adapters", action="store_true",
                   help="a LoRA run: write the adapters alone (orbax: an export dir; hf: PEFT's "
                        "adapter_model.safetensors + adapter_config.json); without it the model is merged into its "
                        "base")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("import", help="bring a pretrained model in")
    kinds = p.add_subparsers(dest="kind", required=True, metavar="KIND")
    q = kinds.add_parser("hf", help="a local Hugging Face model dir (llama, qwen2) -> an export dir for "
                                    "inner.init_from (inner.init_from=hf:DIR does it in one step)")
    q.add_argument("dir", metavar="DIR", help="config.json + model.safetensors (or a sharded index) + tokenizer files")
    q.add_argument("--out", required=True, help="the export dir to write (new or empty)")
    q.add_argument("--overwrite", action="store_true",
                   help="replace an earlier import in --out (never files that metatrain did not write)")
    q.set_defaults(fn=cmd_import_hf)
    p = sub.add_parser("scores", help="per-document score and learned weight of a run's final η, as JSON lines")
    p.add_argument("workdir", metavar="RUN", help="a `metatrain train` work dir (a task with scores: loss_weighting)")
    p.add_argument("--data", default=None, help="a data source (jsonl:, parquet:, dir:, hf-disk:, tfds:, builtin; "
                                                "default: the run's data.source)")
    p.add_argument("--out", default=None, help="default: WORKDIR/scores.jsonl (its folder is made; never one of the "
                                               "inputs)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--max-rows", type=common.positive_int, default=4,
                   help="score a document by its first N rows of seq_len+1")
    p.add_argument("--text-field", default=None, metavar="FIELD", help=TEXT_FIELD_HELP)
    p.set_defaults(fn=cmd_scores)
    p = sub.add_parser("filter", help="keep 1-ρ of a corpus by a loss-weighting run's scores (curated data out)")
    p.add_argument("run", metavar="RUN", help="a `metatrain train` work dir of task loss_weighting")
    p.add_argument("--data", required=True, help="jsonl:PATH_OR_GLOB or parquet:PATH_OR_GLOB (written back as it is)")
    p.add_argument("--out", required=True, help="a new directory: part-*.jsonl|parquet and manifest.json (or the OUT "
                                                "of a filter stopped while scoring: it goes on from its scores)")
    p.add_argument("--drop", type=common.fraction("the fraction to drop"), required=True,
                   help="ρ, the fraction of documents to drop, in (0, 1)")
    p.add_argument("--method", choices=["topk", "p_accept"], default="topk",
                   help="topk: the best B of every B/(1-ρ) drawn; p_accept: each kept with the probability it "
                        "would be in a batch's top B(1-ρ)")
    p.add_argument("--batch", type=common.positive_int, default=256, help="B (default 256)")
    p.add_argument("--seed", type=common.nonnegative_int, default=0, help="topk's draws and p_accept's coins")
    p.add_argument("--cdf-sample", type=common.positive_int, default=1_000_000,
                   help="p_accept: the scores' CDF from all documents up to this many, else from a sample this big")
    p.add_argument("--score-batch", type=common.positive_int, default=64, help="rows per scoring call")
    p.add_argument("--max-rows", type=common.positive_int, default=4,
                   help="score a document by its first N rows of seq_len+1")
    p.add_argument("--text-field", default=None, metavar="FIELD", help=TEXT_FIELD_HELP)
    _add_distributed_args(p)
    p.set_defaults(fn=cmd_filter)
    p = sub.add_parser("eval", help="loss and perplexity of a run's inner model, its baseline and its start (a "
                                    "pretrain run: its model)")
    p.add_argument("workdir", metavar="RUN", help="a `metatrain train` or `metatrain pretrain` work dir")
    p.add_argument("--data", default=None, help="a data source (default: the run's validation documents)")
    p.add_argument("--max-docs", type=common.nonnegative_int, default=0, help="evaluate the first N documents (0: all)")
    p.add_argument("--max-rows", type=common.positive_int, default=16,
                   help="rows of seq_len+1 per document (longer: cut)")
    p.add_argument("--text-field", default=None, metavar="FIELD", help=TEXT_FIELD_HELP)
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("plot", help="the run report (PNG): held-out loss learned vs baseline, AUC, weights, losses")
    p.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="one or more work dirs, overlaid by name")
    p.add_argument("--out", default=None, help="a PNG file, or a directory to write curves.png in (default: the "
                                               "first WORKDIR)")
    p.set_defaults(fn=cmd_plot)
