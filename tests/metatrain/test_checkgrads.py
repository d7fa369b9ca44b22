"""check-grads on the three built-in tasks (tiny model, float64), and that it can fail."""

import json

import jax
import pytest

from metatrain import checkgrads, cli, models
from metatrain.bench.variants import parse_variant
from metatrain.data.pipeline import DataConfig
from metatrain.tasks import MAML

SHAPES = DataConfig(seq_len=8, batch=2, inner_steps=2)


# Between them the check-grads tests here and in test_tasks.py run each mode with and without block remat and
# saved gradients, on some task, the chunked loss (+chunked_ce) on each task, and the stored-checkpoint backward
# pass (+bf16_state, run with float64 storage, with +offload_states) on two, LoRA included, the unrolled inner steps
# (+unroll) on one, and DataRater's rater (a pooled score head over bidirectional attention) as the scorer; plain
# reverse-over-reverse is always the reference.
# float64 stays inside the check.
@pytest.mark.parametrize("task, names, model, lora, scorer", [
    ("learned_lr",
     "autodiff+remat,mixflow+save,mixflow+remat+save+chunked_ce,mixflow+remat+save+bf16_state+offload_states",
     "tiny", 0, None),
    # LoRA adapters as θ on a frozen base, weighted by a separate one-layer scorer
    ("loss_weighting", "mixflow+remat+save,revfwd+save+unroll,mixflow+save+chunked_ce", "tiny", 2,
     models.preset("tiny", n_layers=1, d_model=8)),
    ("loss_weighting", "mixflow+remat+save", "tiny", 0,
     models.preset("tiny", n_layers=1, d_model=8).replace(head="score", causal=False)),
    # LoRA on SwiGLU, grouped-query attention, untied head, q/k/v biases, llama3 RoPE: η = the adapters' start.
    # Seed 1: at seed 0 the first inner Adam step leaves some adapter entries where |g| ~ sqrt(eps_root), and V(η)
    # is too curved there for finite differences (fd err 0.17, while every mode agrees with reverse-over-reverse to
    # 1e-15; with seed 1, another perturbation or inner_lr, fd err 2e-9 ... 2e-5)
    ("maml",
     "mixflow+remat+save,revfwd+remat,mixflow+remat+save+chunked_ce,autodiff+remat+save+bf16_state+offload_states",
     "tiny-llama", 4, None),
])
@pytest.mark.slow
def test_builtin_tasks(task, names, model, lora, scorer):
    only = [parse_variant(n) for n in names.split(",")]
    results = checkgrads.check_grads(task, models.preset(model), SHAPES, only=only, seed=int(task == "maml"),
                                     lora=models.LoRAConfig(rank=lora) if lora else None, meta_model=scorer)
    assert not jax.config.jax_enable_x64
    assert [r.variant for r in results] == ["autodiff", *names.split(",")]
    for r in results:
        assert r.rel_err <= 1e-10 and r.fd_err <= 1e-6 and r.ok, r


