"""The garbage collector's settings: what a command changes, and what importing metatrain leaves alone."""

import gc
import subprocess
import sys

from helpers import env

from metatrain import collector


def test_paused_restores_the_collector_as_it_was():
    assert gc.isenabled()
    with collector.paused():
        assert not gc.isenabled()
        with collector.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block still holds it
    assert gc.isenabled()
    gc.disable()
    try:
        with collector.paused():
            pass
        assert not gc.isenabled()  # paused by someone else before: left paused
    finally:
        gc.enable()


def test_importing_the_cli_leaves_the_collector_alone_and_a_command_freezes_it():
    """A user's program that imports metatrain keeps its collector as it was; `freeze_imported` (what the metatrain
    command runs before its command) moves what is alive out of reach and makes full collections ten times rarer."""
    # what the interpreter holds frozen at start-up is its own (375 objects on Python 3.12, none on 3.11)
    check = ("import gc; before, frozen = gc.get_threshold(), gc.get_freeze_count(); "
             "import metatrain.cli as cli, metatrain.step; "
             "assert gc.isenabled() and gc.get_threshold() == before and gc.get_freeze_count() == frozen; "
             "cli.freeze_imported(); "
             "assert gc.isenabled() and gc.get_freeze_count() > 10_000, gc.get_freeze_count(); "
             "assert gc.get_threshold() == (*before[:2], 10 * before[2]), gc.get_threshold()")
    done = subprocess.run([sys.executable, "-c", check], env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
