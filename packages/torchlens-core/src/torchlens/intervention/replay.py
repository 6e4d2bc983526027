"""The replay engine: push edited values down the recorded graph without the model.

Only the downstream cone of the edited ops is recomputed, each op through the one per-op
replay engine (`torchlens.replay.engine.Replayer.run`: its recorded callable on its argument
template filled with the current values, with the backend's edit ops supplying
`replay_args` and `rng_state`). Multi-pass layers are keyed per pass.
Nothing is written to the trace until the whole cone has been computed.
"""

from __future__ import annotations

from typing import Any

from torchlens.errors import InterventionError
from torchlens.intervention.edits import Edit, HookContext, fire
from torchlens.replay.engine import Replayer, ReplayFailure


def _check_shape(op: Any, edit: Edit, before: Any, after: Any) -> None:
    if edit.allow_shape_change:
        return
    if tuple(getattr(before, "shape", ())) != tuple(getattr(after, "shape", ())):
        raise InterventionError("intervention_shape_changed",
                                f"{edit.name} changed {op.label} from {tuple(before.shape)} to {tuple(after.shape)}",
                                remedy="pass allow_shape_change=True to the helper if that is intended", label=op.label)


def apply_edits(trace: Any, op: Any, outs: tuple, edits: list[Edit], ops: Any, run_state: dict) -> tuple:
    """Apply each edit to every tensor slot of `outs`; returns the new slot tuple."""
    new = list(outs)
    for edit in edits:
        for i, v in enumerate(new):
            if v is None or not hasattr(v, "shape"):
                continue
            ctx = HookContext(op.label, op, trace, ops, run_state=run_state)
            out = fire(edit, v, ctx)  # a user callable gets a copy: the payload may be shared with other traces
            _check_shape(op, edit, v, out)
            new[i] = out
    return tuple(new)


def replay(trace: Any, edits: dict[str, list[Edit]], *, allow_changed_params: bool = False,
           report: dict | None = None) -> tuple[dict[str, tuple], list[str]]:
    """Compute the new payloads of every op in the cone of `edits` (op label -> edits).

    Returns (label -> new output slots, labels re-executed in order). Raises a typed error,
    with nothing mutated, when an op of the cone cannot be re-executed, or (before any op
    runs) when an op of the cone reads a parameter that changed since capture, unless
    `allow_changed_params`; `report["replayed_with_changed_params"]` then names them.
    """
    backend = trace._backend
    ops = backend.edit_ops()
    ev2label = {o.event_id: o.label for o in trace._ops.values()}
    order = sorted((trace._ops[label] for label in edits), key=lambda o: o.index)
    if not order:
        return {}, []
    from torchlens.io.opaque import refuse_opaque

    cone = _cone(trace, order[0].index, edits, ev2label)
    refuse_opaque(trace, cone)  # before any op or edit runs
    from torchlens.replay.preconditions import check_value_reads, refuse_unreplayable

    refuse_unreplayable(trace, cone)  # ops the capture marked as not re-executable (autograd.grad in the forward)
    from torchlens.replay.params import check_params_unchanged

    used_changed = check_params_unchanged(trace, cone, allow=allow_changed_params)  # before any op or edit runs
    if report is not None:
        report["replayed_with_changed_params"] = used_changed
    engine = Replayer(trace, ops)  # the one per-op replay engine; `ops` supplies replay_args / rng_state
    changed: dict[str, tuple] = {}
    reexecuted: list[str] = []
    run_state: dict = {}
    start = order[0].index
    all_ops = list(trace._ops.values())
    for op in all_ops[start:]:
        parent_changed = any(ev2label.get(eid) in changed for eid, _ in op.parent_slots)
        mine = edits.get(op.label)
        if not parent_changed and not mine:
            continue
        if parent_changed:
            outs = _reexecute(trace, op, ev2label, changed, engine)
            if op.kind == "op":
                reexecuted.append(op.label)
        else:
            outs = _payload(op)
        if mine:
            outs = apply_edits(trace, op, outs, mine, ops, run_state)
        check_value_reads(op, outs)  # a value the forward read into Python (a data-dependent shape) must hold
        changed[op.label] = outs
    return changed, reexecuted


def _cone(trace: Any, start: int, edits: dict, ev2label: dict) -> list[Any]:
    """The ops `replay` will re-execute (a parent changes), found without running any."""
    hit = set(edits)
    cone = []
    for op in list(trace._ops.values())[start:]:
        if any(ev2label.get(eid) in hit for eid, _ in op.parent_slots):
            hit.add(op.label)
            cone.append(op)
    return cone


def _payload_missing(label: str) -> InterventionError:
    return InterventionError("replay_payload_missing", f"replay needs the saved value of {label}",
                             remedy=f"capture with save='all' (or include {label!r} in save=), or use the rerun engine "
                             "(pass model= and inputs=)", label=label)


def _payload(op: Any) -> tuple:
    if not op.saved:
        raise _payload_missing(op.label)
    return op.outs


def _reexecute(trace: Any, op: Any, ev2label: dict, changed: dict, engine: Replayer) -> tuple:
    """Re-execute `op` on its edited parents through the replay engine (`torchlens.replay`)."""
    if op.kind == "output":
        eid, slot = op.parent_slots[0]
        return (changed[ev2label[eid]][slot],) if ev2label[eid] in changed else op.outs
    try:
        return engine.run(op, changed=changed)
    except ReplayFailure as f:
        if f.kind == "payload_missing":
            raise _payload_missing(f.label) from None
        if f.kind == "param_missing":
            raise InterventionError("replay_template_missing", f.detail, remedy="use the rerun engine (model= and inputs=)",
                                    label=op.label) from None
        raise InterventionError("replay_template_missing", f.detail,
                                remedy="use the rerun engine: trace.do(site, edit, model=model, inputs=x)",
                                label=op.label) from None
    except InterventionError:
        raise
    except Exception as exc:
        raise InterventionError("replay_execution_failed", f"re-executing {op.label} ({op.func_name}) raised "
                                f"{type(exc).__name__}: {exc}", remedy="use the rerun engine (model= and inputs=)",
                                label=op.label) from exc