@pytest.mark.slow
def test_cli_maml_blockwise_sqrt_writes_json_and_exits_zero(tmp_path, capsys):
    """MAML with blockwise attention (3 blocks over S=8, the last padded), the sqrt schedule over T=3 (segments of
    2 and 1 steps), against plain reverse-over-reverse with dense attention keeping every step, and finite
    differences."""
    out = tmp_path / "grads.json"
    assert cli.main(["check-grads", "--task", "maml", "--inner-steps", "3", "--kept-states", "sqrt",
                     "--attention-block", "3", "--variants", "mixflow+remat+save+blockwise", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["variant"] for r in report["results"]] == ["autodiff", "mixflow+remat+save+sqrt+blockwise"]
    assert all(r["ok"] for r in report["results"])
    assert "all 2 variants within tolerance" in capsys.readouterr().out


@jax.custom_vjp
def _wrong_derivative(x):
    return x


_wrong_derivative.defvjp(lambda x: (x, None), lambda _, ct: (1.5 * ct,))


class WrongGradientTask(MAML):
    """Every mode agrees on a wrong derivative: only finite differences can catch it."""

    def outer_loss(self, theta, meta, batch):
        return _wrong_derivative(super().outer_loss(theta, meta, batch))


@pytest.mark.slow
def test_check_fails_on_a_wrong_gradient(capsys):
    assert cli.main(["check-grads", "--task", f"{__name__}:WrongGradientTask", "--variants", "autodiff"]) == 1
    assert "FAILED: 1 variant(s) past tolerance (rel 1e-10, fd 1e-06): autodiff" in capsys.readouterr().out


def test_cli_bad_task_is_a_one_line_error(capsys):
    assert cli.main(["check-grads", "--task", "nope"]) == 2
    out, err = capsys.readouterr()
    assert not out, out  # before the header
    err = err.strip()
    assert err.startswith("metatrain check-grads: error: unknown task 'nope'") and "\n" not in err


def test_a_problem_past_the_memory_here_is_refused_before_it_is_allocated(capsys, monkeypatch):
    """`--model 6.8b` or `--batch 100000000` was allocated, then the process was killed for memory. What check-grads
    holds at least, from the shapes, is held against the memory here first: at a batch of 10^6 rows mostly the
    batches, T + 1 = 3 of them (inner and outer) of 10^6 rows of 17 int32 tokens, segment ids and positions and an
    int32 flag per row."""
    from metatrain import hostmem

    monkeypatch.setattr(hostmem, "available", lambda: 2**29)
    assert cli.main(["check-grads", "--task", "maml", "--model", "tiny", "--seq-len", "16", "--batch", "1000000",
                     "--inner-steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("metatrain check-grads: error: the problem holds at least "), err
    assert err.endswith("more than the 512.0 MiB available on this machine; it compares meta-gradients on small "
                        "problems: use a smaller --model, --n-layers, --batch or --seq-len"), err
    params = 8 * models.param_count(models.preset("tiny"))  # float64: η and its copies, θ and its inner state
    said = float(err.split("at least ")[1].split(" MiB")[0]) * 2**20  # to 0.1 MiB
    batches = 3 * 10**6 * (17 * 3 + 1) * 4
    assert batches + 5 * params - 0.05 * 2**20 <= said <= batches + 10 * params + 0.05 * 2**20


def test_a_program_past_the_memory_here_is_refused_before_it_runs(capsys, monkeypatch):
    """`--seq-len 100000000` passed the check of the arrays (a few GiB of tokens), then dense attention's scores (S^2
    per head) had the process killed for memory after six minutes. Each program is compiled first and its peak held
    against the memory here: at S = 10^5 the tokens take 3.6 MB, the outer loss's scores alone 10^10 float64 per
    head."""
    from metatrain import hostmem

    monkeypatch.setattr(hostmem, "available", lambda: 2**30)
    assert cli.main(["check-grads", "--task", "maml", "--model", "tiny", "--seq-len", "100000", "--batch", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("metatrain check-grads: error: the outer loss needs "), err
    assert err.endswith("more than the 1.0 GiB available on this machine; it compares meta-gradients on small "
                        "problems: use a smaller --model, --n-layers, --batch or --seq-len"), err
    assert float(err.split("needs ")[1].split(" GiB")[0].replace(",", "")) >= 10**10 * 8 / 2**30


@pytest.mark.parametrize("flag, value", [("--tol-rel", "-1"), ("--tol-fd", "nan"), ("--eps", "0"),
                                         ("--tol-members", "inf")])
def test_a_tolerance_or_step_that_is_not_a_positive_number_is_refused(capsys, flag, value):
    """A negative tolerance ran every variant and failed them all."""
    with pytest.raises(SystemExit):
        cli.main(["check-grads", flag, value])
    assert f"argument {flag}: must be a finite number > 0, got {value}" in capsys.readouterr().err


@pytest.mark.parametrize("variant, says", [("mixflow+bf16", "+bf16 does not apply"),
                                           ("mixflow+remat+save+offload_moments",
                                            "+offload_moments moves the meta-optimizer"),
                                           ("mixflow+remat+save+offload_params", "+offload_params moves")])
def test_variants_that_change_nothing_checked_are_refused(capsys, variant, says):
    assert cli.main(["check-grads", "--task", "maml", "--variants", variant]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err
