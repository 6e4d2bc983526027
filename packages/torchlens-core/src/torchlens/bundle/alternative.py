"""`Bundle.add_alternative`: merge a second run of your own harness (experimental).

The second run is a Bundle (or a mapping) of captures whose `steered=` calls ran under an
intervention spec. Calls pair by member name, never by order; TorchLens never runs the
harness. Every check runs before anything changes, and a failure while merging restores the
bundle. Not checked in this build: `alternative_capture_position_dependent` (no edit helper
here takes chosen positions or decode steps, so no spec can be position-dependent yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from torchlens.errors import BundleError, InvalidArgumentError

STATUSES = ("steered", "unchanged", "absorbed", "changed", "added", "dropped")


@dataclass(frozen=True)
class AlternativeCall:
    """One call of an AlternativeReport: the original member name, its copy (None when
    dropped), its status, and where its prompt / completion parted (None when unpaired)."""

    call: str
    member: str | None
    status: str
    prompt_divergence: int | None = None
    completion_divergence: int | None = None


@dataclass(frozen=True)
class AlternativeReport:
    """The result of Bundle.add_alternative (experimental)."""

    prefix: str
    steered: tuple[str, ...]
    calls: tuple[AlternativeCall, ...]
    uncopied_rows: tuple[Any, ...] = ()

    def table(self) -> str:
        """A fixed-width text table, one line per call."""
        def cell(v: Any) -> str:
            return "-" if v is None else str(v)

        rows = [("call", "member", "status", "prompt_div", "completion_div")]
        rows += [(c.call, cell(c.member), c.status, cell(c.prompt_divergence), cell(c.completion_divergence))
                 for c in self.calls]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def _fired(trace: Any) -> bool:
    return any(row.get("fire_count", 0) > 0 for row in trace.intervention_audit)


def _err(code: str, why: str, remedy: str, **fields: Any) -> BundleError:
    return BundleError(code, f"add_alternative: {why}", remedy=remedy, **fields)


def add_alternative(bundle: Any, second_run: Any, steered: Any = (), prefix: str = "cf_") -> AlternativeReport:
    from torchlens.bundle.core import Bundle
    from torchlens.bundle.relations import MemberRelationRow, OpaqueRelationRow
    from torchlens.bundle.tokens import token_divergence

    second = second_run if isinstance(second_run, Bundle) else Bundle(second_run)
    if isinstance(steered, str) or not all(type(s) is str for s in steered):
        raise InvalidArgumentError("invalid_argument", "steered= takes a tuple of member names",
                                   remedy='steered=("draft",)')
    steered = tuple(steered)
    if type(prefix) is not str or not prefix:
        raise InvalidArgumentError("invalid_argument", "prefix= takes a non-empty string", remedy='prefix="cf_"')
    for s in steered:
        for side, run in (("original", bundle), ("second_run", second)):
            if s not in run:
                raise _err("alternative_target_missing", f"steered call {s!r} is not in the {side}",
                           "name calls both runs made", call=s, side=side)
    for s in steered:
        if not _fired(second[s]):
            raise _err("alternative_target_unsteered", f"{s!r} was captured without a spec that fired",
                       "capture the steered call with intervene= (a spec that fires)", call=s)
    for n in second.names:
        if n not in steered and second[n].intervention_audit:
            raise _err("alternative_steer_undeclared", f"{n!r} was captured under a spec but is not in steered=",
                       f"add {n!r} to steered=, or capture it without intervene=", call=n)
    taken = [prefix + n for n in second.names if prefix + n in bundle]
    if taken:
        raise _err("alternative_member_name_taken", f"copies would reuse {taken[:5]}", "pass another prefix=",
                   names=taken)
    calls: list[AlternativeCall] = []
    paired = {n: second[n] for n in second.names if n in bundle}
    for n in bundle.names:
        if n not in paired:
            calls.append(AlternativeCall(n, None, "dropped"))
            continue
        try:
            d = token_divergence({n: bundle[n], prefix + n: paired[n]}, n, prefix + n)
        except BundleError as exc:
            side = "original" if exc.fields.get("member") == n else "second_run"
            raise BundleError(exc.code, f"add_alternative: paired call {n!r} ({side}): {exc.fields.get('reason')}",
                              remedy=exc.remedy, member=n, side=side, reason=exc.fields.get("reason")) from None
        if n in steered:
            status = "steered"
        elif d.prompt_same and not d.completion_same:
            raise _err("alternative_unchanged_call_diverged",
                       f"{n!r} saw the same prompt but wrote other text (from completion token "
                       f"{d.completion_divergence}): noise TorchLens cannot separate from the steer",
                       "make the harness deterministic (greedy decoding, fixed seeds) and run it again", call=n,
                       completion_divergence=d.completion_divergence)
        else:
            status = "unchanged" if d.prompt_same else ("absorbed" if d.completion_same else "changed")
        calls.append(AlternativeCall(n, prefix + n, status, d.prompt_divergence, d.completion_divergence))
    calls += [AlternativeCall(n, prefix + n, "added") for n in second.names if n not in paired]
    members, rows = dict(bundle._members), list(bundle._rows)
    uncopied = []
    try:
        for n in second.names:
            bundle.add(prefix + n, second[n])
        items: list[Any] = [{"kind": "alternative_of", "members": [prefix + n, n], "params": {}} for n in paired]
        for r in second.relations:
            if isinstance(r, OpaqueRelationRow):
                uncopied.append(r)
            elif isinstance(r, MemberRelationRow):
                items.append({"kind": r.kind, "members": [prefix + m for m in r.members], "params": dict(r.params)})
        bundle._append_rows(items)
    except BaseException:
        bundle._members.clear()
        bundle._members.update(members)
        bundle._rows[:] = rows
        raise
    return AlternativeReport(prefix, steered, tuple(calls), tuple(uncopied))


__all__ = ["AlternativeCall", "AlternativeReport", "add_alternative", "STATUSES"]
