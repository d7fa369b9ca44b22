"""`metatrain bench memory | time | fit` and `metatrain compile`: the Trainer's outer step, measured."""

from __future__ import annotations

import os

from metatrain import argtypes, paths, progress
from metatrain.cli import common
from metatrain.errors import ConfigError
from metatrain.mixflow import MODES, mode_name

LADDER_DEFAULT = "44m,140m,489m,1b"
TASKS_DEFAULT = "maml,learned_lr,loss_weighting"
TPU_MESH = ["mesh.fsdp=-1", "mesh.data=-1"]  # FSDP over all the topology's chips (or GPUs)


def _config(args, model, overrides=()):
    from metatrain.bench.variants import run_config

    return run_config(args.task, model, args.seq_len, args.batch, args.inner_steps, list(overrides))


def cmd_bench_memory(args) -> int:
    import jax

    from metatrain import models
    from metatrain.aot import topology_backend
    from metatrain.bench import memory, report
    from metatrain.bench.variants import run_config, variants

    if args.resume and not args.json:
        raise ConfigError("--resume keeps the rows of the --json file: give --json PATH too")
    topology = args.topology or {"tpu": "v5p:1x1x1", "gpu": "h100"}.get(args.backend)
    if topology and topology_backend(topology) != args.backend:
        want = topology_backend(topology)
        raise ConfigError(f"--topology {topology} is for --backend {want} ({want.upper()} ahead of time); drop it or "
                          f"add --backend {want}")
    for flag, grid in (("models", "ladder"), ("tasks", "tasks"), ("layers", "layers")):
        if getattr(args, flag) is not None and args.grid != grid:  # else it would be left out without a word
            raise ConfigError(f"--{flag} is for --grid {grid}; add --grid {grid} (this run's grid is {args.grid}) or "
                              f"drop --{flag}")
    args.plot = args.plot and paths.image_file(args.plot, "--plot")  # before any compile, as --json
    args.timeline = args.timeline and paths.image_file(args.timeline, "--timeline")
    mesh = TPU_MESH if topology else []
    tasks, names = [args.task], {}
    default_variants = "autodiff+remat,mixflow+remat+save"
    if args.grid == "ablation":
        model_list = [common.model(args)]
        default_variants = ",".join(v.name for v in variants(("autodiff", "mixflow"), "every_step"))
    elif args.grid == "layers":
        model_list = [common.model(args, n_layers=n) for n in args.layers or [2, 4, 8, 16]]
    elif args.grid == "ladder":
        ladder = [m.strip() for m in (LADDER_DEFAULT if args.models is None else args.models).split(",")]
        model_list = [models.preset(m, **common.model_options(args)) for m in ladder]
        names = {models.param_count(m): name for name, m in zip(ladder, model_list)}
    else:  # tasks
        model_list = [common.model(args)]
        tasks = [t.strip() for t in (TASKS_DEFAULT if args.tasks is None else args.tasks).split(",")]
        if not all(tasks):
            raise ConfigError(f"--tasks {args.tasks!r}: a comma list of task names, e.g. maml,learned_lr")
    configs = [run_config(t, m, args.seq_len, args.batch, args.inner_steps, [*mesh, *args.overrides])
               for t in tasks for m in model_list]
    chosen = common.variants(args, args.variants or default_variants, args.baseline)
    where = ({"tpu": f"TPU {topology} (ahead of time, libtpu)", "gpu": f"GPU {topology} (ahead of time, CUDA plugin)"}
             [args.backend] if topology else f"{jax.default_backend()} (ahead of time)")
    print(f"bench memory: grid={args.grid} on {where}, {len(configs) * len(chosen)} compiles of the Trainer's outer "
          f"step, B={args.batch} S={args.seq_len} T={args.inner_steps}", flush=True)
    done = common.read_rows(args.json) if args.resume else []
    try:
        rows = memory.run(configs, chosen, baseline=args.baseline, topology=topology, progress=progress.lines,
                          with_breakdown=args.breakdown or bool(args.timeline), done=done,
                          save=(lambda rows: common.write_json(args.json, rows, quiet=True)) if args.json else None)
    except KeyboardInterrupt as stop:  # the stop's line says where the rows measured so far are
        kept = len(common.read_rows(args.json)) if args.json else 0
        if kept:
            stop.note = (f"{kept} row{'s' * (kept > 1)} in {args.json}; the same command with --resume measures "
                         f"the rest")
        raise
    print(memory.table(rows, args.baseline))
    if args.breakdown or args.timeline:
        print()
        print(memory.breakdown_table(rows))
    if args.grid == "ablation" and args.model in report.PAPER_ABLATION_TPU:
        print()
        print(report.ablation_comparison(rows, args.model))
    names_chosen = [v.name for v in chosen if v.name != args.baseline]
    if args.grid == "ladder" and names_chosen:
        other = "mixflow+remat+save" if "mixflow+remat+save" in names_chosen else names_chosen[-1]
        print()
        print(report.paper_comparison(rows, names, args.baseline, other))
    if args.json:  # written after every row (with the file's rows this run did not measure)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {report.plot(rows, args.grid, args.baseline, args.plot)}")
    if args.timeline:
        print(f"wrote {report.timeline_plot(rows, args.timeline)}")
    return 0


