"""A stand-in for the wandb package (which would want an account and the network): it records `init`, `log`
and `finish` as JSON lines in the file named by $FAKE_WANDB_LOG, so tests can check what metatrain sends."""

import json
import os


def _record(call: str, **fields) -> None:
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({"call": call, **fields}, default=str) + "\n")


class _Run:
    def log(self, data, step=None):
        _record("log", data=data, step=step)

    def finish(self):
        _record("finish")


def init(config=None, **kwargs):
    _record("init", config_keys=sorted(config or {}), **kwargs)
    return _Run()
