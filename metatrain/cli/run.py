"""`metatrain train | pretrain | export | plot`: runs and what comes out of them."""

from __future__ import annotations

import argparse

from metatrain.config import CONFIG_DIR


def cmd_train(args) -> int:
    """`train` and `pretrain`: the same loop, with or without a meta level."""
    from metatrain import config as config_lib
    from metatrain import distributed, tracking
    from metatrain import workdir as workdir_lib
    from metatrain.plot import plot_run

    joined = distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout)
    preset, overrides = None, list(args.overrides)
    if overrides and "=" not in overrides[0]:
        preset, overrides = overrides[0], overrides[1:]
    if getattr(args, "baseline", None):
        overrides.append(f"baseline={args.baseline}")
    cfg, resume = workdir_lib.run_config(preset, overrides, args.resume,
                                         default_preset="pretrain" if args.command == "pretrain" else "default")
    if args.command == "pretrain":
        from metatrain.pretrain import Pretrainer

        trainer = Pretrainer(cfg)
        what = f"pretraining for {cfg.steps} steps of {cfg.data.inner_steps} batches"
    else:
        from metatrain.trainer import Trainer

        trainer = Trainer(cfg)
        what = f"meta-training {cfg.task} ({cfg.mode}) for {cfg.steps} outer steps"
    if resume:
        step = trainer.restore()
        if trainer.is_main:
            print(f"resuming the run in {cfg.workdir} from step {step} (its saved config, with your overrides)")
    if trainer.is_main:
        config_lib.write_text(workdir_lib.config_path(cfg.workdir), config_lib.to_yaml(cfg))
        m = trainer.memory
        print(f"{what} in {cfg.workdir}, {trainer.mesh.shape['data']}x{trainer.mesh.shape['fsdp']} "
              f"(data x fsdp) devices, {joined}"
              + (f", inner model from {cfg.inner.init_from}" if cfg.inner.init_from else ""))
        print(f"outer step compiled: peak {m['peak_bytes'] / 2**20:,.1f} MiB per device (arguments "
              f"{m['argument_bytes'] / 2**20:,.1f}, temporaries {m['temp_bytes'] / 2**20:,.1f})", flush=True)
    summary = trainer.train()
    if trainer.is_main:
        log_dir = workdir_lib.log_dir(cfg.workdir)
        print(f"plot: {plot_run(log_dir)}")
        tracking.copy_logs(log_dir, cfg.workdir)
        print(f"time: {summary['seconds']:.0f} s, skipped updates: {summary['skipped_updates']}")
        auc = summary.get("corrupted_auc")
        if auc is not None:
            print(f"corrupted-example AUC: {auc:.3f}" if auc == auc else
                  "corrupted-example AUC: n/a (the held-out sample has only one class; raise data.shuffle_window)")
        if "baseline_validation_loss" in summary:
            print(f"baseline validation loss: {summary['baseline_validation_loss']:.4f}")
        print(f"validation loss: {summary['start_validation_loss']:.4f} -> {summary['end_validation_loss']:.4f}")
    return 0


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


def register(sub) -> None:
    presets = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    p = sub.add_parser("train", help="meta-training; no arguments: the built-in default job")
    p.add_argument("overrides", nargs="*", help=f"[PRESET] key=value ... (presets: {presets}; or a .yaml path)")
    p.add_argument("--resume", action="store_true", help="continue the run in the work dir (needs a checkpoint)")
    p.add_argument("--baseline", choices=["none", "uniform"], default=None,
                   help="also train with η frozen at its start (uniform weights) on the same data")
    _add_distributed_args(p)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("pretrain", help="plain next-token training with the same stack (a base model)")
    p.add_argument("overrides", nargs="*", help="[PRESET] key=value ... (default preset: pretrain)")
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