def cmd_bench_time(args) -> int:
    import jax

    from metatrain.bench import steptime

    chosen = common.variants(args, args.variants, args.baseline)
    cfg = _config(args, common.model(args))
    print(f"bench time: task={args.task} model={args.model} (d={cfg.model.d_model}, L={cfg.model.n_layers}) "
          f"B={args.batch} S={args.seq_len} T={args.inner_steps} on {jax.default_backend()} "
          f"({len(jax.devices())} device(s)): the Trainer's outer step, {args.rounds} interleaved rounds after "
          f"{args.warmup} warm-up step(s)", flush=True)
    from metatrain import paths

    profile_dir = paths.output(args.profile, "bench time --profile", directory=True) if args.profile else None
    rows = steptime.measure(cfg, chosen, args.baseline, rounds=args.rounds, warmup=args.warmup,
                            progress=progress.lines, profile_dir=profile_dir, profile_steps=args.profile_steps)
    print(steptime.table(rows, args.baseline))
    if profile_dir:
        print(steptime.profile_table(rows))
    common.write_json(args.json, rows)
    return 0


def cmd_bench_fit(args) -> int:
    from metatrain.bench.largest_fit import FIT_MARGIN, largest_fitting
    from metatrain.models import ModelConfig

    cfg = _config(args, ModelConfig(), [*TPU_MESH, *args.overrides])
    ladder = [m.strip() for m in args.models.split(",")] if args.models is not None else None
    chosen = common.variants(args, args.variants)
    print(f"bench fit on {args.topology}: task={cfg.task} B={cfg.data.batch} S={cfg.data.seq_len} "
          f"T={cfg.data.inner_steps}, variants {', '.join(v.name for v in chosen)}: binary search over the size "
          f"ladder with the Trainer's outer step (each compile takes minutes); a preset fits when its exact peak "
          f"is at most {FIT_MARGIN:.0%} of the chip's HBM", flush=True)
    results = []
    for v in chosen:
        results.append(largest_fitting(cfg, v, args.topology, ladder, log=lambda line: print(line, flush=True),
                                       **common.model_options(args)))
        common.write_json(args.json, {"topology": args.topology, "results": results})  # keep what is done
    for r in results:
        print(f"largest that fits, {r['variant']}: " + (f"{r['largest']} ({r['params'] / 1e6:,.0f}M parameters)"
                                                        if r["largest"] else "none of the ladder"))
    first = results[0]
    for r in results[1:]:
        if first["params"] and r["params"]:
            print(f"ratio of parameter counts ({r['variant']} / {first['variant']}): "
                  f"{r['params'] / first['params']:.2f}x")
    return 0


COMPILE_DEFAULTS = {"task": "maml", "model": "44m", "seq_len": 2048, "batch": 4, "inner_steps": 2, "mode": "mixflow",
                    "fsdp": -1, "kept_states": "every_step"}
NOT_PROBLEM = ("help", "topology", "json", "config")  # compile's flags that do not describe the problem


