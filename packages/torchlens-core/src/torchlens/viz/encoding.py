"""Encoding channels: color_by, size_by and stack_by (spec: Encoding channel).

A channel maps a value source (a record field name, a builtin token such as "time",
"bytes", "flops", or a callable node -> value) onto the drawing. Channels are
presentation-only: they never change the Trace or the collapse plan.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from torchlens.errors import InvalidArgumentError
from torchlens.records.op import Op, numel
from torchlens.viz.ramp import default_ramp
from torchlens.viz.units import fmt_quantity, quantity_label

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.trace import Trace
    from torchlens.viz.ir import RenderIR
    from torchlens.viz.themes import Theme

#: Builtin tokens and how one op yields them.
TOKENS: dict[str, Callable[[Op], Any]] = {
    "time": lambda op: op.meta.get("duration_s"),
    "device_time": lambda op: op.meta.get("device_time_s"),
    "bytes": lambda op: op.nbytes,
    "flops": lambda op: op.meta.get("flops"),
    "macs": lambda op: op.meta.get("macs"),
    "params": lambda op: sum(op._trace._params[a].numel for a in op.params if a in op._trace._params),
    "dims": lambda op: numel(op.shape[1:]) if op.shape else (1 if op.shape == () else None),
}
#: Sources whose values add up across member ops (module boxes, rolled totals).
ADDITIVE = {"time", "device_time", "bytes", "flops", "macs", "nbytes", "numel", "params"}
#: Rolled drawings look field sources up here: exact cross-pass totals ...
ROLLED_TOTALS = {"total_time": "time", "total_device_time": "device_time", "total_bytes": "bytes",
                 "total_flops": "flops", "total_macs": "macs", "total_nbytes": "nbytes", "total_numel": "numel"}
#: ... and per-pass sources that encode only when every pass agrees.
ROLLED_PER_PASS = {"time", "device_time", "bytes", "flops", "macs", "params", "dims", "numel", "nbytes",
                   "duration", "num_passes", "func_name"}
ELIGIBLE_KINDS = ("param", "compute", "module", "repeat")
#: Node kinds that stand for many ops (a folded module call, a folded run of repeats).
BOX_KINDS = ("module", "repeat")
SIZE_SCALES = ("sqrt", "linear")


class _DefaultScale(str):
    """The default size_scale ("sqrt"), distinguishable from an explicit one."""


DEFAULT_SCALE = _DefaultScale("sqrt")


@dataclass
class EncodingState:
    """What a channel drew: its source, range, per-node values and any notes."""

    channel: str
    source: str
    values: dict[str, float] = field(default_factory=dict)  # node id -> value
    vmin: float | None = None
    vmax: float | None = None
    scale: str | None = None
    aggregation: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return quantity_label(self.source)

    def fmt(self, v: float) -> str:
        return fmt_quantity(self.source, v)


def _source_name(source: Any) -> str:
    if callable(source):
        return getattr(source, "__name__", "callable")
    return str(source)


def _check_source(trace: "Trace", source: Any, channel: str) -> None:
    if callable(source):
        return
    if not isinstance(source, str) or not source:
        raise InvalidArgumentError("encoding_source_invalid", f"{channel}={source!r} is not a field name, token or callable",
                                   remedy=f"use one of {', '.join(TOKENS)}, an Op field name, or a callable node -> value",
                                   source=repr(source))
    base = ROLLED_TOTALS.get(source, source)
    if base in TOKENS or hasattr(Op, base) or any(base in op.meta for op in trace):
        return
    raise InvalidArgumentError("encoding_source_invalid", f"{channel}={source!r}: no such token, Op field or meta key",
                               remedy=f"use one of {', '.join(TOKENS)}, an Op field name (numel, nbytes, pass_number, ...), or a callable",
                               source=source)


def _scalar(value: Any, source: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        return v if math.isfinite(v) else None
    if hasattr(value, "__float__") and hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0:
        v = float(value)  # a NumPy scalar
        return v if math.isfinite(v) else None
    raise InvalidArgumentError("encoding_value_invalid",
                               f"source {source!r} gave a {type(value).__name__}, not a number",
                               remedy="encode a numeric field or return a number from the callable",
                               source=source, value_type=type(value).__name__)


def _call(fn: Callable, record: Any, source: str) -> Any:
    try:
        return fn(record)
    except InvalidArgumentError:
        raise
    except Exception as exc:
        raise InvalidArgumentError("encoding_callable_error", f"the {source!r} callable raised {type(exc).__name__}: {exc}",
                                   remedy="fix the callable or make it return None for nodes it cannot value",
                                   source=source) from exc


def _op_value(op: Op, source: Any, name: str) -> float | None:
    if callable(source):
        return _scalar(_call(source, op, name), name)
    base = ROLLED_TOTALS.get(source, source)
    token = TOKENS.get(base)
    if token is not None:
        return _scalar(token(op), name)
    if hasattr(Op, base):
        try:
            raw = getattr(op, base)
        except Exception:  # a payload read that refuses has no value
            return None
        return _scalar(raw, name)
    return _scalar(op.meta.get(base), name)


def node_values(trace: "Trace", ir: "RenderIR", source: Any, channel: str) -> EncodingState:
    """Each eligible node's value for a source, with notes on what was left unencoded."""
    _check_source(trace, source, channel)
    name = _source_name(source)
    state = EncodingState(channel, name)
    strict = channel == "size"
    varying: list[str] = []
    box_skipped = False
    for node in ir.nodes.values():
        if node.kind not in ELIGIBLE_KINDS:
            continue
        if node.kind in BOX_KINDS:
            base = None if callable(source) else ROLLED_TOTALS.get(source, source)
            if base not in ADDITIVE:
                box_skipped = True
                continue
            vals = [v for v in (_op_value(op, source, name) for op in node.ops) if v is not None]
            if vals:
                state.values[node.id] = float(sum(vals))
            continue
        if ir.rolled and node.passes > 1:
            if callable(source):
                v = _scalar(_call(source, node.record, name), name)
            elif source in ROLLED_TOTALS:
                vals = [v for v in (_op_value(op, source, name) for op in node.ops) if v is not None]
                v = float(sum(vals)) if vals else None
            elif source in ROLLED_PER_PASS:
                vals = [_op_value(op, source, name) for op in node.ops]
                if len(set(vals)) == 1:
                    v = vals[0]
                else:
                    if strict:
                        raise InvalidArgumentError(
                            "size_by_rolled_varying", f"size_by={name!r}: layer {node.record.label!r} has a different value on each of its {node.passes} passes",
                            remedy=f"draw unrolled (rolled=False) or size by an exact total such as 'total_{name}'" if f"total_{name}" in ROLLED_TOTALS else "draw unrolled (rolled=False)",
                            source=name, layer=node.record.label)
                    varying.append(node.record.label)
                    continue
            else:
                raise InvalidArgumentError(
                    "encoding_source_invalid", f"{channel}_by={name!r} has no rolled aggregate",
                    remedy=f"on a rolled drawing use one of {', '.join(sorted(ROLLED_TOTALS | dict.fromkeys(ROLLED_PER_PASS)))}, or draw unrolled",
                    source=name)
        else:
            v = _op_value(node.ops[0], source, name)
        if v is not None:
            state.values[node.id] = v
    if ir.rolled and callable(source):
        state.notes.append("rolled layers: the callable was given each Layer (rolled table bypassed)")
    if ir.rolled and not callable(source) and source in ROLLED_TOTALS:
        state.aggregation.append("rolled layers: sum over passes")
    if varying:
        state.notes.append(f"{len(varying)} rolled layer(s) vary across passes and are left unencoded")
    if box_skipped:
        state.notes.append(f"module boxes left unencoded: {name!r} does not add up over member ops")
    elif any(n.kind in BOX_KINDS for n in ir.nodes.values()):
        state.aggregation.append("module boxes: sum of member ops")
    if state.values:
        state.vmin = min(state.values.values())
        state.vmax = max(state.values.values())
    return state


