"""`tl.trace(model, x, save="stats")` during the forward (issue 23): core offers a fold, a
backend may take it.

Core wraps the capture of a `save="stats"` trace in a `StatsFoldOffer` (a one-shot, per-thread
slot). A backend that can reduce each op's out as the op runs calls `take_stats_fold()` once,
when it chooses how payloads are saved, and from then on saves, for every output slot, a `FoldedStats`
holding the slot's `STATS_FOLD_SLOTS` summary (a float64 vector of 16 values, framework-native, any
device) in place of a payload copy, and keeps no reference to the out. A slot it cannot read as real numbers (complex,
no plain storage) folds to the empty summary: count 0, numel 0, min +inf, max -inf, the rest 0.

After the capture core reads those vectors (`tl.stats.site_stats`). A backend that never calls
`take_stats_fold()` is folded after the capture instead (`save="all"`, then reduce; peak memory
that of a `save="all"` capture). Which of the two ran is the trace fact
`trace.provenance.extra["stats_fold"]`: `"forward"` or `"after_capture"`.

Vector layout (`STATS_FOLD_SLOTS`, the same as `tl.stats.RUNNING_SLOTS`): over the finite values
count, mean, m2, m3, m4 (sums of the 2nd..4th powers of deviations from the mean), min, max
(+inf / -inf when there are none), abs_mean, abs_max (0 when there are none); over all
elements numel, nan_count, posinf_count, neginf_count, zero_count, positive_count (+inf
included), negative_count (-inf included). Bools and integers count as float64.
"""

from __future__ import annotations

import threading
from typing import Any

#: the 16 slots of the vector a backend folds each output slot into (== tl.stats.RUNNING_SLOTS)
STATS_FOLD_SLOTS: tuple[str, ...] = (
    "count", "mean", "m2", "m3", "m4", "min", "max", "abs_mean", "abs_max",
    "numel", "nan_count", "posinf_count", "neginf_count", "zero_count", "positive_count", "negative_count")

#: trace.provenance.extra["stats_fold"] values
FOLD_FORWARD = "forward"
FOLD_AFTER_CAPTURE = "after_capture"

_SLOT = threading.local()


class FoldedStats:
    """What a backend saves in an output slot in place of a payload: that slot's summary
    (`vector`: a framework-native float64 vector laid out as `STATS_FOLD_SLOTS`)."""

    __slots__ = ("vector",)

    def __init__(self, vector: Any) -> None:
        self.vector = vector

    def __repr__(self) -> str:
        return "FoldedStats(16 slots)"


class StatsFoldOffer:
    """Core's offer for one `save="stats"` capture (a context manager around the backend's
    capture). `mode` is `"forward"` once a backend took it, else `"after_capture"`."""

    __slots__ = ("mode",)
    folded_type = FoldedStats  # what a backend that took the offer saves in each output slot

    def __init__(self) -> None:
        self.mode = FOLD_AFTER_CAPTURE

    def __enter__(self) -> "StatsFoldOffer":
        _SLOT.offer = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _SLOT.offer = None


def take_stats_fold() -> bool:
    """True when the capture now starting is a `save="stats"` capture whose per-op fold this
    backend should do during the forward; the offer is then taken (a second call, or a nested
    capture, gets False). Call it once per capture, where the payload saver is chosen, and
    only for a capture that saves every op's payload."""
    offer = getattr(_SLOT, "offer", None)
    if offer is None:
        return False
    _SLOT.offer = None
    offer.mode = FOLD_FORWARD
    return True


__all__ = ["STATS_FOLD_SLOTS", "FoldedStats", "FOLD_FORWARD", "FOLD_AFTER_CAPTURE", "StatsFoldOffer", "take_stats_fold"]
