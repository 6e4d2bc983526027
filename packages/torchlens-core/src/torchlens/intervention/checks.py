"""Argument checks for the edit helpers.

Every helper checks its own arguments when it is built (types, finiteness, ranges, non-zero
directions) and, through `Edit.check`, the site it is staged on (axes, lengths,
broadcasting) before anything is mutated or recomputed. A refusal is an `InterventionError`
with a stable code: the spec's where one is named (`steer_direction_invalid`,
`intervention_over_invalid`, `axis_semantics_unknown`, `position_edit_*`,
`subspace_basis_*`, `affine_source_invalid`), else `edit_argument_invalid` (a bad scalar or
type) or `edit_argument_shape_mismatch` (a tensor that does not broadcast to the site).
Tensor arguments are read on the host once, at construction, through numpy: no framework.
A framework value is copied to the host by the backend that owns it (`host_copy`, a required
member of every backend), so core never calls a framework's own methods on it.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from torchlens.errors import InterventionError


def bad(who: str, message: str, remedy: str, code: str = "edit_argument_invalid", **fields: Any) -> InterventionError:
    return InterventionError(code, f"{who}: {message}", remedy=remedy, helper=who, **fields)


def owning_backend(v: Any) -> Any:
    """The registered backend whose `is_tensor` claims `v`, among the backends whose framework
    is already imported (so asking imports nothing); None for numpy and plain Python values."""
    if isinstance(v, (np.ndarray, np.generic, numbers.Number, str, bytes, list, tuple, dict)) or v is None:
        return None
    import sys

    from torchlens.backends.registry import get_protocol, specs

    try:
        candidates = [s for s in specs().values() if any(m in sys.modules for m in s.modules)]
    except Exception:  # noqa: BLE001 - a broken plugin registry: read the value through numpy
        return None
    for spec in candidates:
        try:
            proto = get_protocol(spec.name)
            if proto.is_tensor(v):
                return proto
        except Exception:  # noqa: BLE001 - a backend that cannot load or answer does not own it
            continue
    return None


def to_numpy(v: Any) -> np.ndarray:
    """A tensor-like value as a host numpy array: a framework value through its backend's
    `host_copy`, anything else through `np.asarray`; a float type numpy lacks (bfloat16 and
    the other ml_dtypes floats) is widened to float32 so the checks can read it."""
    if not isinstance(v, np.ndarray):
        proto = owning_backend(v)
        v = np.asarray(proto.host_copy(v) if proto is not None else v)
    if v.dtype.kind == "V" and "float" in v.dtype.name:
        v = v.astype(np.float32)
    return v


def is_tensor_like(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(v, (str, bytes))


def real(who: str, name: str, v: Any, *, low: float | None = None, low_open: bool = False,
         allow_inf: bool = False, remedy: str) -> Any:
    """A real number (int or float, never bool or text; a 0-d tensor counts), finite unless
    `allow_inf`, and at least `low` (above it with `low_open`). Returns `v` unchanged."""
    if isinstance(v, bool) or v is None or isinstance(v, (str, bytes)):
        raise bad(who, f"{name}={v!r} is not a real number", remedy, argument=name)
    if isinstance(v, numbers.Real):
        x = float(v)
    elif is_tensor_like(v) and tuple(v.shape) == ():
        arr = _numeric(who, name, v, remedy, code="edit_argument_invalid")
        x = float(arr)
    else:
        raise bad(who, f"{name}={type(v).__name__} is not a real number", remedy, argument=name)
    if np.isnan(x) or (np.isinf(x) and not (allow_inf and x > 0)):
        raise bad(who, f"{name}={x!r} is not finite", remedy, argument=name)
    if low is not None and (x < low or (low_open and x == low)):
        raise bad(who, f"{name}={x!r} must be {'>' if low_open else '>='} {low}", remedy, argument=name)
    return v


def integer(who: str, name: str, v: Any, *, low: int | None = None, high: int | None = None, remedy: str,
            code: str = "edit_argument_invalid") -> int:
    """A Python or numpy integer (never bool), within [low, high]."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise bad(who, f"{name}={v!r} is not an int", remedy, code, argument=name)
    if (low is not None and v < low) or (high is not None and v > high):
        raise bad(who, f"{name}={v!r} is out of range", remedy, code, argument=name)
    return int(v)


