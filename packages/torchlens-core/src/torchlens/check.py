"""`tl.validate(model, x)`: capture with everything saved, then let the backend replay it.

The verdict is a bool; the detailed `ValidationStatus` (first failing op and a reason from
`tl.backends.VALIDATION_REASONS`) is on the validation trace as
`trace.validation_replay_status`, handed to `trace_observer=` before the trace is dropped.
"""

from __future__ import annotations

from typing import Any, Callable

from torchlens.errors import InvalidArgumentError

SCOPES = ("forward", "saved")


def validate(model: Any, *args: Any, scope: str = "forward", trace_observer: Callable[[Any], None] | None = None,
             num_threads: int | None = None, output_device: str = "same", save_budget: Any = "auto",
             input_kwargs: dict[str, Any] | None = None, backend: str | None = None) -> bool:
    """Validate a model/input pair: every op replayed from its saved inputs must reproduce
    its saved output, and perturbing an input must change it (unless exempt by rule)."""
    from torchlens.backends.registry import select_backend
    from torchlens.capture import trace as _trace
    from torchlens.options import CaptureOptions

    if scope not in SCOPES:
        raise InvalidArgumentError("invalid_argument", f"scope={scope!r} is not one of {SCOPES}",
                                   remedy="scope='forward' (default) or scope='saved'", scope=scope)
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise InvalidArgumentError("invalid_argument", "num_threads must be a positive int", remedy="num_threads=1")
    kwargs = dict(input_kwargs or {})
    proto = select_backend(model, args, kwargs, backend)
    proto.capabilities().refuse_unless("validation_replay", f"the {proto.name} backend cannot replay ops to validate them")
    run = getattr(proto, "validation_session", None)
    session = run(num_threads=num_threads) if run is not None else _null_session()
    with session:
        t = _trace(model, *args, input_kwargs=kwargs, backend=proto.name,
                   capture=CaptureOptions(output_device=output_device, save_budget=save_budget), save="all")
        status = proto.validate(t, None)
        t.validation_replay_status = status
        if trace_observer is not None:
            trace_observer(t)
    return bool(status)


class _null_session:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