def _compile_config(args):
    """(the run config `compile` compiles, the model's name): the --config run's (the problem flags refused
    beside it), else the problem the flags describe."""
    from metatrain import config as config_lib

    config_lib.check_syntax(args.overrides, "a run config goes after --config: a preset, a YAML file or a work dir; "
                                            "else the model and shapes come from the flags, see --help")
    if args.config is None:
        for dest, value in COMPILE_DEFAULTS.items():
            if getattr(args, dest) is None:
                setattr(args, dest, value)
        model = common.model(args, remat=not args.no_remat)
        return _config(args, model, [f"metagrad.mode={args.mode}", f"metagrad.kept_states={args.kept_states}",
                                     f"mesh.fsdp={args.fsdp}", "mesh.data=-1", *args.overrides]), args.model
    given = [a.option_strings[0] for a in args.command_parser._actions
             if a.option_strings and a.dest not in NOT_PROBLEM and getattr(args, a.dest) not in (None, False)]
    if given:
        raise ConfigError(f"{given[0]} with --config: the run config gives the task, model, shapes and mesh; change "
                          f"them as overrides after it (e.g. data.batch=8 model.n_layers=4 metagrad.mode=autodiff "
                          f"mesh.fsdp=-1)")
    from metatrain.data.pipeline import Streams
    from metatrain.run import PRETRAIN, Run
    from metatrain.trainer import data_derived

    config = paths.local(args.config)
    workdir = os.path.isdir(config) and config
    if workdir:
        config = os.path.join(workdir, "config.yaml")
        if not os.path.isfile(config):
            raise ConfigError(f"--config {args.config}: a folder without config.yaml; give a run's work dir, a YAML "
                              f"file or a preset")
    elif not os.path.exists(config):
        config = args.config  # a preset's name
    try:
        cfg = config_lib.load(config, list(args.overrides))
    except ConfigError as e:  # "preset: no config 'x'" is --config's
        if not str(e).startswith("preset: "):
            raise
        raise ConfigError(f"--config: {str(e).removeprefix('preset: ')}") from None
    if config_lib.AUTO in (cfg.metagrad.mode, cfg.metagrad.kept_states):
        raise ConfigError("metagrad.mode / metagrad.kept_states auto: a run picks one when it starts, by compiling "
                          "each; name one to compile (metagrad.mode=mixflow metagrad.kept_states=every_step), or "
                          "compare them with `metatrain bench memory`")
    if not args.topology:  # this machine's CPU split into devices as `train` splits it (before JAX starts)
        from metatrain import platforms
        from metatrain.sharding import cpu_device_count, split_cpu

        if not platforms.backends_started():
            split_cpu(cpu_device_count(cfg.mesh, cfg.data.batch, cfg.population.axis))
    if workdir and Run.kind_of(workdir) == PRETRAIN:
        raise ConfigError(f"--config {args.config}: a `metatrain pretrain` run; compile compiles meta-training's "
                          f"outer step (inner.init_from={args.config} starts one from it)")
    return data_derived(cfg, Streams(cfg.data)), args.config


def _si(n: float, unit: str) -> str:
    """1.23 TFLOPs, 45.6 MB: decimal prefixes."""
    prefixes = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""))
    return next(f"{n / scale:,.2f} {prefix}{unit}" for scale, prefix in prefixes if n >= scale or scale == 1)


