"""The replay engine: push edited values down the recorded graph without the model.

Only the downstream cone of the edited ops is recomputed, by calling each op's recorded
callable on its argument template (`OpEvent.args_template`, `ArgRef`s standing for parents
and parameters) filled with the current values. Multi-pass layers are keyed per pass.
Nothing is written to the trace until the whole cone has been computed.
"""

from __future__ import annotations

from typing import Any

from torchlens.build.events import ArgRef, fill_template
from torchlens.errors import InterventionError
from torchlens.intervention.edits import Edit, HookContext, fire


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
    from torchlens.intervention.preconditions import check_value_reads, refuse_unreplayable

    refuse_unreplayable(trace, cone)  # ops the capture marked as not re-executable (autograd.grad in the forward)
    from torchlens.intervention.params import check_params_unchanged

    used_changed = check_params_unchanged(trace, cone, allow=allow_changed_params)  # before any op or edit runs
    if report is not None:
        report["replayed_with_changed_params"] = used_changed
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
            outs = _reexecute(trace, op, ev2label, changed, ops)
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


def _payload(op: Any) -> tuple:
    if not op.saved:
        raise InterventionError("replay_payload_missing", f"replay needs the saved value of {op.label}",
                                remedy=f"capture with save='all' (or include {op.label!r} in save=), or use the rerun engine "
                                "(pass model= and inputs=)", label=op.label)
    return op.outs


def _value(trace: Any, ref: ArgRef, op: Any, ev2label: dict, changed: dict) -> Any:
    if ref.address is not None:
        rec = trace._params.get(ref.address) or trace._buffers.get(ref.address)
        if rec is None or rec.value is None:
            raise InterventionError("replay_template_missing", f"{op.label} reads {ref.address}, which the trace does not hold",
                                    remedy="use the rerun engine (model= and inputs=)", label=op.label)
        return rec.value
    eid, slot = op.parent_slots[ref.index]
    label = ev2label[eid]
    outs = changed.get(label)
    if outs is None:
        outs = _payload(trace._ops[label])
    return outs[slot]


def _reexecute(trace: Any, op: Any, ev2label: dict, changed: dict, ops: Any) -> tuple:
    if op.kind == "output":
        eid, slot = op.parent_slots[0]
        return (changed[ev2label[eid]][slot],) if ev2label[eid] in changed else op.outs
    if op.func is None or op.args_template is None:
        raise InterventionError("replay_template_missing", f"{op.label} ({op.func_name}) has no recorded callable and arguments",
                                remedy="use the rerun engine: trace.do(site, edit, model=model, inputs=x)", label=op.label)

    def fill(ref: ArgRef) -> Any:
        v = _value(trace, ref, op, ev2label, changed)
        return v

    args = fill_template(op.args_template, fill)
    kwargs = fill_template(op.kwargs_template or {}, fill)
    args, kwargs = ops.replay_args(op, tuple(args), dict(kwargs))  # the backend knows which arguments an op writes into
    state = op.meta.get("rng_state")
    try:
        with ops.rng_state(state):
            out = op.func(*args, **kwargs)
    except InterventionError:
        raise
    except Exception as exc:
        raise InterventionError("replay_execution_failed", f"re-executing {op.label} ({op.func_name}) raised "
                                f"{type(exc).__name__}: {exc}", remedy="use the rerun engine (model= and inputs=)",
                                label=op.label) from exc
    if op.func_name == "__setitem__" or (op.is_inplace and out is None):
        out = args[0]
    if op.multi_output:
        return tuple(out)
    return (out,)
