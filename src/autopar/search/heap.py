"""Planning's heap: the cyclic garbage collector paused while a search runs."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused(*, resume: bool = True) -> Iterator[None]:
    """Pause the cyclic garbage collector. Planning allocates millions of small objects that stay alive (the
    traced graph, layouts, cached prices, simulated tasks), and each full collection walks all of them: with
    collection on, full collections took a third of a 320-layer intra-op plan and a quarter of
    `autopar plan gpt3-1.3b --layers 1000` (`bench/plan_wall.py`). Reference counting still frees what the
    search drops; collection resumes on exit (nested uses leave it as the outermost found it). Worker processes
    forked inside (`autopar.search.workers`) inherit the pause, so no collection writes to pages they share.

    ``resume=False`` leaves collection paused on exit, for a process about to end: every object made meanwhile
    is still in the youngest generation, and the first collection after resuming walks all of them (a second
    after a 1,000-layer plan)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled and resume:
            gc.enable()
