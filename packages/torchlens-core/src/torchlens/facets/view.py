"""`module.facets` / `module.calls[n].facets`: the one named access surface of a module call.

A `FacetView` runs the trace's registry snapshot's matching recipes once for its call and
merges them with the structural output names (`out`, or `out0`, `out1`, ... per returned
tensor). Item access is canonical; attribute access is sugar for identifiers that do not
collide with the view's methods. Only facets readable now appear in `keys()` / `in`;
`declared()` reports every name with its status (available_now, structurally_absent,
needs_capture, declared_not_produced).

A `Facet` is tensor-like: `.value` applies the spec's chain to the home value lazily, and
framework functions (`torch.equal(facet, x)`) and numpy see the value through
`__torch_function__` / `__array__`, without this module importing a framework.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterator

from torchlens.errors import FacetError, FacetLookupError, FacetWarning, MissingFacetError
from torchlens.facets.authoring import running_for
from torchlens.facets.spec import FacetSpec

STATUSES: tuple[str, ...] = ("available_now", "structurally_absent", "needs_capture", "declared_not_produced")
#: `trace.annotations[INVALIDATED]` = {module address: facet names}: facets an edit made stale on
#: this trace (the mechinterp kit's patch_head sets it on its patched rerun: the head edit was
#: lowered to another op, so z / pattern / result of that module do not hold the run's values)
INVALIDATED = "mi_invalidated_facets"


def invalidated_facets(trace: Any, address: str) -> frozenset[str]:
    """The facet names `trace.annotations["mi_invalidated_facets"]` marks stale for `address`."""
    from collections.abc import Iterable, Mapping

    marks = (getattr(trace, "annotations", None) or {}).get(INVALIDATED)
    if marks is None:
        return frozenset()
    if not isinstance(marks, Mapping):
        raise FacetError("facet_annotation_invalid", f"trace.annotations[{INVALIDATED!r}] is a "
                         f"{type(marks).__name__}, not a mapping of module address -> facet names",
                         remedy=f"set trace.annotations[{INVALIDATED!r}] = {{address: ('z', ...)}}", key=INVALIDATED)
    names = marks.get(address)
    if names is None:
        return frozenset()
    names = (names,) if isinstance(names, str) else names
    if not isinstance(names, Iterable) or not all(isinstance(n, str) for n in names):
        raise FacetError("facet_annotation_invalid", f"trace.annotations[{INVALIDATED!r}][{address!r}] is not a "
                         "collection of facet names", remedy="give a tuple of facet names, e.g. ('z', 'result')",
                         key=INVALIDATED, module=address)
    return frozenset(names)


@dataclass(frozen=True)
class Entry:
    """One facet name of one call: its spec (None when absent), status and reason."""

    name: str
    spec: FacetSpec | None
    status: str
    reason: str = ""
    recipe_id: str = ""
    kind: str = "recipe"  # "structural" | "position" (a named leaf's positional name) | "recipe" | "alias"


# values -----------------------------------------------------------------------------------------
def home_value(trace: Any, spec: FacetSpec) -> Any:
    """The full home value a spec reads from."""
    if spec.home_kind == "computed":
        return spec.compute(trace)
    if spec.home_kind == "parameter":
        return trace._params[spec.home].value
    op = trace._ops[spec.home]
    outs = op.outs
    return outs[spec.slot or 0]


def value_of(trace: Any, spec: FacetSpec) -> Any:
    """Read a spec on a trace: its chain applied to its home value."""
    return spec.read(home_value(trace, spec)) if spec.home_kind != "computed" else spec.compute(trace)


def home_grad(trace: Any, spec: FacetSpec) -> Any:
    op = trace._ops[spec.home]
    grads = op.grads
    if grads is None:
        return None
    return grads[spec.slot or 0]


def missing_inputs(trace: Any, spec: FacetSpec) -> list[str]:
    """Op labels the spec reads whose payload the capture did not keep."""
    if spec.home_kind == "parameter":
        p = trace._params.get(spec.home)
        return [] if p is not None and p.value is not None else [spec.home]
    labels = spec.inputs if spec.home_kind == "computed" else (spec.home,)
    return [lab for lab in labels if lab not in trace._ops or not trace._ops[lab].saved]


class MissingGrad:
    """What `facet.grad` returns when no gradient can be served: falsy, with `reason` and
    `recapture`; using it as a tensor raises `facet_grad_unavailable`."""

    __slots__ = ("reason", "recapture", "facet")

    def __init__(self, facet: str, reason: str, recapture: str) -> None:
        self.facet, self.reason, self.recapture = facet, reason, recapture

    def __bool__(self) -> bool:
        return False

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise FacetError("facet_grad_unavailable", f"facet {self.facet!r} has no gradient: {self.reason}",
                         remedy=self.recapture, facet=self.facet)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        for a in list(args) + list((kwargs or {}).values()):
            if isinstance(a, MissingGrad):
                a._refuse()
        return NotImplemented

    def __array__(self, *a: Any, **k: Any) -> Any:
        self._refuse()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse()

    __add__ = __radd__ = __mul__ = __rmul__ = __sub__ = __rsub__ = __truediv__ = __matmul__ = __getitem__ = _refuse

    def __repr__(self) -> str:
        return f"<MissingGrad {self.facet}: {self.reason}; {self.recapture}>"


def _unwrap(x: Any) -> Any:
    if isinstance(x, Facet):
        return x.value
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(i) for i in x)
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _binop(name: str) -> Any:
    def op(self: "Facet", other: Any) -> Any:
        return getattr(self.value, name)(_unwrap(other))

    op.__name__ = name
    return op


class Facet:
    """One facet of one module call: tensor-like, lazy (`.value` reads the home each time)."""

    __slots__ = ("name", "spec", "_trace", "address")

    def __init__(self, name: str, spec: FacetSpec, trace: Any, address: str) -> None:
        self.name, self.spec, self._trace, self.address = name, spec, trace, address

    @property
    def value(self) -> Any:
        return self.spec.read(home_value(self._trace, self.spec))

    @property
    def grad(self) -> Any:
        spec = self.spec
        if spec.home_kind == "parameter":
            return MissingGrad(self.name, "parameter facets expose no gradient in this release",
                               f"read trace.params[{spec.home!r}] and the framework's own parameter .grad")
        if not spec.flags["grad"]:
            return MissingGrad(self.name, f"a {spec.capability} facet is not grad-capable",
                               "read the gradient of an op-anchored structural facet")
        g = home_grad(self._trace, spec)
        if g is None:
            how = ("capture with capture=tl.options.CaptureOptions(backward_ready=True, save_grads=True) and call "
                   "trace.backward(loss)")
            return MissingGrad(self.name, f"op {spec.home!r} has no saved gradient: {how}", how)
        return spec.read(g)

    @property
    def capability(self) -> str:
        return self.spec.capability

    @property
    def shape(self) -> Any:
        return tuple(self.value.shape)

    @property
    def dtype(self) -> Any:
        return self.value.dtype

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        return func(*_unwrap(tuple(args)), **_unwrap(dict(kwargs or {})))

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        import numpy as np

        v = self.value
        v = v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)
        return v if dtype is None else v.astype(dtype)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.value, name)

    def __getitem__(self, key: Any) -> Any:
        return self.value[key]

    def __len__(self) -> int:
        return len(self.value)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.value)

    __add__, __radd__ = _binop("__add__"), _binop("__radd__")
    __sub__, __rsub__ = _binop("__sub__"), _binop("__rsub__")
    __mul__, __rmul__ = _binop("__mul__"), _binop("__rmul__")
    __truediv__, __rtruediv__ = _binop("__truediv__"), _binop("__rtruediv__")
    __matmul__, __rmatmul__ = _binop("__matmul__"), _binop("__rmatmul__")
    __eq__, __ne__ = _binop("__eq__"), _binop("__ne__")
    __lt__, __le__, __gt__, __ge__ = _binop("__lt__"), _binop("__le__"), _binop("__gt__"), _binop("__ge__")
    __hash__ = object.__hash__

    def __neg__(self) -> Any:
        return -self.value

    def __repr__(self) -> str:
        return f"<Facet {self.address}.{self.name}: {self.spec.describe()}>"


# the view -----------------------------------------------------------------------------------------
def structural_names(n: int) -> list[str]:
    return ["out"] if n == 1 else [f"out{i}" for i in range(n)]


def structural_rows(call: Any) -> list[tuple[str, str, int | None, str]]:
    """(name, op label, slot, kind) per structural output of `call`. Names come from the
    container structure the backend recorded at capture (`module_output_names` annotation:
    `values`/`indices`, `h_n`/`c_n`, `out1.0`); kind "position" marks the positional name of a
    named leaf (item access and typed paths resolve it; keys() lists the name). Without a
    record: `out`, or `out0`, `out1`, ... in return order."""
    ann = getattr(call._trace, "annotations", None) or {}
    named = (ann.get("module_output_names") or {}).get(call.label)
    if not named:
        slots = call.output_slots
        return [(n, label, slot, "structural") for n, (label, slot) in zip(structural_names(len(slots)), slots)]
    rows: list[tuple[str, str, int | None, str]] = []
    seen: set[str] = set()
    for name, pos, label, slot in named:
        slot = None if slot is None else int(slot)
        if name not in seen:
            rows.append((str(name), str(label), slot, "structural"))
            seen.add(name)
    for name, pos, label, slot in named:
        if pos not in seen:
            rows.append((str(pos), str(label), None if slot is None else int(slot), "position"))
            seen.add(pos)
    return rows


def _status(trace: Any, spec: FacetSpec) -> tuple[str, str]:
    miss = missing_inputs(trace, spec)
    if miss:
        return "needs_capture", (f"needs the payload of {', '.join(miss[:4])}: capture with save='all' or "
                                 f"save=[{', '.join(repr(m) for m in miss[:4])}]")
    if spec.needs:
        return "needs_capture", spec.needs
    return "available_now", ""


def call_entries(call: Any) -> dict[str, Entry]:
    """Every facet name of `call` with its status, computed once per trace and call."""
    from torchlens.facets.registry import snapshot_for, state_for

    trace = call._trace
    snap = snapshot_for(trace)
    cache = state_for(trace).setdefault("entries", {})
    hit = cache.get(call.label)
    if hit is not None:
        return hit
    module = trace._modules[call.address]
    entries: dict[str, Entry] = {}
    for name, label, slot, kind in structural_rows(call):
        spec = FacetSpec(home_kind="module_output", home=label, slot=slot, address=call.address, call=call.call,
                         recipe_id="structural")
        status, reason = _status(trace, spec)
        entries[name] = Entry(name, spec, status, reason, "structural", kind)
    winners: dict[str, tuple[tuple, Any]] = {}
    with running_for(call):
        for rec in snap.matching(module):
            produced = rec.fn(module)
            if produced is None:
                continue
            if not isinstance(produced, dict):
                raise FacetError("facet_recipe_invalid", f"recipe {rec.recipe_id!r} returned {type(produced).__name__}, "
                                 "not a dict of facet name -> FacetSpec", remedy="return {name: FacetSpec or None}",
                                 recipe=rec.recipe_id)
            names = list(dict.fromkeys(list(rec.facets) + list(produced)))
            for name in names:
                spec = produced.get(name)
                if spec is not None and not isinstance(spec, FacetSpec):
                    raise FacetError("facet_recipe_invalid", f"recipe {rec.recipe_id!r} gave {name!r} as "
                                     f"{type(spec).__name__}, not a FacetSpec", remedy="return FacetSpec values",
                                     recipe=rec.recipe_id, facet=name)
                prev = winners.get(name)
                if prev is not None:
                    prev_rank, prev_rec = prev[0], prev[2]
                    if prev_rank[:2] == rec.rank()[:2] and prev_rec.recipe_id != rec.recipe_id:
                        warnings.warn(FacetWarning("facet_recipe_collision", f"recipes {prev_rec.recipe_id!r} and "
                                                   f"{rec.recipe_id!r} both declare {name!r} for {module.address!r} at "
                                                   f"tier {rec.tier}", remedy="register one of them with a more "
                                                   "specific matcher", facet=name, module=module.address), stacklevel=4)
                    continue  # matching() is in precedence order: the first one wins
                winners[name] = (rec.rank(), spec, rec, name in produced)
    for name, (_, spec, rec, produced) in winners.items():
        if spec is None:
            status = "structurally_absent" if produced else "declared_not_produced"
            entries[name] = Entry(name, None, status, f"recipe {rec.recipe_id} found no such value in this module",
                                  rec.recipe_id)
            continue
        if spec.call is None and spec.home_kind != "parameter":
            spec = FacetSpec(**{**spec.__dict__, "call": call.call})
        status, reason = _status(trace, spec)
        entries[name] = Entry(name, spec, status, reason, rec.recipe_id)
    cache[call.label] = entries
    return entries


class FacetView:
    """The named facets of one module call (`module.facets`, `module.calls[n].facets`)."""

    __slots__ = ("_call",)

    def __init__(self, call: Any) -> None:
        object.__setattr__(self, "_call", call)

    @property
    def _entries(self) -> dict[str, Entry]:
        from torchlens.facets.aliases import alias_entries

        entries = call_entries(self._call)
        aliases = alias_entries(entries)
        return {**entries, **aliases} if aliases else entries

    @property
    def address(self) -> str:
        return self._call.address

    def _invalid(self, name: str, entry: Entry | None) -> bool:
        """Whether `name` (or the native facet an alias names) is marked stale on this trace."""
        from torchlens.facets.aliases import TRANSFORMER_LENS_ALIASES

        stale = invalidated_facets(self._call._trace, self.address)
        if not stale:
            return False
        native = TRANSFORMER_LENS_ALIASES.get(name, name) if entry is not None and entry.kind == "alias" else name
        return name in stale or native in stale

    def _refuse_invalid(self, name: str) -> FacetLookupError:
        return FacetLookupError("facet_invalidated", f"facet {name!r} of {self.address!r} does not hold this trace's "
                                f"run: an edit marked it stale (trace.annotations[{INVALIDATED!r}])",
                                remedy="read the op the edit was written to, or a downstream facet; recompute the "
                                "value from the edit", facet=name, module=self.address)

    def keys(self) -> list[str]:
        return [n for n, e in self._entries.items()
                if e.status == "available_now" and e.kind != "position" and not self._invalid(n, e)]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __contains__(self, name: object) -> bool:
        e = self._entries.get(name) if isinstance(name, str) else None
        return e is not None and e.status == "available_now" and not self._invalid(name, e)

    def has(self, name: str) -> bool:
        return name in self

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def spec(self, name: str) -> FacetSpec:
        """The FacetSpec behind `name` (refuses like item access)."""
        return self[name].spec

    def declared(self) -> dict[str, str]:
        """Every structural and declared recipe facet with its status (provisional)."""
        return {n: e.status for n, e in self._entries.items() if e.kind != "position"}

    def reasons(self) -> dict[str, str]:
        out = {n: e.reason for n, e in self._entries.items() if e.reason}
        for n, e in self._entries.items():
            if self._invalid(n, e):
                out[n] = f"invalidated: an edit marked it stale (trace.annotations[{INVALIDATED!r}])"
        return out

    def __getitem__(self, name: Any) -> Facet:
        if isinstance(name, (tuple, list)):
            name = _path_name(name, self.address)
        e = self._entries.get(name)
        if e is None:
            known = ", ".join(self.keys()[:12])
            raise FacetLookupError("facet_unknown", f"module {self.address!r} has no facet {name!r}",
                                   remedy=f"available now: {known or 'none'}; see .declared()", facet=name,
                                   module=self.address)
        if e.status in ("structurally_absent", "declared_not_produced"):
            raise FacetLookupError("facet_structurally_absent", f"facet {name!r} is absent in {self.address!r}: "
                                   f"{e.reason}", remedy="read another facet; see .declared()", facet=name,
                                   module=self.address)
        if self._invalid(name, e):
            raise self._refuse_invalid(name)
        if e.status == "needs_capture":
            raise MissingFacetError("facet_needs_capture", f"facet {name!r} of {self.address!r} is not readable in this "
                                    f"capture", remedy=e.reason, facet=name, module=self.address)
        return Facet(name, e.spec, self._call._trace, self.address)

    def __getattr__(self, name: str) -> Facet:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self[name]
        except FacetLookupError as exc:
            if exc.code == "facet_unknown":
                raise AttributeError(f"facet view of {self.address!r} has no facet {name!r}") from exc
            raise

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("facet views are read-only; edit facets with trace.do(tl.facet(name), edit)")

    def head(self, index: int) -> "HeadView":
        """Head `index` of this attention module's per-head facets (`facets.head(3).q`)."""
        return HeadView(self, index)

    def __repr__(self) -> str:
        return f"<FacetView {self._call.label}: {', '.join(self.keys())}>"


