"""`tl.distributed`: capture of explicit collectives and merging of rank-local traces.

- `arm()` opts this process into capturing explicit collectives as collective boundary ops
  (the backend installs the wrappers; `disarm()` restores exactly what it replaced);
  `arming()` is the same as a context manager.
- `ArmingRecord`, `GroupIdentity`: what arming established / one process group's identity.
- `merge_ranks([...])` -> `MergedTrace`, `merge_report([...])` -> `MergeReport`
  (also `tl.merge_ranks`, `tl.merge_report`).
- `MergeAlignment`, `MergeValueStatus`: the merge vocabularies.

This layer is framework-free: arming is delegated to the backend package's `distributed`
module (`torchlens_torch.distributed` for torch).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

from torchlens.distributed.merge import (
    CollectiveVerdict,
    MergedCollective,
    MergedTrace,
    MergeReport,
    merge_ranks,
    merge_report,
)
from torchlens.distributed.records import (
    BOUNDARY_SCHEMA,
    DISTRIBUTED_SCOPES,
    ArmingRecord,
    GroupIdentity,
    MergeAlignment,
    MergeValueStatus,
    check_boundary,
)


def _impl(backend: str) -> Any:
    from torchlens.backends.registry import get_spec

    spec = get_spec(backend)
    return importlib.import_module(f"{spec.namespace}.distributed")


def arm(backend: str = "torch") -> ArmingRecord:
    """Arm explicit-collective capture in this process (call at process start, on every rank,
    before `init_process_group`'s collectives run). Idempotent; returns the `ArmingRecord`."""
    return _impl(backend).arm(source="explicit")


def disarm(backend: str = "torch") -> None:
    """Restore exactly what `arm()` replaced."""
    _impl(backend).disarm()


def armed(backend: str = "torch") -> ArmingRecord | None:
    """The current `ArmingRecord`, or None when not armed."""
    return _impl(backend).armed()


@contextlib.contextmanager
def arming(backend: str = "torch") -> Iterator[ArmingRecord]:
    """`with tl.distributed.arming():` arms, and disarms on exit (if it armed)."""
    was = armed(backend)
    record = arm(backend)
    try:
        yield record
    finally:
        if was is None:
            disarm(backend)


def boundary(op: Any) -> dict[str, Any] | None:
    """The `collective_boundary_v1` payload of an op, or None for an ordinary op."""
    return (getattr(op, "meta", None) or {}).get("collective")


__all__ = ["arm", "disarm", "armed", "arming", "boundary", "ArmingRecord", "GroupIdentity", "MergeAlignment",
           "MergeValueStatus", "BOUNDARY_SCHEMA", "DISTRIBUTED_SCOPES", "check_boundary", "merge_ranks",
           "merge_report", "MergedTrace", "MergeReport", "MergedCollective", "CollectiveVerdict"]
