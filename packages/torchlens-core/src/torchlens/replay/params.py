"""Parameter stamps: notice a parameter that changed after the capture that recorded it.

Replay re-executes recorded ops with the trace's parameter records, and those hold the live
parameter objects. After an optimizer step (or `load_state_dict`, an in-place write under
`no_grad`, `param.data = t`) a replay would silently mix the new weights with the old
activations. So every capture stamps each parameter through its backend's edit ops
(`param_stamp(value)`: for torch the version counter, the storage pointer, shape, dtype and
device), and every replay path compares the stamps of the parameters its cone reads before
recomputing anything.

What a stamp cannot see: an in-place write through an alias that has its own version
counter (`param.data.mul_(...)`, a numpy or raw-storage view). A replaced parameter object
(`module.weight = nn.Parameter(t)`) is not a change here: the recorded argument templates
keep the captured object, so replay keeps using it.
"""

from __future__ import annotations

from typing import Any, Iterable

from torchlens.backends.protocol import BackendProtocol, SupportsInterventions, supports


class ParamStamps:
    """address -> the parameter value captured and its stamp. Copies made by pickling
    re-stamp their own (new) tensors, so an unpickled trace starts clean."""

    def __init__(self, ops: Any, values: dict[str, Any]) -> None:
        self._ops = ops
        self._values = values
        self._stamps = {a: ops.param_stamp(v) for a, v in values.items()}

    def changed(self, addresses: Iterable[str]) -> list[str]:
        """The addresses among `addresses` whose value differs from its capture stamp."""
        out = []
        for a in addresses:
            stamp = self._stamps.get(a)
            if stamp is not None and self._ops.param_stamp(self._values[a]) != stamp:
                out.append(a)
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {"ops": self._ops, "values": self._values}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["ops"], state["values"])


#: id(backend object) -> (weak reference to it, whether it is a `BackendProtocol`): the runtime
#: protocol check reads every member (about 25 µs) and runs once per capture otherwise
_IS_BACKEND: dict[int, tuple[Any, bool]] = {}


def _is_backend(backend: Any) -> bool:
    import weakref

    hit = _IS_BACKEND.get(id(backend))
    if hit is not None and hit[0]() is backend:
        return hit[1]
    ok = isinstance(backend, BackendProtocol)
    key = id(backend)
    try:
        ref = weakref.ref(backend, lambda _r, key=key: _IS_BACKEND.pop(key, None))
    except TypeError:  # not weak-referenceable (None, a plain object without a weakref slot)
        return ok
    _IS_BACKEND[key] = (ref, ok)
    return ok


def stamp_params(trace: Any) -> None:
    """Stamp every parameter a fresh trace holds (called once, when the trace is built).
    A backend without interventions (no edit ops) is not checked; a value its `param_stamp`
    cannot stamp (None) is not either."""
    backend = trace._backend
    if not _is_backend(backend) or not supports(backend, SupportsInterventions):
        return  # no backend, a partial one (hand-built example traces) or one without edit ops
    ops = backend.edit_ops()  # an EditOps (checked at registration): param_stamp is there
    values = {a: p.value for a, p in trace._params.items() if p.value is not None}
    trace._param_stamps = ParamStamps(ops, values)


def changed_params(trace: Any, addresses: Iterable[str]) -> list[str]:
    """Addresses (of `addresses`) whose parameter changed since `trace` was captured."""
    stamps = trace._param_stamps
    if stamps is None:
        return []
    return stamps.changed(addresses)


def param_addresses(op: Any) -> list[str]:
    """The parameter addresses an op's argument template reads, in template order."""
    from torchlens.build.events import ArgRef

    found: list[str] = []

    def walk(t: Any) -> None:
        if isinstance(t, ArgRef):
            if t.address is not None and t.address not in found:
                found.append(t.address)
        elif type(t) in (tuple, list):
            for x in t:
                walk(x)
        elif type(t) is dict:
            for x in t.values():
                walk(x)

    walk(op.args_template)
    walk(op.kwargs_template or {})
    return found


def check_params_unchanged(trace: Any, ops: Iterable[Any], *, allow: bool) -> list[str]:
    """Refuse (`replay_param_changed_since_capture`) when an op of `ops` reads a parameter
    that changed since capture; with `allow=True` return the changed addresses instead."""
    from torchlens.errors import ReplayPreconditionError

    if trace._param_stamps is None:
        return []
    seen: list[str] = []
    for op in ops:
        for addr in changed_params(trace, [a for a in param_addresses(op) if a in trace._params]):
            if addr in seen:
                continue
            if not allow:
                raise ReplayPreconditionError(
                    "replay_param_changed_since_capture",
                    f"{op.label} reads parameter {addr!r}, which changed since this trace was captured; replay would mix "
                    "the new value with the recorded activations",
                    remedy="capture again (tl.trace(model, x)), use the rerun engine (model=, inputs=), or pass "
                    "intervention=InterventionOptions(allow_changed_params=True) to replay with the new values",
                    param=addr, op=op.label)
            seen.append(addr)
    return sorted(seen)
