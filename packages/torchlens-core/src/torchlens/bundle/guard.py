"""Checkpoint live-ref guard and capture-time parameter snapshots (experimental).

A Param record holds the live parameter object a run used, not its bytes: after an
optimizer step every trace of that model reads the new weights. So cross-member parameter
value, difference and trajectory reads on a Bundle refuse with
`checkpoint_series_live_params`, raised before any value is looked up, unless every member
carries an immutable parameter snapshot. `snapshot_params(trace)` takes one: host copies of
every parameter value, marked read-only, taken only when the trace's capture stamps prove no
parameter changed since capture (else `checkpoint_snapshot_stale`), so the copy is the
capture-time value. Call it right after `tl.trace`, before the model changes, or capture with
`tl.options.CaptureOptions(snapshot_params=True)`: `tl.trace` then takes it as the capture's
last step (`take_capture_snapshot`), so no model change can come between.

The guard is keyed on whether a snapshot exists, never on object identity. Snapshots live in
memory beside the trace; `Bundle.save` writes each member's snapshot into the bundle artifact
(`snapshots/<n>.safetensors`, digest-pinned) and `Bundle.load` binds it back, so the guard and
its evidence both survive the round trip. A member saved without one loads without one.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import numpy as np

from torchlens.bundle.align import host_array
from torchlens.errors import BundleError

_SNAPSHOTS: "weakref.WeakKeyDictionary[Any, dict[str, np.ndarray]]" = weakref.WeakKeyDictionary()


def snapshot_params(trace: Any) -> dict[str, np.ndarray]:
    """Take (or return the existing) capture-time snapshot of every parameter of `trace`."""
    held = _SNAPSHOTS.get(trace)
    if held is not None:
        return held
    from torchlens.replay.params import changed_params

    changed = changed_params(trace, list(trace._params))
    if changed:
        raise BundleError("checkpoint_snapshot_stale", f"parameters {changed[:5]} changed since this trace was captured",
                          remedy="call snapshot_params(trace) right after tl.trace, before the model changes",
                          changed=list(changed))
    snap: dict[str, np.ndarray] = {}
    for address, p in trace._params.items():
        arr = host_array(trace, p.value)
        if arr is None:
            raise BundleError("checkpoint_snapshot_stale", f"parameter {address!r} holds no value to snapshot",
                              remedy="snapshot a live capture (a loaded trace holds no parameter bytes)",
                              changed=[address])
        arr = np.array(arr, copy=True)
        arr.setflags(write=False)
        snap[address] = arr
    _SNAPSHOTS[trace] = snap
    return snap


def take_capture_snapshot(trace: Any, capture: Any) -> None:
    """The `CaptureOptions(snapshot_params=True)` step: `tl.trace` calls it on the finished
    trace before returning it (nothing else has run since the forward)."""
    from torchlens.records.trace import Trace

    if isinstance(trace, Trace) and capture is not None and getattr(capture, "snapshot_params", False):
        snapshot_params(trace)


def attach_snapshot(trace: Any, snap: dict[str, np.ndarray]) -> None:
    """Bind a snapshot read back from a bundle artifact (its bytes were checked on load)."""
    for arr in snap.values():
        arr.setflags(write=False)
    _SNAPSHOTS[trace] = snap


def snapshot_of(trace: Any) -> dict[str, np.ndarray] | None:
    return _SNAPSHOTS.get(trace)


def require_snapshots(members: dict[str, Any], names: Iterable[str], read: str) -> dict[str, dict[str, np.ndarray]]:
    """The snapshots of `names`, or `checkpoint_series_live_params` naming the members without one."""
    names = list(names)
    lacking = [n for n in names if _SNAPSHOTS.get(members[n]) is None]
    if lacking:
        raise BundleError("checkpoint_series_live_params",
                          f"{read} reads parameter values across members, but {lacking} carry only live references "
                          "(a later optimizer step would show up in every member)",
                          remedy="capture each member with tl.options.CaptureOptions(snapshot_params=True), or call "
                                 "torchlens.bundle.snapshot_params(trace) right after each capture",
                          members=lacking, read=read)
    return {n: _SNAPSHOTS[members[n]] for n in names}


__all__ = ["snapshot_params", "take_capture_snapshot", "snapshot_of", "attach_snapshot", "require_snapshots"]
