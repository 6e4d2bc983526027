"""tl.Bundle: a named collection of aligned Traces, for cross-run comparison.

Members are held by name in insertion order. Every cross-member read goes through the
comparison gate (`comparability`), which grades the pair as a `tl.types.Relationship` from
facts it computes when read: the same_param_shapes floor, ordering relation rows, input
equality (exact, through the backends' host copies) and graph-shape hashes. A pair the gate
does not pass raises its `bundle_gate_*` code before any payload is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterator, Mapping

from torchlens.bundle import align
from torchlens.bundle import metrics as _metrics
from torchlens.bundle.relations import MemberRelationRow, RelationGrade, check_acyclic, earlier_of, make_row
from torchlens.bundle.relations import grade as _grade
from torchlens.bundle.relations import ordering_path as _ordering_path
from torchlens.bundle.relations import walk as _walk
from torchlens.bundle.views import SuperOp, SuperParam
from torchlens.errors import BundleError, InvalidArgumentError, TorchLensError
from torchlens.types import Relationship

ONS = ("out", "grad")


class CompareRows(tuple):
    """`Bundle.compare`'s rows: (site_label, distance) tuples in the first member's execution
    order. `skipped` maps each aligned site that has no distance to why (a payload not saved,
    a value that is not an array); `relationship` is the gate's grade of the pair."""

    skipped: Mapping[str, str]
    relationship: Relationship
    metric: str | None
    on: str

    def __new__(cls, rows: list[tuple[str, float]], skipped: dict[str, str], relationship: Relationship,
                metric: str | None, on: str) -> "CompareRows":
        obj = super().__new__(cls, rows)
        obj.skipped = MappingProxyType(skipped)
        obj.relationship = relationship
        obj.metric = metric
        obj.on = on
        return obj

    def as_dict(self) -> dict[str, float]:
        return dict(self)


@dataclass(frozen=True)
class StoredComparison:
    """Per-layer distances of every member from the baseline, stamped under `name`. A layer
    that runs more than once has one value: the metric over its passes joined in pass order."""

    name: str
    metric: str | None
    on: str
    baseline: str
    values: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # member -> layer label -> distance
    skipped: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


def _member_error(why: str, **fields: Any) -> InvalidArgumentError:
    return InvalidArgumentError("bundle_member_invalid", why, remedy="add tl.Trace objects under non-empty string names",
                                **fields)


