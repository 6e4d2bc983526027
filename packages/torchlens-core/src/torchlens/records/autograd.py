"""Portable grad_fn records: `trace.autograd.grad_fns`, `grad_fn_order`, `grad_fn_calls`.

A backend that builds an autograd graph during the forward (torch) walks it once, from the
outputs' grad_fn nodes along `next_functions`, and stores one plain row per node in
`trace.provenance.extra["grad_fns"]` (saved with the trace; no live autograd object is kept
in the artifact). This module turns those rows back into frozen `GradFn` records. The walk
may be deferred to the first read: every read goes through `grad_fn_rows`, which settles it
(`Provenance.settle_extra`; a save, a pickle and `Trace.cleanup()` settle it too).

Stored form (format 1), a dict:
    {"format": 1, "roots": [label, ...], "rows": [[label, type_name, next, ops, param], ...]}
    - label: `<type_name>_<n>`, e.g. `AddmmBackward0_1`: n counts nodes of that type from 1 along
      a post-order walk of the whole forward's autograd graph, seeded by the recorded ops'
      outputs in forward order (so the first linear's node is `_1`). The same model and inputs
      give the same labels, and a run whose output graph is cut short (an ablation) keeps the
      labels of the nodes it still has (its labels may then have gaps).
    - next: the node's `next_functions` as [[label or None, input_nr], ...] (None: no gradient
      flows to that input).
    - ops: the forward op labels whose output tensor carries this node as its grad_fn
      (empty for nodes no recorded op produced, e.g. the weight transpose inside a linear).
      An AccumulateGrad node of a model input lists the input op.
    - param: an AccumulateGrad node's parameter address (None otherwise).
    Rows are in `grad_fn_order`: a topological order from the roots (a node before every node
    in its `next_functions`), the order a backward can run them.
  Or {"format": 1, "rows": None, "why": reason} when the capture had no autograd history.

`provenance.extra["grad_fn_calls"]` (torch, backward_ready captures only) lists
[label, backward_pass] in the order the nodes ran during backward passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from torchlens.errors import AmbiguousOpLookupError, InvalidArgumentError, LookupMissError

FORMAT = 1
EXTRA_KEY = "grad_fns"
CALLS_KEY = "grad_fn_calls"


@dataclass(frozen=True)
class GradFn:
    """One node of the captured backward graph (portable: no live autograd object).

    `label` is stable (`AddmmBackward0_1`); `name` the node's type name; `next_functions`
    its edges as (label or None, input_nr) pairs; `ops` the forward op label(s) whose output
    carries it (`op` the first, None for a node no recorded op produced); `param` the
    parameter address of an AccumulateGrad node; `index` its place in `grad_fn_order`."""

    label: str
    name: str
    next_functions: tuple[tuple[str | None, int], ...]
    ops: tuple[str, ...]
    param: str | None
    index: int

    @property
    def op(self) -> str | None:
        return self.ops[0] if self.ops else None

    @property
    def next_labels(self) -> tuple[str, ...]:
        """The labels of the nodes this one sends gradient to (None edges dropped, in order)."""
        return tuple(lbl for lbl, _ in self.next_functions if lbl is not None)

    @property
    def is_accumulate_grad(self) -> bool:
        return self.name == "AccumulateGrad"

    def __repr__(self) -> str:
        link = f" op={self.op}" if self.op else (f" param={self.param}" if self.param else "")
        return f"<GradFn {self.label}{link} next={list(self.next_labels)}>"


@dataclass(frozen=True)
class GradFnCall:
    """One run of a grad_fn node during a backward pass (`trace.autograd.grad_fn_calls`)."""

    label: str
    backward_pass: int
    index: int


class GradFnCollection:
    """`trace.autograd.grad_fns`: the GradFn records in `grad_fn_order`. Index by position,
    by grad_fn label, or by a forward op label (that op's grad_fn); a key that is neither
    but a substring of exactly one grad_fn label names that one (several: ambiguous_op_lookup)."""

    kind = "grad_fn"

    def __init__(self, records: tuple[GradFn, ...], roots: tuple[str, ...] = ()) -> None:
        self._records = {r.label: r for r in records}
        self._by_op: dict[str, GradFn] = {}
        for r in records:
            for op in r.ops:
                self._by_op.setdefault(op, r)
        self.roots = roots

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[GradFn]:
        return iter(self._records.values())

    def __bool__(self) -> bool:
        return bool(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records or key in self._by_op

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GradFnCollection):
            return tuple(self) == tuple(other)
        if isinstance(other, tuple):
            return tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._records))

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(self._records)

    @property
    def edges(self) -> tuple[tuple[str, str], ...]:
        """(grad_fn, next grad_fn) label pairs, one per non-None next_functions entry."""
        return tuple((r.label, n) for r in self for n in r.next_labels)

    @property
    def without_op(self) -> tuple[GradFn, ...]:
        """The grad_fns no recorded forward op produced (and no parameter or input owns)."""
        return tuple(r for r in self if not r.ops and r.param is None)

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __getitem__(self, key: Any) -> GradFn:
        if isinstance(key, int) and not isinstance(key, bool):
            try:
                return tuple(self._records.values())[key]
            except IndexError:
                raise LookupMissError("label_unknown", f"index {key} is out of range for {len(self)} grad_fns",
                                      remedy=f"use an index in range({len(self)})", key=key) from None
        if not isinstance(key, str):
            raise InvalidArgumentError("invalid_argument", f"grad_fn lookup takes a label or an index, not "
                                       f"{type(key).__name__}", remedy="pass a grad_fn label or an op label",
                                       key=repr(key))
        hit = self._records.get(key) or self._by_op.get(key)
        if hit is not None:
            return hit
        subs = [lbl for lbl in self._records if key in lbl]
        if len(subs) == 1:
            return self._records[subs[0]]
        if subs:
            raise AmbiguousOpLookupError("ambiguous_op_lookup", f"{key!r} matches {len(subs)} grad_fns: "
                                         f"{', '.join(subs[:6])}{', ...' if len(subs) > 6 else ''}",
                                         remedy="pass one exact grad_fn label", key=key, matches=subs)
        raise LookupMissError("label_unknown", f"no grad_fn or op {key!r} in this trace's grad_fn records",
                              remedy="list them with trace.autograd.grad_fns.labels", key=key)

    def __repr__(self) -> str:
        return f"<GradFnCollection: {len(self)} grad_fns>"


def grad_fn_rows(trace: Any) -> tuple[Any, str | None]:
    """(the stored record dict, None) or (None, why there are no records). The one reader of
    the stored records: a backend that deferred its walk to the first read (torch) runs it
    here (`Provenance.settle_extra`), so no reader sees a half-built state."""
    settle = getattr(trace.provenance, "settle_extra", None)
    if settle is not None:
        settle()
    extra = getattr(trace.provenance, "extra", None) or {}
    stored = extra.get(EXTRA_KEY)
    backend = getattr(trace.provenance, "backend", "?")
    if stored is None:
        if backend == "torch":
            return None, ("this trace carries no grad_fn records (it was saved by a build that did not record "
                          "them, or the capture failed)")
        return None, f"the {backend} backend records no grad_fn graph"
    if not isinstance(stored, dict) or stored.get("format") != FORMAT:
        return None, "the grad_fn records are in an unknown format"
    if stored.get("rows") is None:
        return None, str(stored.get("why") or "the capture recorded no autograd graph")
    return stored, None


def grad_fns_of(trace: Any) -> tuple[GradFnCollection | None, str | None]:
    """The trace's GradFnCollection (cached per stored record object), or (None, why)."""
    stored, why = grad_fn_rows(trace)
    if stored is None:
        return None, why
    cache = trace.__dict__.get("_grad_fn_cache")
    if cache is not None and cache[0] is stored:
        return cache[1], None
    records = tuple(
        GradFn(label=str(row[0]), name=str(row[1]),
               next_functions=tuple((None if n is None else str(n), int(i)) for n, i in row[2]),
               ops=tuple(str(o) for o in row[3]), param=None if row[4] is None else str(row[4]), index=k)
        for k, row in enumerate(stored["rows"]))
    coll = GradFnCollection(records, tuple(str(r) for r in stored.get("roots", ())))
    trace.__dict__["_grad_fn_cache"] = (stored, coll)
    return coll, None


def grad_fn_calls_of(trace: Any) -> tuple[tuple[GradFnCall, ...] | None, str | None]:
    """The grad_fn runs of the trace's backward passes, or (None, why)."""
    stored, why = grad_fn_rows(trace)
    if stored is None:
        return None, why
    calls = (getattr(trace.provenance, "extra", None) or {}).get(CALLS_KEY)
    if calls is None:
        return None, ("grad_fn runs are recorded only for a capture with CaptureOptions(backward_ready=True) "
                      "(hooks on the live graph)")
    if not calls:
        return None, "no backward pass has run through the captured graph yet (trace.backward(loss))"
    return tuple(GradFnCall(str(lbl), int(p), k) for k, (lbl, p) in enumerate(calls)), None


__all__ = ["GradFn", "GradFnCall", "GradFnCollection", "grad_fns_of", "grad_fn_calls_of", "grad_fn_rows", "FORMAT",
           "EXTRA_KEY", "CALLS_KEY"]
