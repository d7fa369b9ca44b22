"""The TPU side without a TPU: the launcher's dry run, and compiling the outer step for v5p with libtpu."""

import json
import shlex

import pytest

from launch import tpu
from metatrain import cli


def test_dry_run_prints_the_whole_sequence(capsys):
    assert tpu.main(["--name", "mt", "--zone", "us-east5-a", "--project", "p1", "--accelerator-type", "v5p-16",
                     "--create", "--spot", "--workdir", "gs://bkt/runs/mt", "--dry-run", "--", "train", "maml",
                     "steps=2000"]) == 0
    lines = capsys.readouterr().out.splitlines()
    run = [shlex.split(line[2:]) for line in lines if line.startswith("+ ")]
    assert [c[:5] for c in run] == [
        ["gcloud", "compute", "tpus", "tpu-vm", "create"], ["git", "-C", str(tpu.REPO), "archive", "--format=tar.gz"],
        ["gcloud", "compute", "tpus", "tpu-vm", "scp"], ["gcloud", "compute", "tpus", "tpu-vm", "ssh"],
        ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]]
    create, _, scp, install, train = run
    assert {"mt", "--accelerator-type=v5p-16", "--version=v2-alpha-tpuv5", "--zone=us-east5-a", "--project=p1",
            "--spot"} <= set(create)
    assert "--worker=all" in scp and "--worker=all" in install and "--worker=all" in train
    assert any("pip install -q -e '.[tpu]'" in a for a in install)
    command = next(a for a in train if a.startswith("--command="))
    assert "METATRAIN_DISTRIBUTED=auto metatrain train maml steps=2000 workdir=gs://bkt/runs/mt" in command
    restart = [line for line in lines if line.startswith("#   ")]
    assert "tpu-vm delete mt" in restart[0] and "tpu-vm create mt" in restart[1]
    assert "--resume" in restart[-1] and restart[-1].rstrip().endswith("--zone=us-east5-a --project=p1")


def test_launcher_needs_a_command(capsys):
    with pytest.raises(SystemExit):
        tpu.main(["--name", "mt", "--zone", "z", "--workdir", "w", "--dry-run"])
    assert "give the metatrain command" in capsys.readouterr().err


def test_compile_44m_on_v5p_2x2x1_fits(tmp_path, capsys):
    pytest.importorskip("libtpu", reason="needs the tpu extra (CI installs it): pip install -e '.[tpu]'")
    out = tmp_path / "compile.json"
    assert cli.main(["compile", "--topology", "v5p:2x2x1", "--model", "44m", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["devices"] == 4 and report["mesh"] == {"data": 1, "fsdp": 4} and report["fits"]
    # FSDP: each chip holds a quarter of η and the meta-optimizer state (3 copies of 41.6M float32)
    assert report["argument_bytes"] < 0.3 * 3 * 4 * 41.6e6 and 0 < report["total_bytes"] < report["hbm_bytes"]
    assert "fits:" in capsys.readouterr().out


def test_compile_reports_what_does_not_fit(capsys):
    pytest.importorskip("libtpu", reason="needs the tpu extra (CI installs it): pip install -e '.[tpu]'")
    assert cli.main(["compile", "--topology", "v5p:1x1x1", "--model", "1b", "--mode", "default"]) == 1
    assert "does NOT fit: the compiler needs" in capsys.readouterr().out
