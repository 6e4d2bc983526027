"""Replay validation: re-execute every recorded op from its parents' saved payloads (and the
parameters it read) and compare with its own saved payload, bit for bit.

Each op's `func` binds its JAX primitive with the equation's parameters, so the replay is
that one primitive again. Random primitives replay exactly because their key is a recorded
input value. Constants and other sources are leaves (`constant_producer_leaf`). The first
op whose replay differs is named with a reason from `tl.backends.VALIDATION_REASONS`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from torchlens.backends.sdk import ArgRef, BackendUnsupportedError, ValidationStatus, param_values, refuse_opaque


def _host(backend: Any, value: Any) -> np.ndarray:
    return backend.host_copy(value)


def _equal(backend: Any, a: Any, b: Any) -> bool:
    ha, hb = _host(backend, a), _host(backend, b)
    return ha.shape == hb.shape and ha.dtype == hb.dtype and np.array_equal(ha, hb, equal_nan=True)


def _fail(op: Any, reason: str, decisions: list, counts: dict, detail: str) -> ValidationStatus:
    decisions.append({"op": op.label, "ok": False, "reason": reason, "phase": "replay", "detail": detail})
    counts[reason] = counts.get(reason, 0) + 1
    return ValidationStatus(False, op.label, reason, decisions, dict(counts), detail)


def validate_trace(backend: Any, trace: Any, ground_truth: Any = None) -> ValidationStatus:
    refuse_opaque(trace, trace.ops)  # a loaded op the primitive table could not re-bind, before any op runs
    _refuse_unreplayable(trace)
    by_event = {op.event_id: op for op in trace.ops}
    params = param_values(trace)
    decisions: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    for op in trace.ops:
        if op.kind == "constant":
            decisions.append({"op": op.label, "ok": True, "reason": "constant_producer_leaf", "phase": "replay"})
            counts["constant_producer_leaf"] = counts.get("constant_producer_leaf", 0) + 1
            continue
        if op.kind == "output":
            if op.parent_slots and op.saved:
                parent = by_event.get(op.parent_slots[0][0])
                if parent is None or not parent.saved:
                    return _fail(op, "parent_payload_missing", decisions, counts, "the output's producer has no payload")
                if not _equal(backend, parent.outs[op.parent_slots[0][1]], op.outs[0]):
                    return _fail(op, "replay_mismatch", decisions, counts, "the output differs from its producer")
            continue
        if op.kind != "op":
            continue
        if op.func is None:
            return _fail(op, "no_replayable_function", decisions, counts, "no callable was recorded")
        if not op.saved:
            return _fail(op, "parent_payload_missing", decisions, counts, "the op's own payload was not saved")
        parent_vals = []
        for pid, slot in op.parent_slots:
            parent = by_event.get(pid)
            if parent is None or not parent.saved:
                return _fail(op, "parent_payload_missing", decisions, counts,
                             f"parent event {pid} has no saved payload")
            parent_vals.append(parent.outs[slot])
        args = []
        for a in op.args_template or ():
            if isinstance(a, ArgRef):
                if a.address is not None:
                    if a.address not in params or params[a.address] is None:
                        return _fail(op, "parent_payload_missing", decisions, counts, f"parameter {a.address} has no value")
                    args.append(params[a.address])
                else:
                    args.append(_as_array(parent_vals[a.index]))
            else:
                args.append(a)
        try:
            got = op.func(*args)
        except Exception as exc:  # noqa: BLE001 - a replay that raises is a named failure
            return _fail(op, "replay_execution_exception", decisions, counts, f"{type(exc).__name__}: {exc}")
        got_outs = list(got) if getattr(op.func, "multiple_results", False) else [got]
        if len(got_outs) != len(op.outs):
            return _fail(op, "capture_inconsistent", decisions, counts, "replay produced a different number of outputs")
        for g, saved in zip(got_outs, op.outs):
            if not _equal(backend, g, saved):
                return _fail(op, "replay_mismatch", decisions, counts, "re-executing the op did not reproduce its output")
        decisions.append({"op": op.label, "ok": True, "reason": None, "phase": "replay"})
    if ground_truth is not None:
        truth = jax.tree_util.tree_leaves(ground_truth)
        outs = trace.output_ops
        if len(truth) != len(outs):
            op = outs[0] if outs else next(iter(trace.ops))
            return _fail(op, "capture_inconsistent", decisions, counts, "ground truth has a different number of outputs")
        for t, op in zip(truth, outs):
            if op.saved and not _equal(backend, t, op.outs[0]):
                return _fail(op, "replay_mismatch", decisions, counts, "the output differs from the ground truth")
    return ValidationStatus(True, decisions=decisions, reason_counts=dict(counts))


def _as_array(value: Any) -> Any:
    return value if isinstance(value, jax.Array) else jax.numpy.asarray(value)


def _refuse_unreplayable(trace: Any) -> None:
    """A loaded trace holds callable placeholders (artifacts never store code), and the jax
    backend cannot yet rebuild a primitive call from saved records: refuse, typed."""
    from torchlens_jax.interpret import PrimitiveCall, ScanSlice, ScanStack

    for op in trace.ops:
        if op.kind == "op" and op.func is not None and not isinstance(op.func, (PrimitiveCall, ScanSlice, ScanStack)):
            raise BackendUnsupportedError(
                "validation_replay_unsupported",
                f"op {op.label!r} carries no replayable JAX primitive (a loaded trace keeps no code)",
                remedy="validate the live trace returned by tl.trace, before saving it", label=op.label)
