"""Bundle relation rows: typed, directed facts between members (experimental).

A pair row reads as the sentence `relate` records: `b.relate("fed_by", "critique", "draft")`
is "critique fed_by draft", stored with `members=("critique", "draft")`, the LATER member
first. The ordering kinds (fed_by, selected_by, successor_of, forked_from, escalates) order
members, and the comparison gate refuses to compare two members a directed path of them
joins. Every row is checked against its kind's fixed params when it is made (`relate`,
the constructor) and again on every load; a malformed row raises
`bundle_relation_schema_invalid`, a row naming an absent member `bundle_relation_member_missing`.

A fed_by row that claims `basis="verified"` or `"matched"` is settled by the Bundle against
the members' token-stream bindings (torchlens.bundle.binding) every time it is added or
loaded: verified when every check passes, declared when evidence is missing, refused
(`bundle_relation_span_unverified`) when the evidence contradicts it; `token_spans="auto"`
runs the span matcher (torchlens.bundle.tokens.match_spans).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from torchlens.bundle.evidence import check_claim
from torchlens.errors import BundleError

PAIR_KINDS = ("alternative_of", "forked_from", "successor_of", "escalates", "fed_by", "selected_by")
MEMBER_KINDS = ("episode_member",)
ORDERING_KINDS = ("fed_by", "selected_by", "successor_of", "forked_from", "escalates")
PARAMS: dict[str, frozenset[str]] = {
    "alternative_of": frozenset({"label"}),
    "forked_from": frozenset({"label"}),
    "escalates": frozenset({"label"}),
    "successor_of": frozenset({"label", "carry_mode", "seams", "evidence"}),
    "fed_by": frozenset({"token_spans", "basis", "coverage", "label"}),
    "selected_by": frozenset({"chosen", "candidates", "evidence"}),
    "episode_member": frozenset({"episode_id", "label"}),
}
CARRY_MODES = ("none", "verbatim", "summarized")
BASES = ("declared", "verified", "matched")


def _bad(why: str, **fields: Any) -> BundleError:
    return BundleError("bundle_relation_schema_invalid", f"relation row: {why}",
                       remedy="see the kind's params in the Bundle.relations reference", **fields)


@dataclass(frozen=True)
class MemberRelationRow:
    """One relation row. `members` is (later, earlier) for a pair kind, (member,) for a member
    kind; `params` is the kind's checked params (read-only)."""

    kind: str
    members: tuple[str, ...]
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @property
    def ordering(self) -> bool:
        return self.kind in ORDERING_KINDS

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "members": list(self.members), "params": _plain(dict(self.params))}


@dataclass(frozen=True)
class OpaqueRelationRow:
    """A row of an unknown namespaced kind (`"acme.reviewed"`) loaded from an artifact: kept
    and saved back verbatim, never interpreted (not an ordering kind; grades `unchecked`)."""

    kind: str
    members: tuple[str, ...]
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    ordering = False

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "members": list(self.members), "params": _plain(dict(self.params))}


_NAMESPACED = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")


def _plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _scalar(v: Any, what: str) -> None:
    if type(v) in (bool, int):
        return
    if type(v) is float and math.isfinite(v):
        return
    if type(v) is str and 0 < len(v) <= 256:
        return
    raise _bad(f"{what} must be a bool, an int, a finite float or a non-empty string of at most 256 characters",
               value=repr(v)[:80])


def _key(v: Any) -> tuple[str, Any]:
    return (type(v).__name__, v)


EVIDENCE_BUDGET = 1024 * 1024


def _check_evidence(kind: str, evidence: Any) -> None:
    import json

    if not isinstance(evidence, Mapping):
        raise _bad("evidence must be a mapping {schema, items, facts_digest}", kind=kind)
    try:
        size = len(json.dumps(_plain(evidence), allow_nan=False).encode("utf-8"))
    except (TypeError, ValueError):
        raise _bad("evidence must be plain JSON (strings, numbers, lists, mappings)", kind=kind) from None
    if size > EVIDENCE_BUDGET:
        raise BundleError("bundle_relation_evidence_over_budget", f"{kind} evidence is {size} bytes as JSON",
                          remedy="keep a row's evidence under 1 MiB; store bulk data beside the bundle", kind=kind,
                          size=size)


