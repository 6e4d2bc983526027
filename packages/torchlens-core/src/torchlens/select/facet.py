"""`tl.facet(name)` / `tl.head(i, name=None)`: selectors for facet-level edits.

A facet site is not a set of ops: it lowers, against one trace, to each facet's home op plus
an edit that reads the facet slice from the home output, applies the user's edit to the
slice, and scatters the result back (`FacetSpec.scatter_update`). Lowering refuses before
anything is staged: an unknown facet, a head on a non-attention module, a head index out of
range, a read-only facet (computed, aliasing_selection, non-op home, non-raw value) and
writes that overlap another facet write on the same home op.

Resolving a facet site as plain ops (`trace[tl.head(3)]`, `find_sites`, a composite
selector) refuses with `facet_selector_unsupported`: the whole home output is never
silently edited in place of the facet.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from torchlens.errors import FacetError, FacetWarning, SelectorCompositionError
from torchlens.select.selectors import Selector

DEFAULT_HEAD_FACETS: tuple[str, ...] = ("q", "k", "v")


@dataclass(frozen=True, repr=False)
class FacetSelector(Selector):
    """A named facet (`name`), optionally one attention head (`head_index`) and one module."""

    name: str | None = None
    head_index: int | None = None
    module: str | None = None
    kind = "facet"
    _tl_facet = True

    def head(self, index: int) -> "FacetSelector":
        if not isinstance(index, int) or isinstance(index, bool):
            raise FacetError("facet_index_out_of_range", f"a head index is an int, not {type(index).__name__}",
                             remedy="tl.head(3, 'q')", index=repr(index))
        return FacetSelector(self.name, index, self.module)

    def in_module(self, address: str) -> "FacetSelector":
        if self.module is not None and self.module != address:
            raise SelectorCompositionError("selector_module_facet_scope_conflict", f"{self!r} is already scoped to "
                                           f"{self.module!r}, not {address!r}", remedy="scope a facet selector to "
                                           "one module", scoped=self.module, requested=address)
        return FacetSelector(self.name, self.head_index, address)

    def __and__(self, other: Any) -> "FacetSelector":
        """`tl.head(i) & tl.module(a)` (either order): the facet selector scoped to module a."""
        from torchlens.select.selectors import ModuleSelector

        if isinstance(other, ModuleSelector) and ":" not in other.address:
            return self.in_module(other.address)
        raise SelectorCompositionError(
            "facet_selector_unsupported", f"{self!r} & {other!r}: a facet selector composes only with tl.module(address)",
            remedy="scope it: tl.module('blocks.0.attn') & tl.head(3), or .in_module(address)", selector=repr(self))

    __rand__ = __and__

    def __or__(self, other: Any) -> "FacetUnion":
        """`tl.facet("q") | tl.facet("k")`, `tl.head(1, "q") | tl.head(2, "v")`: every member's writes."""
        return FacetUnion(_members(self) + _members(other, self))

    def __ror__(self, other: Any) -> "FacetUnion":
        return FacetUnion(_members(other, self) + _members(self))

    def match_set(self, trace: Any) -> set[str]:
        raise SelectorCompositionError(
            "facet_selector_unsupported", f"{self!r} names a facet slice, not whole ops; it cannot be resolved as a "
            "set of sites", remedy="use it as the site of trace.do(...), or read the facet: "
            "trace.modules[address].facets[name]", selector=repr(self))

    def __repr__(self) -> str:
        inner = "tl.facet" if self.head_index is None else "tl.head"
        args = [repr(self.head_index)] if self.head_index is not None else []
        if self.name is not None:
            args.append(repr(self.name))
        text = f"{inner}({', '.join(args)})"
        return text + (f".in_module({self.module!r})" if self.module else "")

    # lowering -------------------------------------------------------------------------------
    def sites(self, trace: Any) -> list[tuple[str, Any, str]]:
        """(module call label, FacetSpec, facet name) of every facet this selector writes."""
        from torchlens.facets.view import FacetView, call_entries, head_spec

        if self.module is not None and self.module not in trace._modules:
            raise FacetError("facet_unknown", f"no module {self.module!r} in this trace",
                             remedy="scope to a module address of the trace", module=self.module)
        modules = [trace._modules[self.module]] if self.module else list(trace._modules.values())
        names = [self.name] if self.name is not None else list(DEFAULT_HEAD_FACETS)
        out = []
        attention_seen = False
        for module in modules:
            for call in module.calls:
                entries = call_entries(call)
                is_attn = any(n in entries for n in ("q", "pattern", "z"))
                attention_seen |= is_attn
                view = FacetView(call)
                for name in names:
                    e = entries.get(name)
                    # a write needs the structure, not the payloads: a rerun lowers its edits
                    # against a structure-only capture, where payload-backed facets need capture
                    if e is None or e.status not in ("available_now", "needs_capture") or e.spec is None:
                        continue
                    spec = e.spec if self.head_index is None else head_spec(view, name, self.head_index)
                    out.append((call.label, spec, name))
        if self.head_index is not None and not attention_seen:
            where = f"module {self.module!r}" if self.module else "this trace"
            raise FacetError("facet_not_attention", f"{self!r}: {where} has no attention module a recipe matched",
                             remedy="scope the head to an attention module: trace.attention_blocks()",
                             module=self.module)
        if not out:
            raise FacetError("facet_unknown", f"{self!r} matches no facet available now in "
                             f"{'module ' + repr(self.module) if self.module else 'this trace'}",
                             remedy="see trace.modules[address].facets.declared()", facet=self.name, module=self.module)
        return out


