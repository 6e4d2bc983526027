"""`tl.trace`: pick a backend, guard against reentrancy, capture."""

from __future__ import annotations

import threading
from typing import Any

from torchlens.errors import InvalidArgumentError, ReentrantTraceError
from torchlens.options import CaptureOptions

_state = threading.local()


def trace(model: Any, *args: Any, save: Any = "all", capture: CaptureOptions | None = None,
          backend: str | None = None, input_kwargs: dict[str, Any] | None = None, **trace_options: Any) -> Any:
    """Record every operation `model(*args, **input_kwargs)` executes and return a `Trace`.

    `save` chooses payloads: `"all"` (default), `"none"` (structure only), a selector, or a
    list of labels / module addresses. `capture` carries `CaptureOptions`. `backend` names a
    backend; by default the first registered backend whose framework is already imported
    and that says it can handle `model` is used.
    """
    from torchlens.backends.registry import select_backend

    if capture is not None and not isinstance(capture, CaptureOptions):
        raise InvalidArgumentError("invalid_argument", f"capture= takes a CaptureOptions, not {type(capture).__name__}",
                                   remedy="capture=tl.options.CaptureOptions(...)")
    if input_kwargs is not None and not isinstance(input_kwargs, dict):
        raise InvalidArgumentError("invalid_argument", "input_kwargs= takes a dict", remedy="input_kwargs={'mask': m}")
    if getattr(_state, "active", False):
        raise ReentrantTraceError("reentrant_trace", "tl.trace was called while another capture is running in this thread",
                                  remedy="finish the outer capture first; trace the inner model separately")
    kwargs = dict(input_kwargs or {})
    proto = select_backend(model, args, kwargs, backend)
    _state.active = True
    try:
        return proto.capture(model, args, kwargs, save=save, capture=capture or CaptureOptions(), **trace_options)
    finally:
        _state.active = False


def capture_active() -> bool:
    """True while a `tl.trace` capture runs in this thread."""
    return bool(getattr(_state, "active", False))
