"""`metatrain check-grads`: every meta-gradient variant against reverse-over-reverse and finite differences."""

from __future__ import annotations

import dataclasses

from metatrain import progress
from metatrain.cli import common
from metatrain.mixflow import MODES


def cmd_check_grads(args) -> int:
    from metatrain import aot, checkgrads
    from metatrain.config import NO_PRESET, check_syntax, load, meta_model_config
    from metatrain.errors import ConfigError
    from metatrain.tasks import task_class

    task_class(args.task)  # a task that does not load: one line before the header
    model, data = common.model(args), common.data_shapes(args)
    check_syntax(args.overrides, NO_PRESET)
    cfg = load(None, list(args.overrides))  # inner.lora.*, meta_model.*: as a run would take them
    cfg = dataclasses.replace(cfg, model=model)
    lora = cfg.inner.lora if cfg.inner.lora.rank > 0 else None
    members = cfg.population.size
    if cfg.population.reduce != "grad" or cfg.population.lifetime:
        raise ConfigError("check-grads: a population's meta-gradient is checked as population.size=N alone "
                          "(reduce=update and lifetime change the meta-update, not the meta-gradient)")
    print(f"check-grads: task={args.task} model={args.model} (d={model.d_model}, L={model.n_layers}, "
          f"V={model.vocab_size}) T={data.inner_steps} B={data.batch} S={data.seq_len}, float64"
          + (f", LoRA rank {lora.rank} on {lora.targets}" if lora else "")
          + (f", a population of {members} (each member on its own batches)" if members > 1 else ""))
    only = common.variants(args, args.variants) if args.variants is not None else None
    with aot.out_of_memory("the problem", checkgrads.FIT_FIX):  # past what the check before allocating counts
        results = checkgrads.check_grads(args.task, model, data, seed=args.seed, directions=args.directions,
                                         eps=args.eps, tol_rel=args.tol_rel, tol_fd=args.tol_fd,
                                         modes=tuple(args.modes.split(",")), kept_states=args.kept_states, only=only,
                                         progress=progress.over, lora=lora, meta_model=meta_model_config(cfg),
                                         members=members, tol_members=args.tol_members)
    width = max(22, *(len(r.variant) for r in results))
    extra = f" {'vs members mean':>16}" if members > 1 else ""
    print(f"{'variant':<{width}} {'rel. err vs autodiff':>20} {'finite-diff err':>16}{extra}  ok")
    for r in results:
        cell = f" {r.members_err:>16.3e}" if members > 1 else ""
        print(f"{r.variant:<{width}} {r.rel_err:>20.3e} {r.fd_err:>16.3e}{cell}  {'yes' if r.ok else 'NO'}")
    if any("+bf16_state" in r.variant for r in results):
        print("(+bf16_state: its backward pass run with float64 storage; what bfloat16 rounding costs is bounded by "
              "a test of its own)")
    bad = [r.variant for r in results if not r.ok]
    common.write_json(args.json, {"task": args.task, "tol_rel": args.tol_rel, "tol_fd": args.tol_fd,
                                  **({"members": members, "tol_members": args.tol_members} if members > 1 else {}),
                                  "results": [vars(r) for r in results]})
    if bad:
        print(f"FAILED: {len(bad)} variant(s) past tolerance (rel {args.tol_rel:g}, fd {args.tol_fd:g}"
              + (f", members {args.tol_members:g}" if members > 1 else "") + "): " + ", ".join(bad))
        return 1
    print(f"all {len(results)} variants within tolerance (rel {args.tol_rel:g}, fd {args.tol_fd:g}"
          + (f", members {args.tol_members:g}" if members > 1 else "") + ")")
    return 0


def register(sub) -> None:
    p = sub.add_parser("check-grads", help="meta-gradient of every mode/variant vs reverse-over-reverse and "
                                           "finite differences (float64); exit 1 past tolerance")
    common.add_problem_args(p, model="tiny", seq_len=8, batch=2, inner_steps=2)
    p.add_argument("--seed", type=common.nonnegative_int, default=0)
    p.add_argument("--directions", type=common.positive_int, default=3,
                   help="random directions for finite differences")
    p.add_argument("--eps", type=common.positive_float, default=1e-2,
                   help="largest finite-difference step (4th-order stencil, then steps down by sqrt(10))")
    p.add_argument("--tol-rel", type=common.positive_float, default=1e-10)
    p.add_argument("--tol-fd", type=common.positive_float, default=1e-6)
    p.add_argument("--tol-members", type=common.positive_float, default=1e-12,
                   help="population.size=N: a population's meta-gradient vs its members' mean")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma list of meta-gradient modes, any of {', '.join(MODES)} (default: all)")
    p.add_argument("--variants", default=None,
                   help="check just these variants (comma list, e.g. mixflow+remat+save,revfwd+sqrt) instead of "
                        "every mode x remat x save; plain reverse-over-reverse is always the reference")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="run-config overrides the check takes: inner.lora.rank=4 (inner.lora.alpha, "
                        "inner.lora.targets), meta_model.*, population.size=N")
    p.set_defaults(fn=cmd_check_grads)