def _members(sel: Any, partner: Any = None) -> tuple["FacetSelector", ...]:
    if isinstance(sel, FacetSelector):
        return (sel,)
    if isinstance(sel, FacetUnion):
        return sel.members
    raise SelectorCompositionError(
        "facet_selector_unsupported", f"{partner!r} | {sel!r}: a facet selector unites only with other facet "
        "selectors (tl.facet / tl.head)", remedy="stage the other site with its own trace.do(...) call",
        selector=repr(partner))


@dataclass(frozen=True, repr=False)
class FacetUnion(Selector):
    """`a | b` of facet selectors: one do() site writing every member's facet slices. Members
    on one home op compose under the same write masks as separate edits (an overlap refuses);
    a slice two members name identically is written once."""

    members: tuple = ()
    kind = "facet_union"
    _tl_facet = True

    @property
    def module(self) -> str | None:
        """The one module every member is scoped to, else None."""
        mods = {m.module for m in self.members}
        return mods.pop() if len(mods) == 1 else None

    def head(self, index: int) -> "FacetUnion":
        return FacetUnion(tuple(m.head(index) for m in self.members))

    def in_module(self, address: str) -> "FacetUnion":
        return FacetUnion(tuple(m.in_module(address) for m in self.members))

    def __and__(self, other: Any) -> "FacetUnion":
        return FacetUnion(tuple(m & other for m in self.members))

    __rand__ = __and__

    def __or__(self, other: Any) -> "FacetUnion":
        return FacetUnion(self.members + _members(other, self))

    def __ror__(self, other: Any) -> "FacetUnion":
        return FacetUnion(_members(other, self) + self.members)

    def match_set(self, trace: Any) -> set[str]:
        return self.members[0].match_set(trace)  # refuses: a facet slice is not a set of sites

    def __repr__(self) -> str:
        return "(" + " | ".join(repr(m) for m in self.members) + ")"

    def sites(self, trace: Any) -> list[tuple[str, Any, str]]:
        out: list[tuple[str, Any, str]] = []
        for m in self.members:
            for site in m.sites(trace):
                if not any(site[0] == o[0] and site[1] == o[1] for o in out):
                    out.append(site)
        return out

    def fanout(self, trace: Any) -> int:
        """How many sites the unscoped members write (the fan-out warning's count)."""
        return sum(len(m.sites(trace)) for m in self.members if not m.module)


def facet(name: str) -> FacetSelector:
    """Select the named facet of every module that has it (scope with `.in_module(addr)`)."""
    if not isinstance(name, str) or not name:
        raise FacetError("facet_unknown", f"tl.facet takes a facet name, not {name!r}", remedy="tl.facet('q')")
    return FacetSelector(name=name)


def head(index: int, name: str | None = None) -> FacetSelector:
    """Select attention head `index` of facet `name` (default: q, k and v)."""
    return FacetSelector(name=name).head(index)


