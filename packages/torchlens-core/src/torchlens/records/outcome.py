"""`CaptureOutcome`: the frozen record of how a capture ended (glossary: Capture outcome).

`Trace.outcome`, `Recording.outcome` and a partial trace's `outcome` read one. The status is
one of `OUTCOME_STATUSES`; a FAILED outcome also names the phase that failed ("forward",
"build", ...). The outcome is derived from facts the capture already wrote (the backend's
`provenance.extra["outcome"]`, a partial trace's annotation, the effective
`inference_only`), so it costs nothing at capture time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The statuses a capture outcome can have.
OUTCOME_STATUSES: tuple[str, ...] = ("COMPLETE", "STOPPED", "ABORTED_NONFINITE", "FAILED", "UNATTESTED", "UNKNOWN")


@dataclass(frozen=True)
class CaptureOutcome:
    """How a capture ended.

    - `status`: one of `OUTCOME_STATUSES`. UNATTESTED: the backend did not say (a backend
      that records no outcome); UNKNOWN: nothing is known (for example a hand-built trace).
    - `phase`: for FAILED, where it failed ("forward" for a forward that raised); else None.
    - `inference_only`: the effective inference-only flag of the capture (None: unknown).
    - `error_type` / `error_message`: the failure's exception type and message (strings).
    - `stopped_at`: for STOPPED, the label of the site `stop_after=` stopped after.
    """

    status: str
    phase: str | None = None
    inference_only: bool | None = None
    error_type: str | None = None
    error_message: str | None = None
    stopped_at: str | None = None

    def __post_init__(self) -> None:
        if self.status not in OUTCOME_STATUSES:
            raise ValueError(f"capture outcome status {self.status!r} is not one of {OUTCOME_STATUSES}")

    @property
    def ok(self) -> bool:
        """True for COMPLETE and STOPPED (the capture ended the way it was asked to)."""
        return self.status in ("COMPLETE", "STOPPED")


def trace_outcome(trace: Any) -> CaptureOutcome:
    """The outcome of a Trace, read from what its capture recorded."""
    extra = getattr(getattr(trace, "provenance", None), "extra", None) or {}
    options = getattr(trace, "options", None)
    inference_only = getattr(options, "inference_only", None) if options is not None else None
    annotations = getattr(trace, "annotations", {}) or {}
    stopped = annotations.get("stopped_at")
    if stopped is not None:
        return CaptureOutcome("STOPPED", inference_only=inference_only, stopped_at=stopped)
    status = extra.get("outcome")
    if annotations.get("partial") or status == "FAILED":
        return CaptureOutcome("ABORTED_NONFINITE" if annotations.get("outcome_status") == "ABORTED_NONFINITE" else "FAILED", phase=annotations.get("failed_phase", "forward"), inference_only=inference_only,
                              error_type=annotations.get("error_type"), error_message=annotations.get("error_message"))
    if status in OUTCOME_STATUSES:
        return CaptureOutcome(status, inference_only=inference_only)
    if getattr(trace, "_ops", None):
        return CaptureOutcome("UNATTESTED", inference_only=inference_only)
    return CaptureOutcome("UNKNOWN", inference_only=inference_only)


__all__ = ["CaptureOutcome", "OUTCOME_STATUSES", "trace_outcome"]