#: per-head facets and the axis their head index lives on (from the end)
HEAD_AXIS: dict[str, int] = {"q": -2, "k": -2, "v": -2, "z": -2, "result": -2, "pattern": -3, "scores": -3}


def _path_name(path: Any, address: str) -> str:
    """The facet name of a typed container path: positions `(1, 0)` -> `"out1.0"`; field
    names `("h_n",)` -> `"h_n"`, `("encoder", 0)` -> `"encoder.0"` (the recorded name of a
    named leaf is its path joined with dots, or the field name alone where that is unique)."""
    items = tuple(path)
    if not items or not all(isinstance(i, (int, str)) and not isinstance(i, bool) for i in items):
        raise FacetLookupError("facet_unknown", f"module {address!r} has no facet at container path {path!r}: a "
                               "path is a non-empty tuple of positions (int) and field names (str)",
                               remedy="e.g. facets[(1, 0)] or facets[('h_n',)]", facet=repr(path), module=address)
    if all(isinstance(i, int) for i in items):
        return "out" + ".".join(str(i) for i in items)
    return ".".join(str(i) for i in items)


class HeadView:
    """`facets.head(i)`: one attention head of each per-head facet; grouped K/V heads are
    read through the query-head index (aliasing_selection: read/grad only)."""

    __slots__ = ("_view", "index")

    def __init__(self, view: FacetView, index: int) -> None:
        object.__setattr__(self, "_view", view)
        object.__setattr__(self, "index", index)

    def __getitem__(self, name: str) -> Facet:
        if self._view._invalid(name, self._view._entries.get(name)):
            raise self._view._refuse_invalid(name)
        return Facet(f"{name}[head {self.index}]", head_spec(self._view, name, self.index),
                     self._view._call._trace, self._view.address)

    def __getattr__(self, name: str) -> Facet:
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]