def write_mask(spec: Any, shape: tuple[int, ...]) -> Any:
    """The boolean region of a home value of `shape` that writing `spec` changes."""
    import numpy as np

    zeros = np.zeros(tuple(int(d) for d in shape), dtype=bool)
    region = spec.read(zeros)
    return spec.scatter_update(zeros, np.ones(region.shape, dtype=bool))


def lower_facet(trace: Any, selector: FacetSelector, edit: Any) -> list[tuple[str, Any, str]]:
    """(home op label, wrapped Edit, audit source) per home op the selector writes; refuses
    read-only facets and overlapping same-home writes (also against writes staged earlier
    on this trace) before anything changes. Records the accepted write masks on the trace."""
    from torchlens.intervention.edits import Edit, as_edit, fire

    user = as_edit(edit)
    sites = selector.sites(trace)
    by_home: dict[str, list[tuple[Any, str]]] = {}
    for _call, spec, name in sites:
        if not spec.writable:
            raise FacetError("facet_write_refused", f"facet {name!r} of {spec.address!r} is {spec.capability} with a "
                             f"{spec.home_kind} home: read-only", remedy="edit a q/k/v/z/resid facet, or recapture "
                             "with eager attention so the facet is backed by a real op", facet=name,
                             capability=spec.capability, home_kind=spec.home_kind)
        if spec.value_version != "raw":
            raise FacetError("facet_write_refused", f"facet {name!r} reads a {spec.value_version} value, not the raw "
                             "op output", remedy="edit a facet of a raw op output", facet=name)
        op = trace._ops[spec.home]
        if op.multi_output and (spec.slot or 0) != 0:
            raise FacetError("facet_write_refused", f"facet {name!r} lives in output slot {spec.slot} of the "
                             f"multi-output op {op.label}", remedy="edit a facet of a single-output op", facet=name)
        by_home.setdefault(spec.home, []).append((spec, name))
    # accepted writes per home op: [(rule key, mask)]; lowering the same rule again (a rerun
    # lowers its recipe against the new capture) is not an overlap with itself
    key = (repr(selector), user.identity())
    staged = {k: list(v) for k, v in (trace.__dict__.get("_facet_writes") or {}).items()}
    for label, items in by_home.items():
        shape = trace._ops[label].shapes[0]
        others = [m for k, m in staged.get(label, []) if k != key]
        mine = None
        for spec, name in items:
            m = write_mask(spec, shape)
            for prev in others + ([mine] if mine is not None else []):
                if (prev & m).any():
                    raise FacetError("facet_write_overlap", f"the write to {name!r} overlaps another facet write on "
                                     f"home op {label}", remedy="write non-overlapping slices (other heads / other "
                                     "of q,k,v), or clear the earlier edit first", facet=name, home=label)
            mine = m if mine is None else (mine | m)
        staged[label] = [(k, m) for k, m in staged.get(label, []) if k != key] + [(key, mine)]
    fan = selector.fanout(trace) if isinstance(selector, FacetUnion) else (0 if selector.module else len(sites))
    if fan > 1:
        warnings.warn(FacetWarning("facet_selector_fanout", f"{selector!r} writes {fan} facet sites",
                                   remedy="scope it with .in_module(address) to write one module",
                                   site_count=fan), stacklevel=3)
    out = []
    for label, items in by_home.items():
        specs = tuple(s for s, _ in items)
        names = "+".join(n for _, n in items)

        def fn(value: Any, ctx: Any, specs: tuple = specs) -> Any:
            for spec in specs:
                edited = fire(user, spec.read(value), ctx)
                value = spec.scatter_update(value, edited, ctx.ops)
            return value

        wrapped = Edit(f"facet:{user.name}", tuple(user.kwargs) + (("facet", f"{names}@{label}"),), fn,
                       portability=user.portability, signal=user.signal, tensors=tuple(user.tensors))
        out.append((label, wrapped, f"facet:{names}"))
    trace.__dict__["_facet_writes"] = staged
    return out


__all__ = ["FacetSelector", "FacetUnion", "facet", "head", "lower_facet", "write_mask", "DEFAULT_HEAD_FACETS"]
