"""Experiment tracking that survives preemption: the W&B run id kept in the work dir, and a remote work dir
receiving the metrics, TensorBoard events and plot."""

import json

import pytest
from conftest import fake_wandb
from helpers import TINY

from metatrain import config as config_lib
from metatrain import tracking


def test_a_restarted_run_resumes_the_same_wandb_run(tmp_path):
    cfg = config_lib.load(None, [*TINY, f"workdir={tmp_path / 'run'}", "log.wandb=true", "log.wandb_project=p",
                                 "log.wandb_entity=team"])
    calls = tmp_path / "calls.jsonl"
    with fake_wandb(calls):
        tracking.require_wandb(cfg)
        for _ in range(2):  # the first start, then a restart (as after a preemption)
            log = tracking.MetricsLog(cfg)
            log.write({"step": 1, "outer_loss": 2.5})
            log.close()
    inits = [c for c in map(json.loads, calls.read_text().splitlines()) if c["call"] == "init"]
    run_id = (tmp_path / "run" / "wandb_id").read_text().strip()
    assert len(inits) == 2 and {c["id"] for c in inits} == {run_id} and len(run_id) == 8
    assert all(c["resume"] == "allow" and c["project"] == "p" and c["entity"] == "team" and c["name"] == "run"
               for c in inits)


def test_wandb_without_the_package_is_refused(tmp_path, capsys, monkeypatch):
    from metatrain import cli

    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    assert cli.main(["train", *TINY, f"workdir={tmp_path / 'run'}", "log.wandb=true"]) == 2
    assert "log.wandb: the wandb package is not installed" in capsys.readouterr().err


def test_logs_are_copied_into_a_remote_workdir(tmp_path, monkeypatch):
    """gs:// stands for a bucket here: epath is pointed at a local folder, the copy logic is the real one."""
    from etils import epath

    bucket = tmp_path / "bucket"
    real = epath.Path
    monkeypatch.setattr(epath, "Path", lambda p: real(str(p).replace("gs://", f"{bucket}/")))
    log_dir = tmp_path / "local"
    (log_dir / "tensorboard").mkdir(parents=True)
    (log_dir / "wandb" / "run-1").mkdir(parents=True)
    (log_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (log_dir / "tensorboard" / "events.out.tfevents.1").write_bytes(b"\x00\x01")
    (log_dir / "curves.png").write_bytes(b"\x89PNG")
    (log_dir / ".lock").write_text("pid 1")
    (log_dir / "wandb" / "run-1" / "x.wandb").write_text("w")
    tracking.copy_logs(str(log_dir), "gs://b/runs/x")
    copied = sorted(str(p.relative_to(bucket / "b" / "runs" / "x")) for p in (bucket / "b" / "runs" / "x").rglob("*")
                    if p.is_file())
    assert copied == ["curves.png", "metrics.jsonl", "tensorboard/events.out.tfevents.1"]
    assert (bucket / "b" / "runs" / "x" / "tensorboard" / "events.out.tfevents.1").read_bytes() == b"\x00\x01"
    tracking.copy_logs(str(log_dir), str(tmp_path / "local_workdir"))  # a local work dir: nothing to copy
    assert not (tmp_path / "local_workdir").exists()


@pytest.mark.slow
def test_tensorboard_scalars_are_written_without_importing_torch(tmp_path):
    """tensorboardX imports PyTorch and Google Cloud Storage's client where they are installed (seconds of start-up
    for every run); the run's writer leaves them out and still writes readable scalars, and each imports normally
    afterwards."""
    import subprocess
    import sys

    code = f"""
import sys
from metatrain.tracking import summary_writer
w = summary_writer({str(tmp_path)!r})
w.add_scalar("outer_loss", 2.5, 1)
w.add_scalar("outer_loss", float("nan"), 2)  # a step that was not finite: written, and said by the run alone
w.close()
assert "torch" not in sys.modules, "torch was imported"
assert "google.cloud.storage" not in sys.modules, "google.cloud.storage was imported"
from tensorboardX.event_file_writer import event_pb2
import glob, struct
data = open(glob.glob({str(tmp_path / 'events.out.tfevents.*')!r})[0], "rb").read()
values, i = [], 0
while i < len(data):  # TFRecord framing: length, its CRC, the event, its CRC
    n = struct.unpack("<Q", data[i:i + 8])[0]
    event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
    values += [(v.tag, v.simple_value, event.step) for v in event.summary.value]
    i += 16 + n
print(values)
try:
    import torch  # noqa: F401  (installed with the hf extra: importable again)
except ImportError:
    pass
try:
    from google.cloud import storage  # noqa: F401  (installed with the tpu extra: importable again)
except ImportError:
    pass
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[('outer_loss', 2.5, 1), ('outer_loss', nan, 2)]"
    assert "NaN or Inf" not in out.stderr, out.stderr  # tensorboardX warned once per scalar