def cmd_compile(args) -> int:
    from metatrain.aot import GiB, gpu_memory_fraction
    from metatrain.bench.compile import compile_report

    cfg, name = _compile_config(args)
    model = cfg.model
    where = args.topology or "this machine's devices"
    print(f"compiling the outer step for {where}: task={cfg.task} mode={cfg.metagrad.mode} model={name} "
          f"({model.n_layers} layers, d={model.d_model}) B={cfg.data.batch} S={cfg.data.seq_len} "
          f"T={cfg.data.inner_steps}", flush=True)
    try:
        r = compile_report(cfg, args.topology)
    except ConfigError as e:
        n = getattr(e, "devices", None)
        if n is None:
            raise
        devices = f"{n} device{'s' * (n != 1)} " + (f"of {args.topology}" if args.topology else "here")
        fsdp = f"--fsdp {args.fsdp}" if args.config is None else f"mesh.fsdp={cfg.mesh.fsdp}"
        raise ConfigError(f"{fsdp} does not divide the {devices}; give one of "
                          f"{', '.join(str(d) for d in range(1, n + 1) if n % d == 0)}, or -1 (all of them)") from None
    print(f"meta-gradient: {r['plan']}")
    hbm = (f"; HBM per chip {r['hbm_bytes'] / GiB:.2f} GiB" if r["backend"] == "tpu" else
           f"; memory per GPU for this process {r['hbm_bytes'] / GiB:.2f} GiB "
           f"(XLA_PYTHON_CLIENT_MEM_FRACTION {gpu_memory_fraction():g})") if r["hbm_bytes"] else ""
    print(f"mesh {r['mesh']} over {r['devices']} {r['backend']} device(s){hbm}")
    if not r["exact"]:
        print(f"does NOT fit: the TPU compiler refused it, estimating {r['refused_bytes'] / GiB:.2f} GiB of "
              f"{r['hbm_bytes'] / GiB:.2f} ({r['message']}); compiling it past the limit failed too (v5e cannot; "
              f"elsewhere, a program far over HBM), so there is no exact figure")
        common.write_json(args.json, r)
        return 1
    print("per-device memory: " + ", ".join(f"{k} {r[k + '_bytes'] / GiB:.3f} GiB"
                                             for k in ("argument", "output", "alias", "temp", "peak")))
    if "census" in r:  # what its kernels compute and move, read off the compiled program (`metatrain.bench.census`)
        c = r["census"]
        print(f"kernels: {c['kernels']:,} per call, {_si(c['flops'], 'FLOPs')} in matrix products, at most "
              f"{_si(c['bytes'], 'B')} read and written" + ("" if c["trip_counts_known"] else
                                                           " (a loop without a known trip count counted once)"))
    if r["backend"] == "tpu" and r.get("temp_sum_bytes", 0) > r["peak_bytes"]:
        print(f"(the peak is the TPU compiler's high-water mark of its buffers; its temp counts more than is ever live "
              f"at once, so argument + output - alias + temp, {r['temp_sum_bytes'] / GiB:.3f} GiB, is above it)")
    if r.get("host_io_bytes") or r.get("host_temp_bytes"):
        print(f"in host memory, not in the peak: arguments and outputs {r['host_io_bytes'] / GiB:.3f} GiB, "
              f"temporaries {r['host_temp_bytes'] / GiB:.3f} GiB")
    if r["hbm_bytes"]:
        print(f"{'fits' if r['fits'] else 'does NOT fit'}: {r['peak_bytes'] / GiB:.2f} of "
              f"{r['hbm_bytes'] / GiB:.2f} GiB ({100 * r['peak_bytes'] / r['hbm_bytes']:.0f}%)")
    elif r["backend"] == "cpu":  # no device memory: the buffers are the process's own, beside everything else in it
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        peak = f"{r['peak_bytes'] / GiB:.2f} GiB" if r["peak_bytes"] >= GiB else f"{r['peak_bytes'] / 2**20:.1f} MiB"
        print(f"on CPU there is no device memory to fit in: the peak, {peak} per device, is this process's memory, of "
              f"{ram / GiB:.1f} GiB of RAM here")
    if "refused_bytes" in r:
        print(f"(the TPU compiler refused it first, estimating {r['refused_bytes'] / GiB:.2f} GiB: {r['message']}; "
              f"the figures above are from compiling it past the HBM limit)")
    common.write_json(args.json, r)
    return 0 if r["fits"] is not False else 1


