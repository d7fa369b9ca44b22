"""How metatrain's processes use Python's cyclic garbage collector.

JAX's tracing builds graphs of many small objects that reference counting frees on its own; each full
collection meanwhile rescans every object alive (the traced program's included), a tenth of a short command's CPU
time. So nothing is collected while the command line imports its libraries or while the outer step is traced
(`paused`); a command then moves what was imported out of the collector's reach (`freeze`: it lives as long as the
process) and runs full collections ten times more rarely from then on.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
    """No cyclic collection inside the block (unless one was already paused); the usual ones after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze() -> None:
    """Moves every object alive now out of the collector's reach; full collections ten times rarer from then on."""
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, gen1, 10 * gen2)