def flag(who: str, name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise bad(who, f"{name}={v!r} is not a bool", f"{name}=True or {name}=False", argument=name)
    return v


def _numeric(who: str, name: str, v: Any, remedy: str, *, code: str) -> np.ndarray:
    try:
        arr = to_numpy(v)
    except Exception as exc:  # an object numpy cannot read as numbers
        raise bad(who, f"{name} cannot be read as numbers ({type(exc).__name__})", remedy, code, argument=name) from exc
    if arr.dtype.kind not in "iuf":
        raise bad(who, f"{name} has dtype {arr.dtype}, not a real number type", remedy, code, argument=name)
    return arr


def tensor(who: str, name: str, v: Any, *, remedy: str, code: str = "edit_argument_invalid",
           finite: bool = True) -> tuple[int, ...]:
    """A real-valued tensor, array or nested list of numbers (finite by default); returns its shape."""
    if v is None or isinstance(v, (bool, str, bytes, dict, set)) or callable(v):
        raise bad(who, f"{name}={type(v).__name__} is not a tensor or a number", remedy, code, argument=name)
    arr = _numeric(who, name, v, remedy, code=code)
    if finite and arr.size and not np.all(np.isfinite(arr)):
        raise bad(who, f"{name} holds NaN or Inf", remedy, code, argument=name)
    return tuple(arr.shape)


def direction(who: str, v: Any, *, vector: bool, nonzero: bool) -> tuple[int, ...]:
    """A steering/projection direction: real, finite, non-empty; 1-d when `vector`; of
    non-zero norm when `nonzero`. Refusals are `steer_direction_invalid`."""
    remedy = "pass a finite 1-d direction of the site's feature width, e.g. tl.steer(v, 4.0, dim=-1)"
    shape = tensor(who, "direction", v, remedy=remedy, code="steer_direction_invalid")
    if len(shape) == 0 or 0 in shape:
        raise bad(who, f"the direction has shape {shape}; it needs at least one element", remedy, "steer_direction_invalid")
    if vector and len(shape) != 1:
        raise bad(who, f"needs a 1-d direction, got shape {shape}", remedy, "steer_direction_invalid", shape=shape)
    if nonzero and not np.any(to_numpy(v)):
        raise bad(who, "the direction is all zeros, so it has no unit vector", remedy, "steer_direction_invalid")
    return shape


def broadcast_into(who: str, name: str, arg_shape: tuple[int, ...], site: tuple[int, ...], allow_shape_change: bool,
                   code: str = "edit_argument_shape_mismatch") -> None:
    """`arg_shape` must broadcast with the site, and (unless allowed) leave its shape alone."""
    try:
        out = tuple(np.broadcast_shapes(tuple(site), tuple(arg_shape)))
    except ValueError:
        raise bad(who, f"{name} of shape {tuple(arg_shape)} does not broadcast to the site's shape {tuple(site)}",
                  "pass a value whose shape broadcasts to the site (check trace[site].shape)", code,
                  argument=name, shape=tuple(arg_shape), site_shape=tuple(site)) from None
    if out != tuple(site) and not allow_shape_change:
        raise InterventionError("intervention_shape_changed", f"{who}: {name} of shape {tuple(arg_shape)} would change the "
                                f"site from {tuple(site)} to {out}", remedy="pass allow_shape_change=True to the helper if "
                                "that is intended", helper=who, shape=tuple(arg_shape), site_shape=tuple(site))


def axis_in(who: str, dim: int, site: tuple[int, ...], code: str, remedy: str) -> int:
    """`dim` as a non-negative axis of a site of shape `site` (refused when out of range)."""
    nd = len(site)
    if not -nd <= dim < nd:
        raise bad(who, f"dim={dim} is not an axis of the site's shape {tuple(site)}", remedy, code, dim=dim,
                  site_shape=tuple(site))
    return dim % nd


def refuse_unmatchable_live(resolved: list, fired_events: Any, event_of: dict[str, Any]) -> None:
    """glossary l. 289, 811: a rerun's forward rule whose selector matched sites of the rerun's
    own graph but fired at none of them live (an input, an output or a `__setitem__` op, which
    no live hook edits) raises rerun_selector_unmatchable_live, whatever `on_zero_fire` says.
    Called after the edited capture and before its result is adopted (the trace unchanged).
    `resolved` holds (rule, site labels, applied edit, source) rows; `fired_events` the event
    ids the edit plan fired at; `event_of` maps an op label of the edited run to its event id."""
    for rule, site_labels, _applied, _source in resolved:
        if rule.signal == "backward" or not site_labels:
            continue  # gradient rules are armed; no match at all is the zero-fire policy's case
        if any(event_of.get(lb) in fired_events for lb in site_labels):
            continue
        raise InterventionError(
            "rerun_selector_unmatchable_live", f"{rule.target!r} matches {', '.join(list(site_labels)[:4])} on the rerun's "
            "graph but fired at none of them during the rerun's forward: a live edit cannot reach those ops; nothing was "
            "changed", remedy="edit them with the replay engine (trace.do(site, edit) without model=/inputs=), or target "
            "the op that produces the value (its parent) for a live rerun", target=repr(rule.target),
            sites=list(site_labels))


def refuse_async_lazy(out: Any) -> None:
    """glossary l. 282: a bound call that returns an async lazy output (a coroutine, an
    awaitable, an async generator or iterator) raises bind_lazy_output: the edits are held
    only while the call runs, and an async body runs later, outside them. The object is closed
    first when it can be (so a coroutine is not left never awaited)."""
    import inspect

    kind = ("coroutine" if inspect.iscoroutine(out) else "async generator" if inspect.isasyncgen(out)
            else "async iterator" if hasattr(out, "__anext__") or hasattr(out, "__aiter__")
            else "awaitable" if inspect.isawaitable(out) else None)
    if kind is None:
        return
    close = getattr(out, "close", None) if kind == "coroutine" else None
    if callable(close):
        close()
    raise InterventionError("bind_lazy_output", f"the bound call returned an {kind} ({type(out).__name__}); its body "
                            "would run after the call returned, outside the bound edits", remedy="call a synchronous "
                            "method (a plain call or a sync generator such as bound.generate(...)), or run the async "
                            "code inside a synchronous bound call", kind=kind, type=type(out).__name__)
