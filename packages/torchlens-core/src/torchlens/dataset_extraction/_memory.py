"""Keeping memory flat over many batches.

A Trace is a cyclic object graph that lives through the young generations while its batch
runs, so the cycle collector frees it only at a rare full collection and garbage piles up
with the number of batches. A dataset loop therefore collects after every batch; to keep that
cheap, everything alive before the loop is frozen first (`gc.freeze`: a full collection then
scans only what the loop created) and unfrozen afterwards. A caller that froze objects
itself keeps its own freeze untouched.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def per_batch_collection() -> Iterator[Callable[[], None]]:
    own = gc.get_freeze_count() == 0
    if own:
        gc.freeze()
    try:
        yield lambda: gc.collect() and None
    finally:
        if own:
            gc.unfreeze()