def cmd_bench_generate(args) -> int:
    from metatrain.bench.generation import measure

    r = measure(common.model(args), args.prompt_len, args.new_tokens, args.batch)
    print(f"{r['params'] / 1e6:,.1f}M parameters, batch {r['batch']}, prompt {r['prompt_len']}, {r['new_tokens']} "
          f"new tokens: {1e3 * r['seconds_per_token_cached']:.2f} ms/token with the KV cache, "
          f"{1e3 * r['seconds_per_token_uncached']:.2f} ms/token re-running the sequence: "
          f"{r['speedup']:.1f}x; same tokens: {r['same_tokens']}")
    common.write_json(args.json, r)
    return 0


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks of the outer step").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("memory", help="ahead-of-time memory per variant")
    common.add_problem_args(p, model="bench", seq_len=1024, batch=2, inner_steps=2)
    p.add_argument("--grid", default="ablation", choices=["ablation", "layers", "ladder", "tasks"],
                   help="ablation: mode x remat x save; layers: --layers; ladder: --models; tasks: --tasks")
    p.add_argument("--models", default=None, help=f"ladder presets (default {LADDER_DEFAULT})")
    p.add_argument("--tasks", default=None, help=f"tasks grid: comma list (default {TASKS_DEFAULT})")
    p.add_argument("--topology", default=None, help="TPU topology for --backend tpu (default v5p:1x1x1), GPUs for "
                                                    "--backend gpu (h100 or h200, NAME:COUNT for several; default "
                                                    "h100)")
    p.add_argument("--plot", metavar="PATH", default=None, help="also write a PNG plot")
    p.add_argument("--timeline", metavar="PNG", default=None,
                   help="also plot each program's live memory over its compiled schedule (from the compiler's "
                        "buffer assignment) into this PNG; implies --breakdown")
    p.add_argument("--breakdown", action="store_true",
                   help="also say what is live at each program's peak (from the compiler's buffer assignment): "
                        "arguments, parameter-sized buffers (in units of θ), the rest")
    p.add_argument("--layers", type=common.positive_ints, default=None,
                   help="n_layers values for --grid layers, e.g. 2,8 (default 2,4,8,16)")
    p.add_argument("--variants", default=None, help="comma list, e.g. autodiff+remat,mixflow+remat+save")
    p.add_argument("--baseline", default="autodiff+remat")
    p.add_argument("--backend", default="cpu", choices=["cpu", "tpu", "gpu"],
                   help="cpu: this machine; tpu (libtpu) and gpu (JAX's CUDA plugin): ahead of time, no device needed")
    p.add_argument("--resume", action="store_true",
                   help="with --json: keep the rows already in PATH measured at the same task, model, shapes and "
                        "variant, compile only the rest (PATH is rewritten after every row either way)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more run-config overrides, e.g. baseline=uniform")
    p.set_defaults(fn=cmd_bench_memory)

    p = bench.add_parser("time", help="side-by-side step time per variant (interleaved, median ratio)")
    common.add_problem_args(p, model="bench", seq_len=1024, batch=2, inner_steps=2)
    p.add_argument("--variants", default="autodiff+remat,mixflow+remat+save")
    p.add_argument("--baseline", default="autodiff+remat")
    p.add_argument("--rounds", type=common.positive_int, default=7, help="interleaved timed rounds")
    p.add_argument("--warmup", type=common.nonnegative_int, default=1, help="untimed steps per variant after compiling")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="after timing, run --profile-steps more steps of each variant under the JAX profiler, the "
                        "traces in DIR/VARIANT (TensorBoard's profile plugin opens them); the rows get each "
                        "variant's top XLA ops by time")
    p.add_argument("--profile-steps", type=common.positive_int, default=3, metavar="N",
                   help="profiled steps per variant (default 3)")
    p.set_defaults(fn=cmd_bench_time)

    p = bench.add_parser("generate", help="seconds per new token with the KV cache vs re-running the sequence")
    p.add_argument("--model", default="44m", help="a preset (random weights), e.g. 44m, tiny")
    for field, flag in common.MODEL_FLAGS.items():
        p.add_argument(flag, dest=field, type=common.positive_int, default=None, help=f"override the preset's {field}")
    common.add_model_option_args(p)
    p.add_argument("--prompt-len", type=common.positive_int, default=32)
    p.add_argument("--new-tokens", type=common.positive_int, default=256)
    p.add_argument("--batch", type=common.positive_int, default=1)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(fn=cmd_bench_generate)

    p = bench.add_parser("fit", help="largest ladder preset whose outer step fits a TPU topology or GPUs, per variant")
    common.add_problem_args(p, model="44m", seq_len=2048, batch=4, inner_steps=2, model_flags=False)
    p.add_argument("--topology", required=True, help="e.g. v5p:1x1x1, h100")
    p.add_argument("--variants", default="autodiff+remat,mixflow+remat+save",
                   help="the baseline first, then those to compare with it, e.g. "
                        "autodiff+remat,mixflow+remat+save+sqrt+blockwise+bf16")
    p.add_argument("--models", default=None, help="the ladder to search, in size order (default: all presets)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more run-config overrides, e.g. meta_opt.lr=1e-4")
    p.set_defaults(fn=cmd_bench_fit)

    p = sub.add_parser("compile", help="compile the run's outer step ahead of time (for a TPU topology with libtpu "
                                       "or NVIDIA GPUs with JAX's CUDA plugin, no device needed, or for this "
                                       "machine); per-device memory; exit 1 if it does not fit")
    common.add_problem_args(p, model=None, seq_len=None, batch=None, inner_steps=None, task=None, kept_states=None)
    p.add_argument("--topology", default=None, help="e.g. v5p:2x2x1, v5p:4x4x4, h100, h200:8 (default: this "
                                                    "machine's devices)")
    p.add_argument("--mode", default=None, choices=MODES, type=lambda m: mode_name(m, "--mode {}"))
    p.add_argument("--fsdp", type=argtypes.mesh_size, default=None,
                   help="fsdp mesh axis size (-1 = all devices); data = the rest")
    p.add_argument("--no-remat", action="store_true", help="no per-block rematerialisation")
    p.add_argument("--config", metavar="RUN_CONFIG", default=None,
                   help="compile a run's own config instead of the problem these flags describe: a preset, a YAML "
                        "file or a work dir (its config.yaml), as `train` takes it, with the overrides on top; its "
                        "mesh as the run has it (default flags: task maml, model 44m, S 2048, B 4, T 2, mixflow, "
                        "fsdp over all devices)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="more run-config overrides, e.g. metagrad.save_inner_grads=false")
    p.set_defaults(fn=cmd_compile)