MEMBER_CLASSES = ("member_input", "member_output", "member_state", "member_params")
EXOGENOUS_CLASSES = ("declared_carry", "declared_transform", "harness_record")
ITEM_CLASSES = MEMBER_CLASSES + EXOGENOUS_CLASSES
RESERVED_SCHEMAS = {
    "version_boundary_v1": frozenset(MEMBER_CLASSES + ("declared_transform",)),
    "turn_boundary_v1": frozenset(("member_input", "member_output", "member_state", "declared_carry",
                                   "declared_transform", "harness_record")),
}
MEASURED_GRADES = ("verified", "consistent", "divergent")


def _check_items(kind: str, evidence: Mapping[str, Any], seams: Any) -> dict[str, Any]:
    """Evidence items: each a mapping; its `class` one of the seven (required by the reserved
    schemas, which also limit the classes); its `seam` one the row declares. A user-written
    measurement grade is stored as `disclosed`, the original under `declared_grade`."""
    out = dict(evidence)
    items = out.get("items")
    if items is None:
        return out
    if not isinstance(items, (list, tuple)):
        raise _bad("evidence items must be a list", kind=kind)
    schema = out.get("schema")
    allowed = RESERVED_SCHEMAS.get(schema) if isinstance(schema, str) else None
    stored = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise _bad(f"evidence item {i} must be a mapping", kind=kind, item=i)
        item = dict(item)
        cls = item.get("class")
        if cls is None and allowed is not None:
            raise _bad(f"evidence item {i}: schema {schema!r} requires a class on every item", kind=kind, item=i)
        if cls is not None and cls not in ITEM_CLASSES:
            raise _bad(f"evidence item {i}: class {cls!r} is not one of {ITEM_CLASSES}", kind=kind, item=i)
        if cls is not None and allowed is not None and cls not in allowed:
            raise _bad(f"evidence item {i}: schema {schema!r} does not accept class {cls!r}", kind=kind, item=i)
        seam = item.get("seam")
        if seam is not None and seam not in (seams if isinstance(seams, (list, tuple)) else ()):
            raise _bad(f"evidence item {i}: seam {seam!r} is not one of the row's seams", kind=kind, item=i)
        if item.get("grade") not in (None, "unchecked", "disclosed") + MEASURED_GRADES:
            raise _bad(f"evidence item {i}: grade {item.get('grade')!r} is not unchecked, disclosed, verified, "
                       "consistent or divergent", kind=kind, item=i)
        check_claim(i, item, lambda why, **f: _bad(why, kind=kind, **f))  # a checked claim (bundle.evidence)
        if item.get("grade") in MEASURED_GRADES:
            item["declared_grade"] = item["grade"]
            item["grade"] = "disclosed"
        stored.append(item)
    out["items"] = stored
    return out


def _check_params(kind: str, params: Mapping[str, Any]) -> dict[str, Any]:
    extra = set(params) - PARAMS[kind]
    if extra:
        raise _bad(f"{kind} takes no params {sorted(extra)} (it takes {sorted(PARAMS[kind])})", kind=kind)
    out = dict(params)
    if "evidence" in out:
        _check_evidence(kind, out["evidence"])
    if "evidence" in out:
        out["evidence"] = _check_items(kind, out["evidence"], out.get("seams"))
    if "label" in out and type(out["label"]) is not str:
        raise _bad("label must be a string", kind=kind)
    if kind == "fed_by":
        spans = out.get("token_spans")
        if isinstance(spans, str) and spans != "auto":
            raise _bad("token_spans is 'auto' or a list of [src_start, src_end, dst_start, dst_end] rows", kind=kind)
        if spans is not None and spans != "auto":  # "auto" is matched by Bundle._append_rows (tokens.settle)
            if not isinstance(spans, (list, tuple)):
                raise _bad("token_spans must be a list of [src_start, src_end, dst_start, dst_end] rows", kind=kind)
            rows = []
            for r in spans:
                if not (isinstance(r, (list, tuple)) and len(r) == 4 and all(type(x) is int and x >= 0 for x in r)
                        and r[0] <= r[1] and r[2] <= r[3]):
                    raise _bad("each token_spans row is four non-negative ints, start <= end on both sides",
                               kind=kind, row=repr(r)[:80])
                rows.append(list(r))
            out["token_spans"] = rows
        basis = out.get("basis")
        if basis is not None and basis not in BASES:
            raise _bad(f"basis must be one of {BASES}", kind=kind)
        # a verified/matched claim is settled by Bundle._settle against the members' bindings
        cov = out.get("coverage")
        if cov is not None and not (type(cov) in (int, float) and 0.0 <= cov <= 1.0):
            raise _bad("coverage must be a number in [0, 1]", kind=kind)
    elif kind == "selected_by":
        if "chosen" in out:
            _scalar(out["chosen"], "chosen")
        if "candidates" in out:
            cands = out["candidates"]
            if not isinstance(cands, (list, tuple)) or not cands:
                raise _bad("candidates must be a non-empty list", kind=kind)
            for c in cands:
                _scalar(c, "a candidate")
            if len({_key(c) for c in cands}) != len(cands):
                raise _bad("candidates must be distinct", kind=kind)
            out["candidates"] = list(cands)
            if "chosen" in out and _key(out["chosen"]) not in {_key(c) for c in cands}:
                raise _bad("chosen must be one of candidates (compared by type and value)", kind=kind)
    elif kind == "successor_of":
        cm = out.get("carry_mode")
        if cm is not None and cm not in CARRY_MODES:
            raise _bad(f"carry_mode must be one of {CARRY_MODES}", kind=kind)
        seams = out.get("seams")
        if seams is not None:
            if not (isinstance(seams, (list, tuple)) and all(type(s) is str and s for s in seams)
                    and len(set(seams)) == len(seams)):
                raise _bad("seams must be a list of distinct non-empty names", kind=kind)
            out["seams"] = list(seams)
    elif kind == "episode_member":
        if "episode_id" in out:
            _scalar(out["episode_id"], "episode_id")
    return out


