"""Reduce and discard: `tl.trace(model, x, save="stats")` and `tl.stats.site_stats(trace)`.

Every op's out is folded into one `tl.stats.RunningStats` (a 16-slot float64 vector) and the
payload is released, so the trace keeps the graph and these summaries and no activations.
Every output slot of an op that reads as a real numeric array is folded (a multi-output op
folds all its slots into one summary); a slot that is not numeric (None, a string, a complex
tensor) folds nothing, so such an op's summary has `count == 0` and `numel == 0`.

How: core captures with `save="all"` through the backend and offers it the fold
(`torchlens.backends.sdk_stats`). A backend that takes the offer (torch) folds each op's out
into its 16-slot vector as the op runs and keeps no payload: peak memory is the forward's own
plus one vector per op. Any other backend (and a capture with `intervene=`) keeps payloads and
core folds and releases them before `tl.trace` returns: peak memory that of a `save="all"`
capture. Which one ran is `trace.provenance.extra["stats_fold"]` (`"forward"` or
`"after_capture"`); `trace.options.save` reads `"stats"`. What the trace keeps afterwards is one
16-slot vector per op. Payload reads raise `activation_reduced_to_stats`; replaying, editing,
forking, re-running or validating the trace raises `stats_capture_not_replayable`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchlens.errors import InvalidArgumentError, PayloadUnavailableError
from torchlens.stats.moments import RunningStats

#: the save= value that selects reduce-and-discard (tl.trace only)
SAVE_STATS = "stats"


def is_stats_save(save: Any) -> bool:
    return isinstance(save, str) and save == SAVE_STATS


def _outs_refused(self: Any) -> tuple[Any, ...]:
    raise PayloadUnavailableError(
        "activation_reduced_to_stats",
        f"op {self.label!r} was captured with save='stats': its out was reduced to a RunningStats and discarded",
        remedy=f"read tl.stats.site_stats(trace)[{self.label!r}], or capture again with save='all' "
               f"or save=[{self.label!r}] for the payload",
        label=self.label)


def _not_replayable(verb: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        "stats_capture_not_replayable",
        f"{verb} needs saved payloads, and a save='stats' trace kept only per-op RunningStats",
        remedy="capture again with save='all' (or a selector) to replay, edit, re-run or validate", verb=verb)


def _refusing(verb: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _not_replayable(verb)

    method.__name__ = verb.rsplit(".", 1)[-1]
    return method


def _stats_copy(self: Any, name: str | None = None) -> Any:
    new = type(self).__mro__[1].copy(self, name)
    new.__class__ = type(self)
    new._site_stats = {k: v.copy() for k, v in self._site_stats.items()}
    return new


# The reduced classes are made from the classes of the records given (this layer imports no
# record layer): ReducedOp refuses payload reads, StatsTrace refuses replay and validation.
_REDUCED: dict[type, type] = {}


def _reduced_class(base: type, kind: str) -> type:
    cls = _REDUCED.get(base)
    if cls is None:
        if kind == "op":
            ns = {"__slots__": (), "outs": property(_outs_refused), "_tl_reduced_to_stats": True,
                  "__doc__": "An op whose payload was folded into a RunningStats and released."}
            cls = type("ReducedOp", (base,), ns)
        else:
            ns = {"_tl_stats_capture": True, "copy": _stats_copy,
                  "__doc__": "A trace captured with save='stats': graph and per-op RunningStats, no payloads."}
            ns.update({v.rsplit(".", 1)[-1]: _refusing(v) for v in
                       ("trace.validate_forward_pass", "trace.do", "trace.fork", "trace.run")})
            cls = type("StatsTrace", (base,), ns)
        cls.__module__ = __name__
        _REDUCED[base] = cls
    return cls


def is_stats_trace(trace: Any) -> bool:
    return bool(getattr(type(trace), "_tl_stats_capture", False))


def _fold(rs: RunningStats, proto: Any, value: Any) -> None:
    if value is None or isinstance(value, (str, bytes)):
        return
    try:
        host = proto.host_copy(value) if proto is not None else value
        a = np.asarray(host)
    except Exception:  # noqa: BLE001 - a slot the backend cannot bring to host is not numeric data
        return
    if a.dtype == object or np.iscomplexobj(a) or not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
        return
    rs.update(a)


def _merge_folded(rs: RunningStats, proto: Any, folded: Any, label: str) -> None:
    """Merge a backend's during-forward summary (a `FoldedStats`) into `rs`."""
    v = np.asarray(proto.host_copy(folded.vector) if proto is not None else folded.vector, dtype=np.float64)
    if v.shape != (16,):
        from torchlens.errors import PluginError

        raise PluginError("backend_stats_fold_invalid",
                          f"the backend folded op {label!r} into a {v.shape} array, not the 16-slot stats vector",
                          remedy="the backend's save='stats' fold must return torchlens.backends.sdk.FoldedStats of a "
                                 "16-vector laid out as STATS_FOLD_SLOTS (see torchlens.backends.sdk_stats)",
                          label=label, shape=list(v.shape))
    rs._slots = RunningStats._combine(rs._slots, v)