def color_of(state: EncodingState, value: float, theme: "Theme") -> str:
    span = (state.vmax or 0.0) - (state.vmin or 0.0)
    t = 0.5 if span == 0 else (value - state.vmin) / span
    return default_ramp()(1.0 - t if theme.ramp_high_dark else t)


def size_factor(state: EncodingState, value: float) -> float:
    """Area factor in [1, 2]: smallest value at the typical size, largest at twice its area."""
    lo, hi = state.vmin or 0.0, state.vmax or 0.0
    if hi == lo:
        return 1.0
    if state.scale == "sqrt":
        f = lambda x: math.sqrt(max(x - lo, 0.0))  # noqa: E731
        t = f(value) / f(hi)
    else:
        t = (value - lo) / (hi - lo)
    return 1.0 + min(max(t, 0.0), 1.0)


def check_scale(size_by: Any, size_scale: Any) -> str:
    explicit = not isinstance(size_scale, _DefaultScale)
    if explicit and size_by is None:
        raise InvalidArgumentError("scale_requires_size_by", f"size_scale={size_scale!r} was given without size_by",
                                   remedy="pass size_by=... as well, or drop size_scale", size_scale=repr(size_scale))
    if size_scale not in SIZE_SCALES:
        raise InvalidArgumentError("encoding_scale_invalid", f"size_scale={size_scale!r} is not a size scale",
                                   remedy="use 'sqrt' (default) or 'linear'; log is rejected by design",
                                   size_scale=repr(size_scale))
    return str(size_scale)


