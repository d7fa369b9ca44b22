"""check-grads on the three built-in tasks (tiny model, float64), and that it can fail."""

import json

import jax
import pytest

import models
from metatrain import checkgrads, cli
from metatrain.problem import Shapes
from metatrain.tasks import MAML


@pytest.mark.parametrize("task,modes", [("learned_lr", ("default", "mixflow")), ("loss_weighting", ("mixflow", "revfwd"))])
def test_builtin_tasks_all_variants(task, modes):
    """Every mode x remat x save variant against plain reverse-over-reverse and finite differences (the CLI
    covers all 12 for each task; here two modes per task keep CI short)."""
    checkgrads.enable_float64()
    results = checkgrads.check_grads(task, models.preset("tiny"), Shapes(2, 2, 8), modes=modes)
    assert {r.variant for r in results} >= {f"{m}+remat+save" for m in modes}
    assert len(results) == 4 * len(modes) + ("default" not in modes)  # plain reverse-over-reverse always runs
    for r in results:
        assert r.rel_err <= 1e-10 and r.fd_err <= 1e-6 and r.ok, r


def test_cli_maml_blockwise_sqrt_writes_json_and_exits_zero(tmp_path, capsys):
    """MAML with blockwise attention (3 blocks over S=8, the last padded), MixFlow's 4 variants with the sqrt
    schedule over T=5, against plain reverse-over-reverse keeping every step, and finite differences."""
    out = tmp_path / "grads.json"
    assert cli.main(["check-grads", "--task", "maml", "--attention", "blockwise", "--attention-block", "3",
                     "--inner-steps", "5", "--inner-checkpoint", "sqrt", "--modes", "mixflow",
                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["results"]) == 5 and all(r["ok"] for r in report["results"])
    assert "mixflow+remat+save+sqrt" in {r["variant"] for r in report["results"]}
    assert "all 5 variants within tolerance" in capsys.readouterr().out


@jax.custom_vjp
def _wrong_derivative(x):
    return x


_wrong_derivative.defvjp(lambda x: (x, None), lambda _, ct: (1.5 * ct,))


class WrongGradientTask(MAML):
    """Every mode agrees on a wrong derivative: only finite differences can catch it."""

    def outer_loss(self, theta, meta, batch):
        return _wrong_derivative(super().outer_loss(theta, meta, batch))


def test_check_fails_on_a_wrong_gradient(capsys):
    assert cli.main(["check-grads", "--task", f"{__name__}:WrongGradientTask", "--modes", "default"]) == 1
    assert "FAILED: 4 variant(s)" in capsys.readouterr().out


def test_cli_bad_task_is_a_one_line_error(capsys):
    assert cli.main(["check-grads", "--task", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("metatrain check-grads: error: unknown task 'nope'") and "\n" not in err