def head_spec(view: FacetView, name: str, index: int) -> FacetSpec:
    """The spec of head `index` of facet `name` of an attention view."""
    if name not in HEAD_AXIS:
        raise FacetError("facet_not_attention", f"facet {name!r} has no head axis", remedy=f"use one of {sorted(HEAD_AXIS)}",
                         facet=name)
    if not any(n in view._entries for n in ("q", "pattern", "z")):
        raise FacetError("facet_not_attention", f"module {view.address!r} is not an attention module (no attention "
                         "recipe matches it)", remedy="select an attention module: trace.attention_blocks()",
                         module=view.address)
    # the recorded shapes suffice (a write lowered against a structure-only capture has no
    # payloads); a facet's value is read only when its shape is not static
    entry = view._entries.get(name)
    spec = entry.spec if entry is not None and entry.spec is not None else view[name].spec
    shape = _static_shape(view, spec) or tuple(view[name].value.shape)
    axis = HEAD_AXIS[name]
    n = shape[axis]
    if name in ("k", "v"):
        q_entry = view._entries.get("q")
        has_q = q_entry is not None and q_entry.spec is not None
        nq = _static_shape(view, q_entry.spec) if has_q else None
        nq_heads = (nq or tuple(view["q"].value.shape))[-2] if has_q else n
        if not -nq_heads <= index < nq_heads:
            raise FacetError("facet_index_out_of_range", f"head {index} is out of range: {view.address!r} has "
                             f"{nq_heads} heads", remedy=f"use a head in 0..{nq_heads - 1}", index=index, heads=nq_heads)
        index %= nq_heads
        if nq_heads != n:
            return spec.alias_head(index, nq_heads // n)
    if not -n <= index < n:
        raise FacetError("facet_index_out_of_range", f"head {index} is out of range: {view.address!r} has {n} heads",
                         remedy=f"use a head in 0..{n - 1}", index=index, heads=n)
    return spec.select(axis, index % n) if spec.home_kind != "computed" else _computed_head(spec, axis, index % n)


def _computed_head(spec: FacetSpec, axis: int, index: int) -> FacetSpec:
    from torchlens.facets.spec import computed_spec

    def compute(trace: Any) -> Any:
        v = spec.compute(trace)
        key = (Ellipsis, index) + (slice(None),) * (-axis - 1)
        return v[key]

    return computed_spec(compute, spec.inputs, recipe_id=spec.recipe_id, needs=spec.needs, address=spec.address)


def _static_shape(view: FacetView, spec: FacetSpec) -> tuple[int, ...] | None:
    """The facet's shape from the home op's recorded shape (no payload read), or None."""
    if spec is None or spec.home_kind not in ("op", "module_output", "module_input"):
        return None
    op = view._call._trace._ops[spec.home]
    shape = op.shapes[spec.slot or 0] if op.shapes else None
    if shape is None:
        return None

    try:
        import numpy as np

        return tuple(spec.read(np.broadcast_to(np.zeros((), dtype=np.int8), tuple(shape))).shape)
    except Exception:  # noqa: BLE001 - the shape path is an optimisation; fall back to reading
        return None


def module_facets(module: Any) -> FacetView:
    """`module.facets`: the view of the module's single call."""
    calls = list(module.calls)
    if len(calls) != 1:
        raise FacetError("facet_module_multi_call", f"module {module.address!r} was called {len(calls)} times; "
                         "module.facets needs one call", remedy="read module.calls[n].facets for pass n "
                         f"({', '.join(c.label for c in calls[:4])})", module=module.address, calls=len(calls))
    return FacetView(calls[0])


def call_facets(call: Any) -> FacetView:
    """`module.calls[n].facets`."""
    return FacetView(call)


def modules_with_facet(trace: Any, name: str) -> list[Any]:
    """Modules whose recipes declare `name` and where at least one call has it available now."""
    out = []
    for module in trace._modules.values():
        for call in module.calls:
            e = call_entries(call).get(name)
            if e is not None and e.status == "available_now":
                out.append(module)
                break
    return out


def attention_blocks(trace: Any) -> list[Any]:
    """Modules an attention recipe matched (they declare q, pattern or z available now)."""
    out = []
    for module in trace._modules.values():
        for call in module.calls:
            entries = call_entries(call)
            if any(entries.get(n) is not None and entries[n].status == "available_now" for n in ("q", "pattern", "z")):
                out.append(module)
                break
    return out


__all__ = ["FacetView", "Facet", "HeadView", "INVALIDATED", "invalidated_facets", "MissingGrad", "Entry", "STATUSES",
           "module_facets", "call_facets", "modules_with_facet", "attention_blocks", "call_entries", "home_value", "head_spec", "structural_names",
           "structural_rows"]
