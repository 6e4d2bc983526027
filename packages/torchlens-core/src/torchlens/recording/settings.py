"""`RecordingSettings`: the read-only record of what a recording was made with (glossary:
Recording.options / RecordingSettings). No public constructor: `Recording.options` returns one.
Values are the live objects the recorder used, never repr strings."""

from __future__ import annotations

from typing import Any

#: Capture knobs read from `capture=CaptureOptions(...)` (None where CaptureOptions lacks one).
CAPTURE_FIELDS: tuple[str, ...] = (
    "save_grads", "activation_transform", "grad_transform", "save_raw_activations", "save_raw_grads",
    "detach_saved_activations", "lookback", "lookback_payload_policy", "seed", "backward_ready", "inference_only")
#: Recorder knobs read from `recording=RecordingOptions(...)`.
RECORDER_FIELDS: tuple[str, ...] = (
    "default_op", "default_module", "default_grad", "history_size", "include_source_events", "lean",
    "max_predicate_failures", "on_predicate_error", "on_forward_error", "postprocess")
#: Knobs read from `tl.record` keywords.
KEYWORD_FIELDS: tuple[str, ...] = ("keep_op", "intervene", "stop_after", "storage", "narrate")

FIELDS: tuple[str, ...] = CAPTURE_FIELDS + RECORDER_FIELDS + KEYWORD_FIELDS

_TOKEN = object()


class RecordingSettings:
    """Read-only settings of one recording; every name in `FIELDS` is an attribute."""

    __slots__ = ("_values",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args or args[0] is not _TOKEN:
            raise TypeError("RecordingSettings has no public constructor: read recording.options")
        object.__setattr__(self, "_values", dict(kwargs))

    @classmethod
    def _make(cls, capture: Any, recording: Any, **keywords: Any) -> "RecordingSettings":
        values: dict[str, Any] = {}
        for name in CAPTURE_FIELDS:
            values[name] = getattr(capture, name, None) if capture is not None else None
        for name in RECORDER_FIELDS:
            values[name] = getattr(recording, name, None) if recording is not None else None
        for name in KEYWORD_FIELDS:
            values[name] = keywords.get(name)
        return cls(_TOKEN, **values)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"RecordingSettings has no field {name!r}; fields: {', '.join(FIELDS)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("RecordingSettings is read-only")

    def __reduce__(self) -> tuple:
        return (_rebuild, (dict(self._values),))

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, RecordingSettings) and self._values == other._values

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self._values.items() if v is not None)
        return f"RecordingSettings({shown})"


def _rebuild(values: dict) -> RecordingSettings:
    return RecordingSettings(_TOKEN, **values)


def plain_settings(settings: RecordingSettings) -> RecordingSettings:
    """The settings a saved or unpickled recording keeps: plain values (bools, numbers,
    strings, None) as they were; callables and other objects read None."""
    plain = (bool, int, float, str, type(None))
    values = {k: (v if isinstance(v, plain) else None) for k, v in settings.as_dict().items()}
    return RecordingSettings(_TOKEN, **values)


__all__ = ["RecordingSettings", "FIELDS", "plain_settings"]