def stack_groups(trace: "Trace", ir: "RenderIR", stack_by: Any) -> tuple[list[list[str]], str]:
    """Rank groups (node ids sharing an annotation value) and the caption saying what was used."""
    if ir.rolled:
        raise InvalidArgumentError("stack_by_requires_unrolled", "stack_by needs an unrolled drawing",
                                   remedy="draw with rolled=False", stack_by=repr(stack_by))
    if stack_by is True or stack_by == "auto":
        seq = [op.pass_number for op in trace if op.num_passes > 1]
        bad = next((i for i in range(1, len(seq)) if seq[i] < seq[i - 1]), None)
        if bad is not None:
            raise InvalidArgumentError(
                "stack_by_auto_underivable",
                "pass numbers of multi-pass ops are not non-decreasing in execution order, so a column would not mean one execution window",
                remedy="pass an explicit stack_by field or callable", position=bad)
        get = lambda op: op.pass_number if op.num_passes > 1 else None  # noqa: E731
        caption = "stacked by pass_number (auto: monotone over multi-pass ops)"
    elif callable(stack_by):
        name = _source_name(stack_by)
        get = lambda op: _call(stack_by, op, name)  # noqa: E731
        caption = f"stacked by {name}()"
    elif isinstance(stack_by, str):
        if not (hasattr(Op, stack_by) or any(stack_by in op.meta for op in trace)):
            raise InvalidArgumentError("encoding_source_invalid", f"stack_by={stack_by!r}: no such Op field or meta key",
                                       remedy="use an Op field such as pass_number, or a callable", source=stack_by)
        get = (lambda op: getattr(op, stack_by)) if hasattr(Op, stack_by) else (lambda op: op.meta.get(stack_by))
        caption = f"stacked by {stack_by}"
    else:
        raise InvalidArgumentError("encoding_source_invalid", f"stack_by={stack_by!r} is not True, 'auto', a field or a callable",
                                   remedy="use stack_by=True, a field name or a callable", source=repr(stack_by))
    groups: dict[Any, list[str]] = {}
    for node in ir.nodes.values():
        if node.kind in BOX_KINDS or not node.ops:  # boxes; container record nodes hold no op
            continue
        value = get(node.ops[0])
        if value is None:
            continue
        groups.setdefault(value, []).append(node.id)
    return [ids for ids in groups.values() if len(ids) > 1], caption
