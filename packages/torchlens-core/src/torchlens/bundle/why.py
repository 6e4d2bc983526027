"""`Bundle.why`, `Bundle.provenance` and `Bundle.episode_status` (experimental).

Everything here is computed when read and nothing is stored on the bundle (the comparison
gate's per-member structural facts are the only cache touched, as for every other read).

`b.why(member, relative_to=None)` answers "how does this member relate to the reference, and
can I trust a comparison of the two?" on four separate axes:

- lineage: the exact chain of relation rows that links the member to the reference (the
  baseline unless `relative_to=` names another member), graded from the rows' relation
  grades. A chain is exact when exactly one path of rows joins the two and every ordering
  row on it points the same way (`alternative_of` peer rows may sit anywhere on it). Two
  members no row connects have lineage "none". Two members that are connected only through
  a common ancestor or descendant (siblings), through several paths, or through rows of an
  unregistered kind have no exact chain: `why` raises `bundle_why_lineage_indirect`,
  `bundle_why_lineage_ambiguous` or `bundle_why_lineage_opaque`.
- payload fidelity: whether both members hold saved array payloads at every site they share.
- value residual: the largest per-site relative_l2 distance from the reference over the
  shared sites (and at the model outputs), computed from the payloads, only when the
  comparison gate passes the pair.
- comparability: the gate's `tl.types.Relationship` for (reference, member).

`b.episode_status(episode_id, episode_ledger=None)` folds the capture outcomes of the members
that `episode_member` rows name into one derived status (see `fold_episode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from torchlens.bundle import align
from torchlens.bundle import metrics as _metrics
from torchlens.bundle.relations import PAIR_KINDS, MemberRelationRow, OpaqueRelationRow, RelationGrade, _key
from torchlens.bundle.relations import grade as _grade
from torchlens.errors import BundleError, InvalidArgumentError, TorchLensError

#: Lineage statuses, in the order a report reads them: the member itself, no row joins the two,
#: then the relation-grade ladder (weakest to strongest), then the two failures that dominate it.
LINEAGE_STATUSES = ("self", "none", "unchecked", "disclosed", "consistent", "verified", "divergent", "broken")
_LADDER = ("unchecked", "disclosed", "consistent", "verified")
#: How the member stands to the reference along the chain.
DIRECTIONS = ("descends_from", "ancestor_of", "peer")
FIDELITY_STATUSES = ("complete", "partial", "none")
#: The derived episode statuses, strongest claim last; episode_unknown is the fallback.
EPISODE_STATUSES = ("episode_failed", "episode_interrupted", "episode_incomplete", "episode_complete",
                    "episode_unknown")
LEDGER_ROW_STATUSES = ("complete", "interrupted", "absent")
RESIDUAL_METRIC = "relative_l2"
_MAX_PATHS = 8


# records ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WhyLink:
    """One hop of a lineage chain, from `frm` to `to` (chain order: member first, reference
    last). `step` is "up" (to the earlier member of an ordering row), "down" (to the later
    one) or "peer" (an alternative_of row). `rows` are the indices in `b.relations` of every
    row joining the hop that way; `kinds` and `grades` are theirs, in the same order."""

    frm: str
    to: str
    step: str
    rows: tuple[int, ...]
    kinds: tuple[str, ...]
    grades: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.frm} -[{'/'.join(self.kinds)}:{self.step}]-> {self.to}"


@dataclass(frozen=True)
class PayloadFidelity:
    """Whether both members hold saved array payloads ("out") at the sites they share.

    `status`: "complete" (every shared site), "partial" (some), "none" (no shared site, or
    none saved in both). `shared_sites` counts the aligned op sites, `saved_in_both` those with
    a payload on both sides; `missing` maps each member to the shared sites it holds no array
    payload for. `direct_writes` names the members whose saved values were overwritten directly
    (`op.out = v`, outside any recipe), and `outcomes` maps both members to their capture
    outcome status (a FAILED capture is a partial trace)."""

    status: str
    shared_sites: int
    saved_in_both: int
    missing: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    direct_writes: tuple[str, ...] = ()
    outcomes: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ValueResidual:
    """The largest per-site distance (`metric`, anchored on the reference) over the shared
    sites that hold payloads in both members: `max` at `site`; `output` is the largest one at
    the model output ops (None when they hold no payload); `sites` counts the sites compared.
    When nothing was computed, `max` is None and `reason` says why (the gate's code and
    reasons, the reference itself, no payloads)."""

    metric: str
    max: float | None
    site: str | None
    output: float | None
    sites: int
    reason: str | None = None


@dataclass(frozen=True)
class WhyReport:
    """`Bundle.why`'s answer: four separate axes about `member` against `relative_to`.

    - `lineage_status`: one of LINEAGE_STATUSES. "self" (the member is the reference), "none"
      (no relation row joins them), else the weakest relation grade on the chain (unchecked <
      disclosed < consistent < verified), with divergent and broken dominating.
    - `direction`: "descends_from" (the reference is upstream of the member), "ancestor_of"
      (downstream), "peer" (only alternative_of rows), None for "self" / "none".
    - `chain`: the WhyLink hops from the member to the reference.
    - `payload_fidelity`: a PayloadFidelity; `value_residual`: a ValueResidual.
    - `comparability`: the gate's Relationship for (relative_to, member); None for "self".
    """

    member: str
    relative_to: str
    lineage_status: str
    direction: str | None
    chain: tuple[WhyLink, ...]
    payload_fidelity: PayloadFidelity
    value_residual: ValueResidual
    comparability: Any

    def __str__(self) -> str:
        chain = " ; ".join(str(h) for h in self.chain) or "-"
        res = self.value_residual
        resid = f"{res.max:.6g} at {res.site}" if res.max is not None else f"not computed ({res.reason})"
        rel = self.comparability
        comp = "-" if rel is None else f"{rel.grade} ({'comparable' if rel.comparable else rel.code})"
        fid = self.payload_fidelity
        return (f"why {self.member!r} vs {self.relative_to!r}\n"
                f"  lineage:        {self.lineage_status}" + (f" ({self.direction})" if self.direction else "") + "\n"
                f"  chain:          {chain}\n"
                f"  payloads:       {fid.status} ({fid.saved_in_both}/{fid.shared_sites} shared sites saved in both)\n"
                f"  residual:       {resid}\n"
                f"  comparability:  {comp}")


@dataclass(frozen=True)
class ProvenanceRow:
    """One member's row of `b.provenance.summary()`: the WhyReport's facts flattened, or the
    refusal (`error_code`, `error`) when the member has no exact chain to the reference."""

    member: str
    relative_to: str
    lineage_status: str | None
    direction: str | None
    chain: tuple[str, ...]
    payload_fidelity: str | None
    value_residual: float | None
    comparability: str | None
    comparable: bool | None
    error_code: str | None = None
    error: str | None = None
    report: WhyReport | None = field(default=None, repr=False, compare=False)


class ProvenanceSummary(tuple):
    """`b.provenance.summary()`: one ProvenanceRow per member, in member order."""

    relative_to: str | None

    def __new__(cls, rows: list[ProvenanceRow], relative_to: str | None) -> "ProvenanceSummary":
        obj = super().__new__(cls, rows)
        obj.relative_to = relative_to
        return obj

    def as_dicts(self) -> list[dict[str, Any]]:
        keys = ("member", "relative_to", "lineage_status", "direction", "chain", "payload_fidelity", "value_residual",
                "comparability", "comparable", "error_code")
        return [{k: getattr(r, k) for k in keys} for r in self]

    def __str__(self) -> str:
        lines = [f"provenance vs {self.relative_to!r}"]
        for r in self:
            if r.error_code:
                lines.append(f"  {r.member}: refused ({r.error_code})")
            else:
                res = "-" if r.value_residual is None else f"{r.value_residual:.6g}"
                lines.append(f"  {r.member}: lineage={r.lineage_status} payloads={r.payload_fidelity} "
                             f"residual={res} comparability={r.comparability}")
        return "\n".join(lines)


class BundleProvenance:
    """`b.provenance`: a view that computes on read (`summary()`); it holds only the bundle."""

    def __init__(self, bundle: Any) -> None:
        self._bundle = bundle

    def summary(self, relative_to: str | None = None) -> ProvenanceSummary:
        """One row per member of the same facts `b.why(member, relative_to)` reports; a member
        with no exact chain gets its refusal's code instead (the summary itself does not raise
        for it). An empty bundle has an empty summary."""
        b = self._bundle
        if not len(b):
            return ProvenanceSummary([], None)
        ref = reference(b, relative_to)
        rows = []
        for name in b.names:
            try:
                rep = why(b, name, ref)
            except BundleError as exc:
                if not exc.code.startswith("bundle_why_lineage_"):
                    raise
                rows.append(ProvenanceRow(name, ref, None, None, (), None, None, None, None, exc.code, exc.message))
                continue
            comp = rep.comparability
            rows.append(ProvenanceRow(name, ref, rep.lineage_status, rep.direction, tuple(str(h) for h in rep.chain),
                                      rep.payload_fidelity.status, rep.value_residual.max,
                                      None if comp is None else comp.grade, None if comp is None else comp.comparable,
                                      report=rep))
        return ProvenanceSummary(rows, ref)

    def __repr__(self) -> str:
        return f"<BundleProvenance of {self._bundle!r}; call .summary()>"


@dataclass(frozen=True)
class EpisodeFoldResult:
    """`Bundle.episode_status`'s derived status of one episode (experimental; never stored).

    - `status`: one of EPISODE_STATUSES (see `fold_episode` for the rule).
    - `members`: the members the episode_member rows name, in table order.
    - `member_outcomes`: member -> its capture outcome status (trace.outcome.status).
    - `ledger_rows`: member -> the ledger's row status, or None without a ledger.
    - `record`: True when an episode ledger was given.
    - `fallback`: True when the status is episode_unknown because no record was given.
    - `reasons`: why the fold landed where it did, in words.
    """

    episode_id: Any
    status: str
    members: tuple[str, ...]
    member_outcomes: Mapping[str, str]
    ledger_rows: Mapping[str, str] | None
    record: bool
    fallback: bool
    reasons: tuple[str, ...]


# helpers ---------------------------------------------------------------------------------------
def _member(b: Any, name: Any, arg: str) -> str:
    if type(name) is not str or name not in b.members:
        raise InvalidArgumentError("bundle_member_unknown", f"{arg}={name!r} is not a member of the bundle",
                                   remedy=f"name one of {list(b.names)}", name=repr(name)[:80], argument=arg)
    return name


def reference(b: Any, relative_to: Any) -> str:
    """relative_to when given (a member), else the bundle's baseline (configured, else the
    first member that reads pristine); never a guess."""
    if relative_to is not None:
        return _member(b, relative_to, "relative_to")
    ref = b.baseline
    if ref is None:
        raise BundleError("bundle_why_baseline_missing", "the bundle has no baseline: none is configured and no "
                          "member reads pristine", remedy="set b.baseline = name, or pass relative_to=name",
                          members=list(b.names))
    return ref


def _adjacency(rows: tuple[Any, ...], opaque: bool) -> dict[str, list[tuple[str, str, int]]]:
    """member -> (neighbour, step, row index) over the pair rows; opaque two-member rows join
    as "opaque" steps only when asked."""
    adj: dict[str, list[tuple[str, str, int]]] = {}
    for i, r in enumerate(rows):
        if len(r.members) != 2:
            continue
        a, c = r.members
        if isinstance(r, OpaqueRelationRow) or r.kind not in PAIR_KINDS:
            if opaque:
                adj.setdefault(a, []).append((c, "opaque", i))
                adj.setdefault(c, []).append((a, "opaque", i))
            continue
        if r.ordering:  # members = (later, earlier)
            adj.setdefault(a, []).append((c, "up", i))
            adj.setdefault(c, []).append((a, "down", i))
        else:
            adj.setdefault(a, []).append((c, "peer", i))
            adj.setdefault(c, []).append((a, "peer", i))
    return adj


_Hop = tuple[str, str, str, tuple[int, ...]]  # (frm, to, step, row indices)


def _paths(adj: dict[str, list[tuple[str, str, int]]], start: str, goal: str) -> list[list[_Hop]]:
    """Simple member paths start -> goal whose ordering steps all point one way, as lists of
    (frm, to, step, rows); rows joining one hop the same way are one hop. At most _MAX_PATHS."""
    found: list[list[_Hop]] = []

    def hops(node: str) -> list[tuple[str, str, tuple[int, ...]]]:
        grouped: dict[tuple[str, str], list[int]] = {}
        for nb, step, i in adj.get(node, ()):
            grouped.setdefault((nb, step), []).append(i)
        return [(nb, step, tuple(ix)) for (nb, step), ix in grouped.items()]

    def dfs(node: str, way: str | None, seen: set[str], path: list) -> None:
        if len(found) >= _MAX_PATHS:
            return
        if node == goal:
            found.append(list(path))
            return
        for nb, step, ix in hops(node):
            if nb in seen or (step != "peer" and way is not None and step != way):
                continue
            seen.add(nb)
            path.append((node, nb, step, ix))
            dfs(nb, way if step == "peer" else step, seen, path)
            path.pop()
            seen.discard(nb)

    dfs(start, None, {start}, [])
    return found


def _connected(adj: dict[str, list[tuple[str, str, int]]], a: str, c: str) -> bool:
    seen, stack = {a}, [a]
    while stack:
        for nb, _, _ in adj.get(stack.pop(), ()):
            if nb not in seen:
                seen.add(nb)
                stack.append(nb)
    return c in seen


def _lineage(b: Any, member: str, ref: str) -> tuple[str, str | None, tuple[WhyLink, ...]]:
    if member == ref:
        return "self", None, ()
    rows = b.relations
    adj = _adjacency(rows, opaque=False)
    paths = _paths(adj, member, ref)
    if not paths:
        if _connected(adj, member, ref):
            ups = set(b.upstream(member)) | {member}
            common = [n for n in b.upstream(ref) if n in ups] or [n for n in b.downstream(ref)
                                                                  if n in set(b.downstream(member))]
            raise BundleError("bundle_why_lineage_indirect",
                              f"{member!r} and {ref!r} are joined only through a shared relative, not by one chain "
                              "of rows pointing one way", remedy=f"ask relative to a member on a chain: "
                              f"b.why({member!r}, relative_to=...) with one of {common or list(b.names)}",
                              member=member, relative_to=ref, shared=common)
        if _connected(_adjacency(rows, opaque=True), member, ref):
            raise BundleError("bundle_why_lineage_opaque",
                              f"{member!r} and {ref!r} are joined only through rows of unregistered kinds",
                              remedy="relate them with a registered kind (successor_of, forked_from, fed_by, ...); "
                              "an unregistered kind is kept but never interpreted", member=member, relative_to=ref)
        return "none", None, ()
    if len(paths) > 1:
        text = [" ; ".join(f"{f} -{s}-> {t}" for f, t, s, _ in p) for p in paths]
        raise BundleError("bundle_why_lineage_ambiguous",
                          f"{len(paths)}{'+' if len(paths) >= _MAX_PATHS else ''} relation paths join {member!r} and "
                          f"{ref!r}: {text}", remedy="remove the redundant row, or ask relative_to= a member "
                          "on one path", member=member, relative_to=ref, paths=text)
    members = b.members
    grades: dict[int, RelationGrade] = {}
    chain = []
    for frm, to, step, ix in paths[0]:
        for i in ix:
            grades[i] = _grade(rows[i], members)
        chain.append(WhyLink(frm, to, step, ix, tuple(rows[i].kind for i in ix), tuple(grades[i].grade for i in ix)))
    seen_grades = [g.grade for g in grades.values()]
    if "broken" in seen_grades:
        status = "broken"
    elif "divergent" in seen_grades:
        status = "divergent"
    else:
        status = min(seen_grades, key=_LADDER.index)
    steps = {h.step for h in chain}
    direction = "descends_from" if "up" in steps else "ancestor_of" if "down" in steps else "peer"
    return status, direction, tuple(chain)


def _outcome(trace: Any) -> str:
    try:
        return trace.outcome.status
    except TorchLensError:
        return "UNKNOWN"


def _direct_write(trace: Any) -> bool:
    try:
        return bool(trace.direct_write_dirty)
    except TorchLensError:
        return False


def _payload_axes(b: Any, member: str, ref: str, rel: Any) -> tuple[PayloadFidelity, ValueResidual]:
    tr, tm = b.members[ref], b.members[member]
    same_graph = rel.same_graph_shape if rel is not None else True
    labels = align.aligned_labels(tr, tm, same_graph)
    missing: dict[str, list[str]] = {ref: [], member: []}
    pairs = []
    for label in labels:
        xr = align.payload_arrays(tr, tr._ops[label], "out")
        xm = align.payload_arrays(tm, tm._ops[label], "out")
        if xr is None:
            missing[ref].append(label)
        if xm is None and member != ref:
            missing[member].append(label)
        if xr is not None and xm is not None:
            pairs.append((label, xr, xm))
    both = len(pairs)
    status = "complete" if labels and both == len(labels) else "partial" if both else "none"
    fidelity = PayloadFidelity(status, len(labels), both, MappingProxyType({k: tuple(v) for k, v in missing.items()}),
                               tuple(n for n in dict.fromkeys((ref, member)) if _direct_write(b.members[n])),
                               MappingProxyType({n: _outcome(b.members[n]) for n in dict.fromkeys((ref, member))}))
    if rel is None:
        return fidelity, ValueResidual(RESIDUAL_METRIC, None, None, None, 0, "the member is the reference")
    if not rel.comparable:
        return fidelity, ValueResidual(RESIDUAL_METRIC, None, None, None, 0,
                                       f"{rel.code}: {'; '.join(rel.reasons)}")
    if not pairs:
        return fidelity, ValueResidual(RESIDUAL_METRIC, None, None, None, 0,
                                       "no shared site holds an array payload in both members")
    fn = _metrics.METRICS[RESIDUAL_METRIC]
    outputs = {o.label for o in tr.output_ops}
    best, best_site, out_best = -1.0, None, None
    for label, xr, xm in pairs:
        d = _metrics.distance(fn, align.joined(xr), align.joined(xm))
        if d > best:
            best, best_site = d, label
        if label in outputs:
            out_best = d if out_best is None else max(out_best, d)
    return fidelity, ValueResidual(RESIDUAL_METRIC, best, best_site, out_best, both)


# the three reads -------------------------------------------------------------------------------
def why(b: Any, member: Any, relative_to: Any = None) -> WhyReport:
    """`Bundle.why`: see the module docstring. Raises before reading anything when a name is
    not a member, the bundle has no baseline, or no exact chain exists."""
    member = _member(b, member, "member")
    ref = reference(b, relative_to)
    status, direction, chain = _lineage(b, member, ref)
    rel = None if member == ref else b.comparability(ref, member)
    fidelity, residual = _payload_axes(b, member, ref, rel)
    return WhyReport(member, ref, status, direction, chain, fidelity, residual, rel)


def _check_ledger(ledger: Any, episode_id: Any, members: tuple[str, ...], held: Any) -> dict[str, str]:
    def bad(why_: str, **fields: Any) -> BundleError:
        return BundleError("bundle_episode_ledger_invalid", f"episode_ledger: {why_}",
                           remedy="pass {'episode_id': id, 'rows': [{'member': name, 'status': 'complete' | "
                           "'interrupted' | 'absent'}, ...]} naming every member of the episode", **fields)

    if not isinstance(ledger, Mapping) or set(ledger) - {"episode_id", "rows"} or "rows" not in ledger:
        raise bad("a ledger is a mapping with the keys episode_id (optional) and rows")
    if "episode_id" in ledger and _key(ledger["episode_id"]) != _key(episode_id):
        raise bad(f"it records episode {ledger['episode_id']!r}, not {episode_id!r}", episode_id=repr(episode_id)[:80])
    rows = ledger["rows"]
    if not isinstance(rows, (list, tuple)):
        raise bad("rows must be a list")
    out: dict[str, str] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or set(row) != {"member", "status"}:
            raise bad(f"row {i} must be a mapping with exactly the keys member and status", row=i)
        name, status = row["member"], row["status"]
        if type(name) is not str or not name:
            raise bad(f"row {i}: member must be a non-empty string", row=i)
        if status not in LEDGER_ROW_STATUSES:
            raise bad(f"row {i}: status {status!r} is not one of {LEDGER_ROW_STATUSES}", row=i)
        if name in out:
            raise bad(f"row {i}: {name!r} is listed twice", row=i)
        if status == "absent" and name in members:
            raise bad(f"row {i}: {name!r} is marked absent but the bundle holds it as a member of the episode", row=i)
        if status != "absent" and name not in members:
            where = "a member outside this episode" if name in held else "not a member of the bundle"
            raise bad(f"row {i}: {name!r} is {status} in the ledger but {where}", row=i, member=name)
        out[name] = status
    unlisted = [m for m in members if m not in out]
    if unlisted:
        raise bad(f"the ledger does not list the episode's members {unlisted}", unlisted=unlisted)
    return out


def episode_status(b: Any, episode_id: Any, episode_ledger: Any = None) -> EpisodeFoldResult:
    """Fold the episode's members into one derived status, by the first rule that applies:

    1. a member whose capture FAILED (or ABORTED_NONFINITE) -> episode_failed (needs no record);
    2. without a ledger -> episode_unknown (completion, interruption and absence need a record);
    3. a ledger row "interrupted" -> episode_interrupted;
    4. a ledger row "absent" (a step that left no member) -> episode_incomplete;
    5. otherwise (every row complete) -> episode_complete.

    Unknown ids raise bundle_episode_id_unknown; a malformed ledger, or one that does not list
    exactly the episode's members (plus absent steps), raises bundle_episode_ledger_invalid."""
    from torchlens.bundle.relations import _scalar

    try:
        _scalar(episode_id, "episode_id")
    except BundleError:
        raise InvalidArgumentError("invalid_argument", f"episode_id={episode_id!r} is not a bool, int, finite float or "
                                   "short string", remedy="pass the episode_id an episode_member row carries") from None
    members: list[str] = []
    for r in b.relations:
        if (isinstance(r, MemberRelationRow) and r.kind == "episode_member" and "episode_id" in r.params
                and _key(r.params["episode_id"]) == _key(episode_id) and r.members[0] not in members):
            members.append(r.members[0])
    if not members:
        known = sorted({repr(r.params["episode_id"]) for r in b.relations
                        if isinstance(r, MemberRelationRow) and r.kind == "episode_member" and "episode_id" in r.params})
        raise BundleError("bundle_episode_id_unknown", f"no episode_member row carries episode_id={episode_id!r}",
                          remedy=f"relate members first: b.relate('episode_member', name, episode_id=...); "
                          f"ids held: {known}", episode_id=repr(episode_id)[:80], known=known)
    names = tuple(members)
    ledger = None if episode_ledger is None else _check_ledger(episode_ledger, episode_id, names, b.members)
    outcomes = {n: _outcome(b.members[n]) for n in names}
    failed = [n for n in names if outcomes[n] in ("FAILED", "ABORTED_NONFINITE")]
    fallback = False
    if failed:
        status, reasons = "episode_failed", (f"the capture of {failed} failed",)
    elif ledger is None:
        status, fallback = "episode_unknown", True
        reasons = ("no episode record: whether the episode completed, was interrupted or left steps out needs one",)
    elif any(s == "interrupted" for s in ledger.values()):
        status = "episode_interrupted"
        reasons = (f"the ledger marks {[n for n, s in ledger.items() if s == 'interrupted']} interrupted",)
    elif any(s == "absent" for s in ledger.values()):
        status = "episode_incomplete"
        reasons = (f"the ledger marks {[n for n, s in ledger.items() if s == 'absent']} absent",)
    else:
        status, reasons = "episode_complete", ("every ledger row is complete and no member's capture failed",)
    return EpisodeFoldResult(episode_id, status, names, MappingProxyType(outcomes),
                             None if ledger is None else MappingProxyType(ledger), ledger is not None, fallback, reasons)


__all__ = ["WhyReport", "WhyLink", "PayloadFidelity", "ValueResidual", "ProvenanceRow", "ProvenanceSummary",
           "BundleProvenance", "EpisodeFoldResult", "LINEAGE_STATUSES", "DIRECTIONS", "FIDELITY_STATUSES",
           "EPISODE_STATUSES", "LEDGER_ROW_STATUSES", "why", "episode_status", "reference"]