class Bundle:
    """A named collection of aligned Traces (`tl.Bundle()`, `tl.Bundle([t1, t2])`,
    `tl.Bundle({"clean": t1, "corrupted": t2}, baseline="clean")`)."""

    def __init__(self, members: Any = None, *, baseline: str | None = None, relations: Any = ()) -> None:
        self._members: dict[str, Any] = {}
        self._rows: list[MemberRelationRow] = []
        self._stored: dict[str, StoredComparison] = {}
        self._facts: dict[Any, Any] = {}  # cached per-member facts (hash, params, ...) keyed by (kind, name)
        for name, trace in self._normalize(members):
            self._check_member(name, trace)
            if name in self._members:
                raise InvalidArgumentError("bundle_member_exists", f"two members are named {name!r}",
                                           remedy="give every member its own name", name=name)
            self._members[name] = trace
        if baseline is not None and baseline not in self._members:
            raise InvalidArgumentError("bundle_baseline_unknown", f"baseline={baseline!r} is not a member",
                                       remedy=f"name one of {list(self._members)}", baseline=baseline)
        self._baseline = baseline
        if relations:
            self._append_rows(list(relations))

    # members -------------------------------------------------------------------------------
    @staticmethod
    def _normalize(members: Any) -> list[tuple[Any, Any]]:
        if members is None:
            return []
        if isinstance(members, Bundle):
            return list(members._members.items())
        if isinstance(members, Mapping):
            return list(members.items())
        if isinstance(members, (list, tuple)):
            names = [getattr(t, "name", None) for t in members]
            if all(type(n) is str and n for n in names) and len(set(names)) == len(names):
                return list(zip(names, members))
            return [(str(i), t) for i, t in enumerate(members)]  # trace names repeat ("root"): positions
        raise _member_error(f"tl.Bundle takes None, a list of traces or a mapping, not {type(members).__name__}")

    @staticmethod
    def _check_member(name: Any, trace: Any) -> None:
        from torchlens.records.trace import Trace

        if type(name) is not str or not name:
            raise _member_error(f"member name {name!r} is not a non-empty string", name=repr(name)[:80])
        if not isinstance(trace, Trace):
            raise _member_error(f"member {name!r} is a {type(trace).__name__}, not a tl.Trace", name=name)

    def add(self, name: str, trace: Any) -> "Bundle":
        """Add one member; returns the bundle."""
        self._check_member(name, trace)
        if name in self._members:
            raise InvalidArgumentError("bundle_member_exists", f"the bundle already holds {name!r}",
                                       remedy="choose another name", name=name)
        self._members[name] = trace
        return self

    @property
    def members(self) -> Mapping[str, Any]:
        return MappingProxyType(self._members)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._members)

    def __getitem__(self, name: str) -> Any:
        return self._members[name]  # an unknown name raises KeyError

    def __contains__(self, name: object) -> bool:
        return name in self._members

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __repr__(self) -> str:
        base = f", baseline={self.baseline!r}" if self.baseline else ""
        return f"<Bundle of {len(self)} members {list(self._members)}{base}>"

    # baseline and pristine -----------------------------------------------------------------
    @property
    def pristine(self) -> dict[str, bool]:
        """Member name -> whether it reads pristine (only `is_pristine is True` counts)."""
        return {n: _is_pristine(t) is True for n, t in self._members.items()}

    @property
    def baseline(self) -> str | None:
        """The configured baseline, else the first member that reads pristine, else None."""
        if self._baseline is not None:
            return self._baseline
        for n, t in self._members.items():
            if _is_pristine(t) is True:
                return n
        return None

    @baseline.setter
    def baseline(self, name: str | None) -> None:
        if name is not None and name not in self._members:
            raise InvalidArgumentError("bundle_baseline_unknown", f"baseline={name!r} is not a member",
                                       remedy=f"name one of {list(self._members)}", baseline=name)
        self._baseline = name

    def _reference(self, baseline: str | None = None) -> str:
        ref = baseline or self._baseline or (self.names[0] if self._members else None)
        if ref is None or ref not in self._members:
            raise InvalidArgumentError("bundle_baseline_unknown", f"baseline={ref!r} is not a member",
                                       remedy=f"name one of {list(self._members)}", baseline=ref)
        return ref

    # relations -----------------------------------------------------------------------------
    @property
    def relations(self) -> tuple[MemberRelationRow, ...]:
        return tuple(self._rows)

    def relate(self, *args: Any, **params: Any) -> "Bundle":
        """`b.relate("fed_by", "critique", "draft", label="critique")` (kind, later, earlier,
        params; a member kind names one member) or `b.relate(row, ...)` with rows or payload
        mappings. Returns the bundle; on an error the table is unchanged."""
        if args and isinstance(args[0], str):
            kind, names = args[0], list(args[1:])
            items = [{"kind": kind, "members": names, "params": params}]
        else:
            if params:
                raise BundleError("bundle_relation_schema_invalid", "params go with the positional form only",
                                  remedy="put params inside the row")
            items = list(args)
        self._append_rows(items)
        return self

    def _append_rows(self, items: list[Any], opaque_ok: bool = False) -> None:
        from torchlens.bundle.evidence import check_sites
        from torchlens.bundle.tokens import settle

        rows = [make_row(i, self._members, opaque_ok) for i in items]
        check_acyclic(self._rows + rows)
        # fed_by spans must lie inside both members' bound streams; a verified/matched claim is
        # re-checked against the token-stream bindings (verified, declared, or refused)
        rows = [settle(r, self._members) for r in rows]
        for r in rows:  # evidence claims name sites / params the members have
            if isinstance(r, MemberRelationRow):
                check_sites(r, self._members)
        self._rows.extend(rows)

    def token_pairs(self, reader: str, source: str) -> Any:
        """The verified one-to-one token positions of "reader fed_by source" (relate's order)
        as a `TokenPairs`; only spans of verified rows that re-check now pair (experimental)."""
        from torchlens.bundle.tokens import token_pairs

        return token_pairs(self._rows, self._members, reader, source)

    def add_alternative(self, second_run: Any, steered: Any = (), prefix: str = "cf_") -> Any:
        """Merge a second run of your own harness (its `steered` calls captured under their
        specs) as `prefix + name` members, pairing calls by name; returns an
        `AlternativeReport`. Every refusal comes before anything changes (experimental)."""
        from torchlens.bundle.alternative import add_alternative

        return add_alternative(self, second_run, steered, prefix)

    def token_divergence(self, original: str, rerun: str) -> Any:
        """A `TokenDivergence`: where two bound members' prompts and completions part, by exact
        token ids (experimental)."""
        from torchlens.bundle.tokens import token_divergence

        return token_divergence(self._members, original, rerun)

    def relation_grades(self) -> list[RelationGrade]:
        return [_grade(r, self._members) for r in self._rows]

    def upstream(self, name: str) -> list[str]:
        self._members[name]
        return _walk(name, earlier_of(self._rows))

    def downstream(self, name: str) -> list[str]:
        self._members[name]
        later: dict[str, list[str]] = {}
        for late, earlies in earlier_of(self._rows).items():
            for e in earlies:
                later.setdefault(e, []).append(late)
        return _walk(name, later)

    # provenance and episodes (experimental; computed when read, never stored) ----------------
    def why(self, member: str, relative_to: str | None = None) -> Any:
        """A `WhyReport` of `member` against the baseline (or `relative_to`): the exact chain of
        relation rows joining them with its lineage status, payload fidelity, value residual
        and comparability as separate axes. Raises `bundle_why_lineage_*` when no exact chain
        exists (see torchlens.bundle.why)."""
        from torchlens.bundle.why import why

        return why(self, member, relative_to)

    @property
    def provenance(self) -> Any:
        """`b.provenance.summary()`: the per-member list of `why`'s facts against the baseline."""
        from torchlens.bundle.why import BundleProvenance

        return BundleProvenance(self)

    def episode_status(self, episode_id: Any, *, episode_ledger: Any = None) -> Any:
        """Fold the capture outcomes of the members `episode_member` rows name under
        `episode_id` into a derived `EpisodeFoldResult` (never stored); statuses that need an
        episode record read `episode_unknown` without `episode_ledger=`."""
        from torchlens.bundle.why import episode_status

        return episode_status(self, episode_id, episode_ledger)

    # the comparison gate -------------------------------------------------------------------
    def _fact(self, kind: str, name: str) -> Any:
        key = (kind, name, id(self._members[name]))
        if key not in self._facts:
            t = self._members[name]
            self._facts[key] = align.graph_shape_hash(t) if kind == "hash" else align.param_shapes(t)
        return self._facts[key]

    def graph_shape_hash(self, name: str) -> str:
        """The member's graph-shape hash (sha256 of every op's structural signature)."""
        return self._fact("hash", name)

    def comparability(self, a: str, b: str) -> Relationship:
        """The comparison gate's grade of the pair (computed when read)."""
        ta, tb = self._members[a], self._members[b]
        same_params = self._fact("params", a) == self._fact("params", b)
        same_graph = self._fact("hash", a) == self._fact("hash", b)
        path = _ordering_path(self._rows, a, b)
        eq = align.inputs_equal(ta, tb) if same_params else None
        shared = len(align.aligned_labels(ta, tb, same_graph)) if same_params else 0
        if not same_params:
            grade, code, why = "foreign", "bundle_gate_param_shapes", ("parameter addresses, shapes or dtypes differ",)
        elif path:
            grade, code, why = "ordered", "bundle_gate_ordered", (f"ordering path {' -> '.join(path)}",)
        elif eq is True:
            grade, code, why = "same_inputs", None, ("inputs proven equal",)
        elif same_graph:
            grade, code, why = "same_graph", None, ("equal graph-shape hashes",)
        else:
            grade, code = "different_graph", "bundle_gate_graph_mismatch"
            why = ("graph-shape hashes differ", "inputs " + ("differ" if eq is False else "not proven equal (not saved)"))
        return Relationship(a, b, grade, code is None, code, same_params, same_graph, eq, path, shared, why)

    def _gate(self, a: str, b: str) -> Relationship:
        rel = self.comparability(a, b)
        if not rel.comparable:
            raise BundleError(rel.code, f"members {a!r} and {b!r} cannot be compared: {'; '.join(rel.reasons)}",
                              remedy=_GATE_REMEDY[rel.code], a=a, b=b, grade=rel.grade)
        return rel

    def _gate_all(self, names: list[str]) -> None:
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                self._gate(a, b)

    def _floor_all(self, names: list[str]) -> None:
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if self._fact("params", a) != self._fact("params", b):
                    raise BundleError("bundle_gate_param_shapes", f"members {a!r} and {b!r} have different parameters",
                                      remedy=_GATE_REMEDY["bundle_gate_param_shapes"], a=a, b=b, grade="foreign")

    @staticmethod
    def _check_on(on: Any, allowed: tuple[str, ...] = ONS) -> None:
        if on not in allowed:
            raise InvalidArgumentError("invalid_argument", f"on={on!r} is not one of {allowed}",
                                       remedy=f"read one of {allowed}")

    # comparisons ---------------------------------------------------------------------------
    def compare(self, a: str, b: str, *, metric: Any = "cosine", on: str = "out") -> CompareRows:
        """(site_label, distance) rows over the sites both members share, after the gate."""
        self._check_on(on)
        name, fn = _metrics.resolve(metric)
        rel = self._gate(a, b)
        ta, tb = self._members[a], self._members[b]
        rows, skipped = [], {}
        for label in align.aligned_labels(ta, tb, rel.same_graph_shape):
            xa = align.payload_arrays(ta, ta._ops[label], on)
            xb = align.payload_arrays(tb, tb._ops[label], on)
            if xa is None or xb is None:
                skipped[label] = f"{on} not saved or not an array in " + (a if xa is None else b)
                continue
            rows.append((label, _metrics.distance(fn, align.joined(xa), align.joined(xb))))
        return CompareRows(rows, skipped, rel, name, on)

    def rank_changes(self, a: str | None = None, b: str | None = None, *, metric: Any = "relative_l2", on: str = "out",
                     by: str = "op", top: int | None = None) -> list[tuple[str, float, str]]:
        """Sites ordered by distance, largest first, as (site, distance, op_label) rows.
        by="module" folds ops into every module that contains them, keeping the most changed
        op per module (the fold the folded diff drawing uses). Defaults: the baseline (or the
        first member) against the next member."""
        a, b = self._pair_default(a, b)
        rows = self.compare(a, b, metric=metric, on=on)
        if by == "op":
            out = [(lbl, d, lbl) for lbl, d in rows]
        elif by == "module":
            best: dict[str, tuple[float, str]] = {}
            ta = self._members[a]
            for lbl, d in rows:
                for mod in ta._ops[lbl].modules or ():
                    if mod == "self":
                        continue
                    if mod not in best or d > best[mod][0]:
                        best[mod] = (d, lbl)
            out = [(m, d, lbl) for m, (d, lbl) in best.items()]
        else:
            raise InvalidArgumentError("invalid_argument", f"by={by!r} is not 'op' or 'module'", remedy="by='op' or by='module'")
        out.sort(key=lambda r: -r[1])
        return out if top is None else out[:top]

    def _pair_default(self, a: str | None, b: str | None) -> tuple[str, str]:
        if a is None:
            a = self._reference(self.baseline)
        if b is None:
            rest = [n for n in self._members if n != a]
            if not rest:
                raise InvalidArgumentError("invalid_argument", "comparing needs two members", remedy="add another member")
            b = rest[0]
        self._members[a], self._members[b]
        return a, b

    def at(self, site: Any) -> Any:
        """The cross-member Super* view of one site (SuperOp, or SuperParam for a parameter address)."""
        names = list(self._members)
        if not names:
            raise InvalidArgumentError("bundle_site_unresolved", "the bundle has no members", remedy="add members first",
                                       site=repr(site)[:80])
        if isinstance(site, str):
            if all(site in self._members[n]._params and site not in self._members[n]._ops for n in names):
                return SuperParam(self, site, names)
            return SuperOp(self, site, {n: self._resolve_label(n, site) for n in names})
        self._floor_all(names)
        ops = {}
        for n in names:
            try:
                sel = self._members[n].find_sites(site)
                labels = list(sel.labels)
            except TorchLensError as exc:
                raise InvalidArgumentError("bundle_site_unresolved", f"member {n!r}: {exc.message}",
                                           remedy="pass a selector every member resolves", member=n) from exc
            if len(labels) != 1:
                raise InvalidArgumentError("bundle_site_unresolved",
                                           f"member {n!r}: the selector resolves to {len(labels)} ops, not one",
                                           remedy="narrow the selector to one op per member", member=n,
                                           labels=labels[:10])
            ops[n] = (self._members[n]._ops[labels[0]],)
        return SuperOp(self, site, ops)

    def _resolve_label(self, name: str, label: str) -> tuple[Any, ...]:
        """The ops `label` names in one member, through the member's own typed entry point
        (`trace[label]`), whose refusal (label_unknown, pass_out_of_range, ...) propagates."""
        from torchlens.records import Layer, Module, ModuleCall, Op

        t = self._members[name]
        if label in t._ops:
            return (t._ops[label],)
        rec = t[label]
        if isinstance(rec, Op):
            return (rec,)
        if isinstance(rec, Layer):
            return tuple(rec.ops)
        if isinstance(rec, (Module, ModuleCall)) and rec.output_ops:
            return tuple(rec.output_ops)
        raise InvalidArgumentError("bundle_site_unresolved",
                                   f"member {name!r}: {label!r} names a {type(rec).__name__}, not an op site",
                                   remedy="use an op, layer or module label every member holds", member=name, site=label)

    def weight_norm_diff(self, a: str, b: str) -> dict[str, float]:
        """address -> norm(b's value - a's value) of every parameter, from capture-time
        snapshots (guarded: `checkpoint_series_live_params` without them)."""
        import numpy as np

        from torchlens.bundle.guard import require_snapshots

        snaps = require_snapshots(self._members, [a, b], "weight_norm_diff")
        self._floor_all([a, b])
        return {addr: float(np.linalg.norm(np.asarray(snaps[b][addr], np.float64) - np.asarray(v, np.float64)))
                for addr, v in snaps[a].items()}

    # stored comparisons --------------------------------------------------------------------
    def store_comparison(self, metric: Any = "relative_l2", *, name: str | None = None, baseline: str | None = None,
                         on: str = "out") -> str:
        self._check_on(on)
        mname, fn = _metrics.resolve(metric)
        key = name if name is not None else mname
        if type(key) is not str or not key:
            raise InvalidArgumentError("metric_invalid", "a callable metric needs an explicit name=",
                                       remedy="store_comparison(fn, name='my_metric')")
        ref = self._reference(baseline)
        for n in self._members:
            if n != ref:
                self._gate(ref, n)
        tr = self._members[ref]
        values: dict[str, dict[str, float]] = {}
        skipped: dict[str, dict[str, str]] = {}
        for n, t in self._members.items():
            vals, skip = {}, {}
            for layer_label, layer in tr._layers.items():
                other = t._layers.get(layer_label)
                if other is None or [o.label for o in other.ops] != [o.label for o in layer.ops]:
                    skip[layer_label] = "the layer's passes do not line up"
                    continue
                xa = [align.payload_arrays(tr, o, on) for o in layer.ops]
                xb = [align.payload_arrays(t, o, on) for o in other.ops]
                if any(x is None for x in xa + xb):
                    skip[layer_label] = f"{on} not saved or not an array"
                    continue
                ja = align.joined([arr for x in xa for arr in x])
                jb = align.joined([arr for x in xb for arr in x])
                vals[layer_label] = _metrics.distance(fn, ja, jb)
            values[n] = MappingProxyType(vals)
            skipped[n] = MappingProxyType(skip)
        self._stored[key] = StoredComparison(key, mname, on, ref, MappingProxyType(values), MappingProxyType(skipped))
        return key

    def stored_comparison(self, name: str) -> StoredComparison:
        try:
            return self._stored[name]
        except KeyError:
            raise BundleError("comparison_unknown", f"no comparison is stored under {name!r}",
                              remedy=f"store one with store_comparison(...); stored: {sorted(self._stored)}",
                              name=name) from None

    def stored_comparison_names(self) -> list[str]:
        return list(self._stored)

    # editing -------------------------------------------------------------------------------
    def do(self, site: Any, edit: Any = None, /, **kwargs: Any) -> "Bundle":
        """Broadcast `Trace.do(site, edit, ...)` to every member, in order; returns the bundle."""
        for t in self._members.values():
            t.do(site, edit, **kwargs)
        self._facts.clear()
        return self

    def vary(self, mapping: Mapping[str, Any], *, unmentioned: Any = None) -> "Bundle":
        """Apply one intervention spec (or None: no change) to each named member. The mapping
        must name every member unless `unmentioned=` gives the spec for the rest. A failure
        partway raises vary_partial_failure naming what completed (nothing is rolled back)."""
        if not isinstance(mapping, Mapping):
            raise InvalidArgumentError("bundle_vary_mapping_invalid", "vary takes a mapping of member name -> spec",
                                       remedy="b.vary({'clean': None, 'ablated': tl.when(site, tl.zero_ablate())})")
        unknown = [k for k in mapping if k not in self._members]
        missing = [n for n in self._members if n not in mapping]
        if unknown or (missing and unmentioned is None):
            raise InvalidArgumentError("bundle_vary_mapping_invalid",
                                       f"the mapping names non-members {unknown} / leaves out members {missing}",
                                       remedy="name every member (None for no change) or pass unmentioned=",
                                       unknown=unknown, missing=missing)
        plan = [(n, mapping.get(n, unmentioned)) for n in self._members]
        done: list[str] = []
        for n, spec in plan:
            if spec is None:
                continue
            try:
                if isinstance(spec, tuple) and len(spec) == 2:
                    self._members[n].do(spec[0], spec[1])
                else:
                    self._members[n].do(spec)
            except Exception as exc:
                raise BundleError("vary_partial_failure", f"vary failed on member {n!r} after {done} completed: {exc}",
                                  remedy="the completed members keep their edits; fork them first to retry",
                                  completed=list(done), failed=n) from exc
            done.append(n)
        self._facts.clear()
        return self

    # persistence, drawing ------------------------------------------------------------------
    def save(self, path: Any, overwrite: bool = False) -> Any:
        from torchlens.bundle.artifact import save_bundle

        return save_bundle(self, path, overwrite=overwrite)

    @classmethod
    def load(cls, path: Any, lazy: bool = False) -> "Bundle":
        from torchlens.bundle.artifact import load_bundle

        return load_bundle(path, lazy=lazy)

    def draw(self, path: Any = None, **kwargs: Any) -> Any:
        from torchlens.viz.bundle_draw import draw_bundle

        return draw_bundle(self, path, **kwargs)

    def show(self, kind: str | None = None, **kwargs: Any) -> Any:
        if kind in (None, "graph"):
            return self.draw(**kwargs)
        if kind == "strip":
            path = kwargs.pop("path", None)
            out = {}
            for n, t in self._members.items():
                p = None if path is None else _suffixed(path, n)
                out[n] = t.draw(p, **kwargs)
            return out
        if kind == "repr":
            return {n: repr(t) for n, t in self._members.items()}
        if kind == "html":
            return {n: t._repr_html_() for n, t in self._members.items()}
        raise InvalidArgumentError("bundle_show_kind_invalid", f"kind={kind!r} is not a bundle show kind",
                                   remedy="use None, 'graph', 'strip', 'repr' or 'html'", kind=repr(kind)[:80])


def _suffixed(path: Any, name: str) -> str:
    import os

    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}_{name}{ext}"


def _is_pristine(trace: Any) -> bool | None:
    try:
        return trace.is_pristine
    except TorchLensError:
        return None


_GATE_REMEDY = {
    "bundle_gate_param_shapes": "compare members captured from the same model architecture",
    "bundle_gate_ordered": "members an ordering relation joins are not compared; compare peers (alternative_of) instead",
    "bundle_gate_graph_mismatch": "capture both members on the same inputs (saved), or on inputs that give the same graph",
}

__all__ = ["Bundle", "CompareRows", "StoredComparison"]
