"""`metatrain check-grads`: every meta-gradient variant against reverse-over-reverse and finite differences.

Runs in float64, inside `jax.enable_x64` (the rest of the process is left as it was). The
meta-parameters are the task's initial ones plus small noise, so every second-derivative path is
exercised (e.g. a zero-initialised score head would otherwise hide the weighting model's mixed
derivatives). The batches have the Trainer's structure (`step.random_batches`). With LoRA the base weights
are an argument of the jitted meta-gradient, bound to the task inside it, as in the Trainer's outer step.
A `+bf16_state` variant runs its stored-checkpoint backward pass (`unroll.stored_step`) with float64 storage:
this checks that backward pass exactly; what bfloat16 storage costs is bounded by a test of its own.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from metatrain import aot, population
from metatrain.bench.variants import Variant, build_task, variants
from metatrain.config import PopulationConfig
from metatrain.data.pipeline import DataConfig
from metatrain.errors import ConfigError
from metatrain.mixflow import MODES, mode_name
from metatrain.models import LoRAConfig, ModelConfig
from metatrain.step import random_batches
from metatrain.tasks import validate
from metatrain.unroll import MetaGradMethod, meta_value_and_grad, outer_loss


@dataclasses.dataclass
class Result:
    variant: str
    rel_err: float  # max |g - g_ref| / max |g_ref|, g_ref = reverse-over-reverse without remat
    fd_err: float  # max over directions u of |<g, u> - FD_u| / |FD_u|
    ok: bool
    members_err: float | None = None  # a population: max |g - mean of the members' own g| / max |that mean|


def _directional_fd(f: Callable[[float], jax.Array], eps: float, n_steps: int = 7) -> jax.Array:
    steps = [eps * 10 ** (-i / 2) for i in range(n_steps)]
    est = [(8 * (f(h) - f(-h)) - (f(2 * h) - f(-2 * h))) / (12 * h) for h in steps]
    i = min(range(n_steps - 1), key=lambda i: float(jnp.abs(est[i] - est[i + 1])))
    return est[i + 1]


def _float64(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.enable_x64(True):
            return fn(*args, **kwargs)

    return wrapped


FIT_FIX = "it compares meta-gradients on small problems: use a smaller --model, --n-layers, --batch or --seq-len"


def _check_fits(task, data: DataConfig, vocab: int, members: int, directions: int) -> None:
    """Refuses (one ConfigError line) a problem whose float64 arrays alone pass the memory here, from their shapes,
    before anything is allocated: at least the meta-parameters `directions` + 2 times (η, its flat copy and the
    finite differences' unit directions), the inner state of each member, the frozen base and the batches. A 6.8b
    model or a batch of 10^8 rows was allocated, then the process was killed for memory."""
    key = jax.random.key(0)
    meta = jax.eval_shape(task.init_meta, key)
    inner = jax.eval_shape(lambda k, m: task.init_inner(k, m), key, meta)
    held = 0 if members > 1 and task.resets_inner else members  # inner states kept (one per member)
    frozen = jax.eval_shape(task.init_frozen, key)
    batches = jax.eval_shape(lambda k: random_batches(data, vocab, k, members=members), key)
    size = aot.tree_bytes
    need = size(meta) * (directions + 2) + size(inner) * held + size(frozen) + size(batches)
    aot.check_bytes_fit(need, "the problem holds at least", FIT_FIX, f" in float64 (the meta-parameters "
                        f"{directions + 2} times, the inner state, the batches)")


def _member(k: int, *trees) -> tuple:
    """Member `k`'s part of each population tree (inner states, batches)."""
    return tuple(population.member(t, k) for t in trees)


def _compiled(fn: Callable, what: str, *args):
    """`fn` compiled for `args`, refused (one TrainingError line) where its peak passes the memory here, before it
    runs: `--seq-len 100000000` passed the arrays' own check, then dense attention's scores had the process killed
    for memory after minutes."""
    compiled = jax.jit(fn).lower(*args).compile()
    aot.check_fits(aot.compiled_memory(compiled), jax.devices()[:1], f"check-grads: {what}", FIT_FIX)
    return compiled


@_float64
def check_grads(task_name: str, model: ModelConfig, data: DataConfig, *, seed: int = 0, directions: int = 3,
                eps: float = 1e-2, tol_rel: float = 1e-10, tol_fd: float = 1e-6, inner_lr: float = 1e-2,
                perturb: float = 0.05, modes=MODES, kept_states: str = "every_step",
                only: list[Variant] | None = None, progress: Callable = lambda it, **_: it,
                lora: LoRAConfig | None = None, meta_model: ModelConfig | None = None, members: int = 1,
                tol_members: float = 1e-12) -> list[Result]:
    """Every variant's meta-gradient (`modes` x remat x save, or just the variants in `only`) against plain
    reverse-over-reverse and finite differences, in float64; `data` gives the batch shapes (seq_len, batch,
    inner_steps). With `members` > 1, a population's (`population.run_members`, reduce=grad): also against the mean
    of its members' meta-gradients, each computed alone with the same variant (`members_err`, within
    `tol_members`)."""
    modes = tuple(mode_name(m, "--modes {}") for m in modes)
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ConfigError(f"--modes: unknown mode(s) {sorted(unknown)}; choose from {MODES}")
    if any("bf16" in v.model_options for v in only or ()):
        raise ConfigError("--variants: check-grads runs in float64, so +bf16 does not apply; drop it")
    moved = sorted({o for v in only or () for o, on in (("+offload_moments", v.offload_moments),
                                                         ("+offload_params", v.offload_params)) if on})
    if moved:
        raise ConfigError(f"--variants: {' and '.join(moved)} moves the meta-optimizer's state or η between steps, not "
                          "the meta-gradient that check-grads compares; drop it")
    model = model.replace(param_dtype="float64", compute_dtype="")  # the float64 path, whatever was asked
    if meta_model is not None:
        meta_model = meta_model.replace(param_dtype="float64", compute_dtype="", vocab_size=model.vocab_size)
    k_meta, k_inner, k_noise, k_data, k_dir = jax.random.split(jax.random.key(seed), 5)
    build = functools.partial(build_task, task_name, inner_lr=inner_lr, lora=lora, meta_model=meta_model)
    ref_task = build(model, remat=False)
    _check_fits(ref_task, data, model.vocab_size, members, directions)
    frozen = ref_task.init_frozen(k_inner)  # None without LoRA
    meta = ref_task.init_meta(k_meta)
    flat, unravel = ravel_pytree(meta)
    flat = flat + perturb * jax.random.normal(k_noise, flat.shape, flat.dtype)
    meta = unravel(flat)
    make_data = lambda: random_batches(data, model.vocab_size, k_data, members=members)
    if members > 1:
        make_inner = lambda: None if ref_task.resets_inner else population.init_inner(ref_task, k_inner, meta, members)
    else:
        make_inner = lambda: ref_task.init_inner(k_inner, meta)
    # the task checked and the reference compiled (its peak held against the memory here) from the shapes alone,
    # before the inner state and the batches are made
    inner, (batches, outer_batch) = jax.eval_shape(lambda: (make_inner(), make_data()))
    if members > 1:
        validate(ref_task, meta, *_member(0, inner, outer_batch), frozen)
    else:
        validate(ref_task, meta, inner, outer_batch, frozen)

    # Fourth-order central differences of the outer loss along random unit directions. Inner Adam
    # makes V(η) far from smooth for some tasks, so no single step suits all: for each direction we
    # take steps eps, eps/√10, ..., and keep the estimate whose neighbour agrees with it best (an
    # estimate of its own error that never looks at the gradient under test).
    one_value = lambda m, fr, i, b, o: outer_loss(ref_task.with_frozen(fr), MetaGradMethod("autodiff", False))(
        m, i, b, o)[0]
    if members > 1:  # the population's outer loss: its members' mean
        outer = lambda m, fr, *args: sum(one_value(m, fr, *_member(k, *args)) for k in range(members)) / members
    else:
        outer = one_value
    value = _compiled(outer, "the outer loss", meta, frozen, inner, batches, outer_batch)
    inner, (batches, outer_batch) = make_inner(), make_data()
    part = lambda k: _member(k, inner, batches, outer_batch)
    dirs = jax.random.normal(k_dir, (directions, flat.size), flat.dtype)
    dirs = dirs / jnp.linalg.norm(dirs, axis=1, keepdims=True)
    fd = jnp.stack([_directional_fd(lambda h, u=u: value(unravel(flat + h * u), frozen, inner, batches, outer_batch),
                                    eps) for u in dirs])

    results, ref = [], None
    plain = Variant("autodiff", False, False)  # the reference: plain reverse-over-reverse, every step kept
    todo = [plain] + [v for v in (only or variants(modes, kept_states)) if v != plain]
    for v in progress(todo, desc="variants"):
        m = v.model(model)  # +blockwise applies; +chunked_ce in chunks that leave a remainder (S=8: 3, 3, 2)
        m = m.replace(loss_chunk=max(1, 2 * data.seq_len // 5)) if m.loss_chunk else m
        task = build(m, remat=v.remat)
        method = dataclasses.replace(v.method, state_dtype="float64") if v.state_dtype else v.method
        # (+offload_states runs as is: on CPU host memory is the same memory: this checks its backward pass exactly)
        grad_of = lambda fr, *args, task=task, method=method: meta_value_and_grad(task.with_frozen(fr), method)(*args)
        members_err = None
        if members > 1:
            pop_grad = _compiled(lambda fr, *args, task=task, method=method: population.run_members(
                task.with_frozen(fr), method, PopulationConfig(size=members), seed, 0, *args).grad,
                f"{v.name}'s meta-gradient", frozen, meta, inner, batches, outer_batch)
            grad = pop_grad(frozen, meta, inner, batches, outer_batch)
            grad_fn = _compiled(grad_of, f"{v.name}'s meta-gradient", frozen, meta, *part(0))
            alone = [ravel_pytree(grad_fn(frozen, meta, *part(k))[1])[0] for k in range(members)]
            mean = sum(alone) / members
            members_err = float(jnp.max(jnp.abs(ravel_pytree(grad)[0] - mean)) / jnp.max(jnp.abs(mean)))
        else:
            grad_fn = _compiled(grad_of, f"{v.name}'s meta-gradient", frozen, meta, inner, batches, outer_batch)
            _, grad = grad_fn(frozen, meta, inner, batches, outer_batch)
        g = ravel_pytree(grad)[0]
        ref = g if ref is None else ref  # the first variant is plain reverse-over-reverse
        if not (bool(jnp.all(jnp.isfinite(g))) and bool(jnp.all(jnp.isfinite(ref)))):
            results.append(Result(v.name, float("inf"), float("inf"), False))
            continue
        rel = float(jnp.max(jnp.abs(g - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-300))
        fd_err = float(jnp.max(jnp.abs(dirs @ g - fd) / jnp.maximum(jnp.abs(fd), 1e-300)))
        ok = rel <= tol_rel and fd_err <= tol_fd and (members_err is None or members_err <= tol_members)
        results.append(Result(v.name, rel, fd_err, ok, members_err))
    return results