def make_row(item: Any, members: Iterable[str], opaque_ok: bool = False) -> MemberRelationRow | OpaqueRelationRow:
    """A checked row from a MemberRelationRow or a payload mapping {kind, members, params}.
    With `opaque_ok` (loading an artifact), an unknown namespaced kind loads as an
    OpaqueRelationRow; any other unknown kind is refused."""
    if isinstance(item, OpaqueRelationRow) or (opaque_ok and isinstance(item, Mapping)
                                               and isinstance(item.get("kind"), str) and item["kind"] not in PARAMS
                                               and _NAMESPACED.match(item["kind"])):
        return _opaque(item, members)
    if isinstance(item, MemberRelationRow):
        kind, names, params = item.kind, item.members, dict(item.params)
    elif isinstance(item, Mapping):
        if set(item) - {"kind", "members", "params"} or "kind" not in item or "members" not in item:
            raise _bad("a row mapping has exactly the keys kind, members and (optional) params")
        kind, names, params = item["kind"], item["members"], item.get("params") or {}
    else:
        raise _bad(f"a row is a MemberRelationRow or a mapping, not {type(item).__name__}")
    if kind not in PARAMS:
        raise _bad(f"unknown kind {kind!r} (kinds: {sorted(PARAMS)})", kind=repr(kind)[:80])
    if not isinstance(names, (list, tuple)) or not all(type(n) is str for n in names):
        raise _bad("members must be a list of member names", kind=kind)
    want = 2 if kind in PAIR_KINDS else 1
    if len(names) != want:
        raise _bad(f"{kind} names {want} member(s), got {len(names)}", kind=kind)
    if want == 2 and names[0] == names[1]:
        raise _bad(f"{kind} relates a member to itself", kind=kind)
    if not isinstance(params, Mapping) or not all(type(k) is str for k in params):
        raise _bad("params must be a mapping with string keys", kind=kind)
    held = set(members)
    for n in names:
        if n not in held:
            raise BundleError("bundle_relation_member_missing", f"relation row names {n!r}, which is not a member",
                              remedy="add the member first, or fix the row's member names", member=n, kind=kind)
    return MemberRelationRow(kind, tuple(names), _check_params(kind, params))


def _opaque(item: Any, members: Iterable[str]) -> OpaqueRelationRow:
    if isinstance(item, OpaqueRelationRow):
        return item
    if set(item) - {"kind", "members", "params"} or "members" not in item:
        raise _bad("a row mapping has exactly the keys kind, members and (optional) params")
    names, params = item["members"], item.get("params") or {}
    if not (isinstance(names, list) and 1 <= len(names) <= 2 and all(type(n) is str for n in names)):
        raise _bad("members must be a list of one or two member names", kind=item["kind"])
    if not isinstance(params, Mapping):
        raise _bad("params must be a mapping", kind=item["kind"])
    held = set(members)
    for n in names:
        if n not in held:
            raise BundleError("bundle_relation_member_missing", f"relation row names {n!r}, which is not a member",
                              remedy="add the member first, or fix the row's member names", member=n, kind=item["kind"])
    return OpaqueRelationRow(item["kind"], tuple(names), params)


