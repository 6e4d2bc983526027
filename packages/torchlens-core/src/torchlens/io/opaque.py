"""Opaque ops: the loaded ops that replay refuses, checked before anything runs.

An artifact names callables, it never stores them. On load the backend re-binds each op's
saved name through its closed callable table (`tl.load` -> `rebuild._rebind_callables`);
an op whose name the table does not hold keeps a `tl.types.CallablePlaceholder` and is
*opaque*. An op is also opaque when a value its replay would pass in is a placeholder (a
`$callable` cell in its argument templates, in a parameter or buffer it reads, or in a
parent output it reads): a replay could only hand that placeholder to framework code.

Every verb that re-executes recorded ops (`validate_forward_pass`, the replay engine of
`Trace.do`) calls `refuse_opaque` on the ops it is about to run, first, so a hostile or
foreign name refuses with `opaque_op_not_replayable` and no op, edit or hook has run.
"""

from __future__ import annotations

from typing import Any, Iterable

from torchlens.build.events import ArgRef
from torchlens.errors import ArtifactError
from torchlens.types import CallablePlaceholder

#: How deep a template is searched (decoded cells are at most ~66 levels deep).
_MAX_DEPTH = 100


def placeholder_in(value: Any, depth: int = 0) -> CallablePlaceholder | None:
    """The first callable placeholder inside a decoded value (containers searched), or None."""
    if isinstance(value, CallablePlaceholder):
        return value
    if depth > _MAX_DEPTH:
        return None
    t = type(value)
    if t in (tuple, list):
        items: Iterable[Any] = value
    elif t is dict:
        items = [*value.keys(), *value.values()]
    elif t is slice:
        items = (value.start, value.stop, value.step)
    else:
        return None
    for item in items:
        found = placeholder_in(item, depth + 1)
        if found is not None:
            return found
    return None


def _refs(template: Any, depth: int = 0) -> Iterable[ArgRef]:
    if isinstance(template, ArgRef):
        yield template
    elif depth <= _MAX_DEPTH and type(template) in (tuple, list):
        for t in template:
            yield from _refs(t, depth + 1)
    elif depth <= _MAX_DEPTH and type(template) is dict:
        for t in template.values():
            yield from _refs(t, depth + 1)


def opaque_reason(trace: Any, op: Any, by_event: dict[int, Any] | None = None) -> tuple[str, CallablePlaceholder] | None:
    """(where, placeholder) when `op` cannot be replayed because a callable was not re-bound.
    Every kind is checked (a source op has no callable and no template, so it never is)."""
    if isinstance(op.func, CallablePlaceholder):
        return "func", op.func
    for where, template in (("args_template", op.args_template), ("kwargs_template", op.kwargs_template)):
        found = placeholder_in(template)
        if found is not None:
            return where, found
    for ref in [*_refs(op.args_template), *_refs(op.kwargs_template)]:
        if ref.address is not None:
            rec = trace._params.get(ref.address) or trace._buffers.get(ref.address)
            value = None if rec is None else rec.value
            where = f"value of {ref.address}"
        else:
            if not (0 <= ref.index < len(op.parent_slots)):
                continue  # a malformed reference is the replay's own typed failure
            eid, slot = op.parent_slots[ref.index]
            parent = (by_event or {}).get(eid)
            outs = getattr(parent, "_outputs", None) or ()
            value = outs[slot] if 0 <= slot < len(outs) else None
            where = f"output {slot} of {getattr(parent, 'label', eid)}"
        found = placeholder_in(value)
        if found is not None:
            return where, found
    return None


def refuse_opaque(trace: Any, ops: Iterable[Any]) -> None:
    """Raise `opaque_op_not_replayable` for the first opaque op among `ops` (nothing else runs)."""
    by_event = {o.event_id: o for o in trace._ops.values()}
    for op in ops:
        found = opaque_reason(trace, op, by_event)
        if found is None:
            continue
        where, ph = found
        raise ArtifactError(
            "opaque_op_not_replayable",
            f"{op.label} ({op.func_name}) is opaque: its {where} is the saved name {ph.qualname[:120]!r}, which the "
            f"{trace.provenance.backend} backend's callable table does not hold, so it cannot be replayed",
            remedy="capture the trace again from the live model (a loaded artifact re-binds only the backend's own "
                   "ops, never code it names); see docs/guides/security.md",
            label=op.label, qualname=ph.qualname, at=ph.at or where)


__all__ = ["placeholder_in", "opaque_reason", "refuse_opaque"]
