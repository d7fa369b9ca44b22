"""The stop signals' handlers: set while a block runs, the ones found put back after it (also after an error), and
none set from a thread other than the main one (where Python refuses them)."""

import signal
import threading

import pytest

from metatrain import stops


def test_caught_sets_the_handler_for_the_block_and_puts_back_the_ones_it_found():
    def ours(signum, frame):
        pass

    before = {s: signal.getsignal(s) for s in stops.ALL}
    with pytest.raises(RuntimeError, match="inside"):
        with stops.caught(ours, [signal.SIGTERM, signal.SIGHUP]):
            assert signal.getsignal(signal.SIGTERM) is ours and signal.getsignal(signal.SIGHUP) is ours
            assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
            raise RuntimeError("inside")
    assert {s: signal.getsignal(s) for s in stops.ALL} == before


def test_caught_on_another_thread_sets_nothing_and_runs_the_block():
    ran, errors, before = [], [], signal.getsignal(signal.SIGTERM)

    def block():
        try:
            with stops.caught(lambda signum, frame: None):
                ran.append(signal.getsignal(signal.SIGTERM))
        except Exception as e:  # signal.signal off the main thread: ValueError
            errors.append(e)

    thread = threading.Thread(target=block)
    thread.start()
    thread.join()
    assert not errors and ran == [before]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_run_trains_on_a_thread_other_than_the_main_one(tmp_path):
    """A program that runs `metatrain` from a worker thread (a notebook's, a job server's): the run trains and saves,
    without the stop signals' handlers (it raised "signal only works in main thread")."""
    from helpers import TINY

    from metatrain import cli

    codes = []
    thread = threading.Thread(target=lambda: codes.append(cli.main(["train", *TINY, "steps=1",
                                                                       f"workdir={tmp_path}"])))
    thread.start()
    thread.join()
    assert codes == [0]
    assert (tmp_path / "checkpoints" / "1").is_dir()
