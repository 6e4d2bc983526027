"""`tl.validate(model, x, scope=...)`: capture what the scope needs, then let the backend check it.

Scopes (spec/glossary.md, "Validation entry"):

- `"forward"` (default): capture with everything saved, replay every op from its saved
  inputs and compare, perturb each input of each op;
- `"saved"`: the same check on the trace after `save` and `tl.load` (what a file gives back);
- `"receptive_field"`, `"intervention"`, `"backward"`: the backend's `validate_scope` checks
  the captured graph's dependencies, replayed edits, and gradients against independent runs
  of the model (see `torchlens_torch.validate_scopes`).

The verdict is a bool; the detailed `ValidationStatus` (first failing op, a reason from
`tl.backends.VALIDATION_REASONS`, `.state`, `.num_failed_ops`) is on the validation trace as
`trace.validation_replay_status`, handed to `trace_observer=` once before the trace is dropped.
`output_device` and `save_budget` set the validator capture's save options on the forward,
saved and intervention scopes; a non-default value on backward or receptive_field raises
TypeError (those scopes capture with their own options).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

from torchlens.backends.protocol import SupportsValidationScopes, SupportsValidationSession, supports
from torchlens.errors import InvalidArgumentError

SCOPES = ("forward", "saved", "receptive_field", "intervention", "backward")
_SAVE_OPTION_SCOPES = ("forward", "saved", "intervention")


def validate(model: Any, *args: Any, scope: str = "forward", trace_observer: Callable[[Any], None] | None = None,
             num_threads: int | None = None, output_device: str = "same", save_budget: Any = "auto",
             input_kwargs: dict[str, Any] | None = None, backend: str | None = None) -> bool:
    """Validate a model/input pair for `scope`: every op replayed from its saved inputs must
    reproduce its saved output, and perturbing an input must change it (unless exempt by
    rule); the other scopes check dependencies, edits and gradients (module docstring)."""
    from torchlens.backends.registry import select_backend
    from torchlens.options import CaptureOptions

    if scope not in SCOPES:
        raise InvalidArgumentError("invalid_argument", f"scope={scope!r} is not one of {SCOPES}",
                                   remedy="scope='forward' (default), 'saved', 'receptive_field', 'intervention' or "
                                          "'backward'", scope=scope)
    if scope not in _SAVE_OPTION_SCOPES and (output_device != "same" or save_budget != "auto"):
        name = "output_device" if output_device != "same" else "save_budget"
        raise TypeError(f"validate(scope={scope!r}) got {name}=: it applies to the {', '.join(_SAVE_OPTION_SCOPES)} "
                        "scopes only")
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise InvalidArgumentError("invalid_argument", "num_threads must be a positive int", remedy="num_threads=1")
    kwargs = dict(input_kwargs or {})
    proto = select_backend(model, args, kwargs, backend)
    proto.capabilities().refuse_unless("validation_replay", f"the {proto.name} backend cannot replay ops to validate them")
    capture = CaptureOptions(output_device=output_device, save_budget=save_budget)
    session = proto.validation_session(num_threads=num_threads) if supports(proto, SupportsValidationSession) \
        else _null_session()
    with session:
        if scope in ("forward", "saved"):
            t, status = _replay_scope(proto, model, args, kwargs, capture, saved=scope == "saved")
        else:
            if not supports(proto, SupportsValidationScopes):
                from torchlens.errors import BackendUnsupportedError

                raise BackendUnsupportedError("validation_replay_unsupported",
                                              f"the {proto.name} backend has no {scope!r} validation",
                                              remedy="scope='forward' (or the torch backend)", scope=scope)
            status, t = proto.validate_scope(scope, model, args, kwargs, capture if scope == "intervention" else None)
        if t is not None:
            t.validation_replay_status = status
        if trace_observer is not None:
            trace_observer(t)
    return bool(status)


def _replay_scope(proto: Any, model: Any, args: tuple, kwargs: dict, capture: Any, saved: bool) -> tuple[Any, Any]:
    """Capture with everything saved (then save and load it, for `saved`) and replay it."""
    from torchlens.capture import trace as _trace

    t = _trace(model, *args, input_kwargs=kwargs, backend=proto.name, capture=capture, save="all")
    if saved:
        from torchlens.io.bundle import load

        with tempfile.TemporaryDirectory(prefix="tl-validate-") as tmp:
            t = load(t.save(Path(tmp) / "validate.tlspec"))
        from torchlens.io.opaque import refuse_opaque

        refuse_opaque(t, t._ops.values())
    return t, proto.validate(t, None)


class _null_session:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
