"""`tl.recording`: the sparse predicate-recording namespace behind `tl.record` (issue 22).

- `record(model, x, save=...)` -> `Recording`; `Recorder` runs several forwards into one.
- `Recording`: kept payloads (`records`), `output`, `options` (`RecordingSettings`),
  `outcome` (`CaptureOutcome`), `to_trace()` and the verbs that convert through it.
- Generation: `record(model, input_ids, save=..., generate_kwargs={...})` ->
  `GenerationRecording` (`GenerationStep`, `GenerationOptions`, `TokenSeries`).
"""

from __future__ import annotations

from typing import Any

from torchlens.options import RecordingOptions
from torchlens.records.outcome import OUTCOME_STATUSES, CaptureOutcome
from torchlens.recording.recorder import Recorder, record
from torchlens.recording.recording import Recording, RecordingPass, SiteRecord
from torchlens.recording.settings import RecordingSettings

_LAZY = {
    "GenerationRecording": "torchlens.recording.generation",
    "GenerationStep": "torchlens.recording.generation",
    "GenerationOptions": "torchlens.recording.generation",
    "TokenSeries": "torchlens.recording.generation",
    "reducers": None,
}


def __getattr__(name: str) -> Any:
    import importlib

    if name not in _LAZY:
        raise AttributeError(f"module 'torchlens.recording' has no attribute {name!r}")
    if name == "reducers":
        value: Any = importlib.import_module("torchlens.recording.reducers")
    else:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = ["record", "Recorder", "Recording", "RecordingPass", "SiteRecord", "RecordingSettings", "RecordingOptions",
           "CaptureOutcome", "OUTCOME_STATUSES", *_LAZY]