def reduce_trace(trace: Any, offer: Any = None) -> Any:
    """Fold every op's outs into a RunningStats, release the payloads, and turn `trace` into
    a StatsTrace (in place; returned for convenience). `offer`: core's
    `torchlens.backends.sdk_stats.StatsFoldOffer` for this capture (None: none was made); when a
    backend took it (`offer.mode == "forward"`) the saved slots hold `offer.folded_type`
    summaries, and a payload the backend saved anyway is folded here and its op named in
    `provenance.extra["stats_fold_late"]`."""
    mode = getattr(offer, "mode", "after_capture")
    folded = mode == "forward"
    FoldedStats = getattr(offer, "folded_type", None)
    proto = trace._backend
    stats: dict[str, RunningStats] = {}
    late: list[str] = []
    for op in trace._ops.values():
        rs = RunningStats()
        if op.saved:
            for v in op._outputs:
                if FoldedStats is not None and type(v) is FoldedStats:
                    _merge_folded(rs, proto, v, op.label)
                elif v is not None:
                    if folded:
                        late.append(op.label)
                    _fold(rs, proto, v)
        stats[op.label] = rs
        op.saved = False
        op._outputs = tuple(None for _ in op._outputs)
        op.__class__ = _reduced_class(type(op), "op")
    trace.__class__ = _reduced_class(type(trace), "trace")
    trace._site_stats = stats
    _note_fold(trace, mode, late)
    return trace


def _note_fold(trace: Any, mode: str, late: list[str]) -> None:
    """The trace facts: how the fold ran (`provenance.extra["stats_fold"]`) and `options.save`."""
    import dataclasses

    prov = getattr(trace, "provenance", None)
    if prov is not None and isinstance(getattr(prov, "extra", None), dict):
        prov.extra["stats_fold"] = mode
        if late:
            prov.extra["stats_fold_late"] = late
    opts = getattr(trace, "options", None)
    if dataclasses.is_dataclass(opts) and getattr(opts, "save", None) == "all":
        trace.options = dataclasses.replace(opts, save=SAVE_STATS)


def site_stats(trace: Any) -> dict[str, RunningStats]:
    """{op label: RunningStats} of a `tl.trace(..., save="stats")` capture, in execution order
    (copies: folding into them leaves the trace alone)."""
    if not is_stats_trace(trace):
        raise InvalidArgumentError("stats_capture_required",
                                   f"site_stats() takes a trace captured with save='stats', not a {type(trace).__name__}"
                                   + (" captured with payloads" if hasattr(trace, "_ops") else ""),
                                   remedy="trace = tl.trace(model, x, save='stats'); tl.stats.site_stats(trace)")
    return {label: rs.copy() for label, rs in trace._site_stats.items()}