def earlier_of(rows: Iterable[MemberRelationRow]) -> dict[str, list[str]]:
    """later -> the earlier members its ordering rows name, in table order."""
    out: dict[str, list[str]] = {}
    for r in rows:
        if r.ordering:
            out.setdefault(r.members[0], []).append(r.members[1])
    return out


def walk(start: str, edges: Mapping[str, list[str]]) -> list[str]:
    """Every member reachable from `start`, nearest first (breadth first)."""
    seen, order, frontier = {start}, [], [start]
    while frontier:
        nxt = []
        for n in frontier:
            for m in edges.get(n, ()):
                if m not in seen:
                    seen.add(m)
                    order.append(m)
                    nxt.append(m)
        frontier = nxt
    return order


def ordering_path(rows: Iterable[MemberRelationRow], a: str, b: str) -> tuple[str, ...]:
    """Member names of a directed ordering path between `a` and `b` (later first), or ()
    (also for `a == b`: a member is not ordered against itself)."""
    if a == b:
        return ()
    edges = earlier_of(rows)
    for src, dst in ((a, b), (b, a)):
        prev: dict[str, str] = {}
        frontier, seen = [src], {src}
        while frontier:
            nxt = []
            for n in frontier:
                for m in edges.get(n, ()):
                    if m not in seen:
                        seen.add(m)
                        prev[m] = n
                        nxt.append(m)
            frontier = nxt
        if dst in seen:
            path = [dst]
            while path[-1] != src:
                path.append(prev[path[-1]])
            return tuple(reversed(path))
    return ()


def check_acyclic(rows: list[MemberRelationRow]) -> None:
    edges = earlier_of(rows)
    for r in rows:
        if r.ordering and r.members[0] in walk(r.members[1], edges):
            raise _bad(f"ordering rows form a cycle through {r.members[0]!r} and {r.members[1]!r}", kind=r.kind)


@dataclass(frozen=True)
class RelationGrade:
    """One row's derived grade (experimental); computed when read, never stored. A bare row,
    a carry_mode="none" fresh start and a row whose items are all disclosed grade `disclosed`;
    a fed_by row whose token spans re-check against the bindings now grades `verified`
    (`divergent` when they no longer do); evidence items with a claim are checked against the
    members' saved values when read (torchlens.bundle.evidence: verified, consistent,
    divergent, broken; unchecked with reasons when a value cannot be read)."""

    kind: str
    members: tuple[str, ...]
    grade: str
    broken_premises: tuple[str, ...] = ()
    unchecked_reasons: tuple[str, ...] = ()
    seam_local_divergences: int = 0
    exogenous_items: int = 0
    items_by_class: Mapping[str, int] = field(default_factory=dict)
    items_by_grade: Mapping[str, int] = field(default_factory=dict)


def grade(row: MemberRelationRow | OpaqueRelationRow, members: Mapping[str, Any] | None = None) -> RelationGrade:
    if isinstance(row, OpaqueRelationRow):
        return RelationGrade(row.kind, row.members, "unchecked", unchecked_reasons=("kind_unregistered",))
    if row.kind == "fed_by" and row.params.get("basis") in ("verified", "matched") and members is not None:
        from torchlens.bundle.tokens import verify_spans

        try:
            basis, _ = verify_spans(members[row.members[0]], members[row.members[1]], row.params["token_spans"])
        except BundleError:
            return RelationGrade(row.kind, row.members, "divergent")
        return RelationGrade(row.kind, row.members, "verified" if basis == "verified" else "disclosed")
    from torchlens.bundle.evidence import grade_items

    evidence = row.params.get("evidence")
    items = list(evidence.get("items") or ()) if isinstance(evidence, Mapping) else []
    g = grade_items(row, items, members)  # claims checked against the members' values now
    by_class = g.pop("items_by_class")
    exogenous = sum(n for c, n in by_class.items() if c in EXOGENOUS_CLASSES)
    return RelationGrade(row.kind, row.members, g.pop("grade"), items_by_class=MappingProxyType(by_class),
                         items_by_grade=MappingProxyType(g.pop("items_by_grade")), exogenous_items=exogenous, **g)


__all__ = ["MemberRelationRow", "OpaqueRelationRow", "RelationGrade", "PAIR_KINDS", "MEMBER_KINDS", "ORDERING_KINDS", "make_row",
           "ordering_path", "walk", "earlier_of", "check_acyclic", "grade"]
