"""fed_by span checks, `Bundle.token_pairs` and `Bundle.token_divergence` (experimental).

Everything here is read from the members' token-stream bindings (torchlens.bundle.binding)
and their retained ids, by exact id equality; equal lengths are never taken as evidence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from torchlens.bundle.binding import TokenBinding, binding_of, bound_ids, ids_digest
from torchlens.errors import BundleError


def _unverified(why: str, **fields: Any) -> BundleError:
    return BundleError("bundle_relation_span_unverified", f"fed_by: {why}",
                       remedy="fix the spans (or the binding), or relate the row with basis='declared'", **fields)


def _side(trace: Any) -> tuple[TokenBinding | None, np.ndarray | None]:
    b = binding_of(trace)
    return b, bound_ids(trace, b)


def check_bounds(reader_trace: Any, source_trace: Any, spans: list[list[int]]) -> None:
    """Every span inside both members' bound streams (a member with no bound stream is not
    checked: its spans stay declared)."""
    lengths = {}
    for side, trace in (("source", source_trace), ("reader", reader_trace)):
        b, ids = _side(trace)
        lengths[side] = int(ids.shape[0]) if ids is not None else (b.length if b is not None else None)
    for i, (s0, s1, d0, d1) in enumerate(spans):
        for side, end in (("source", s1), ("reader", d1)):
            n = lengths[side]
            if n is not None and end > n:
                raise BundleError("bundle_relation_span_out_of_bounds",
                                  f"token_spans[{i}] ends at {end}, past the {side} member's {n} bound tokens",
                                  remedy="give spans inside each member's token stream (half-open [start, end))",
                                  row_index=i, side=side, length=n)


def eligible_positions(binding: TokenBinding, ids: np.ndarray) -> list[int]:
    """The source's eligible positions: its completion range minus excluded ids."""
    c0, c1 = binding.completion
    excluded = set(binding.excluded_ids)
    return [p for p in range(c0, c1) if int(ids[p]) not in excluded]


def verify_spans(reader_trace: Any, source_trace: Any, spans: list[list[int]], row_index: int | None = None
                 ) -> tuple[str, float | None]:
    """("verified", coverage) when every check passes; ("declared", None) when evidence is
    missing; `bundle_relation_span_unverified` when the evidence contradicts the spans."""
    bs, ids_s = _side(source_trace)
    br, ids_r = _side(reader_trace)
    if not spans or bs is None or br is None or ids_s is None or ids_r is None or bs.completion is None:
        return "declared", None
    for side, b, ids in (("source", bs, ids_s), ("reader", br, ids_r)):
        if b.ids_digest is not None and b.ids_digest != ids_digest(ids):
            raise _unverified(f"the {side} member's retained ids no longer match its binding's ids_digest",
                              side=side, row_index=row_index)
    c0, c1 = bs.completion
    covered: set[int] = set()
    for i, (s0, s1, d0, d1) in enumerate(spans):
        if not (c0 <= s0 and s1 <= c1):
            raise _unverified(f"token_spans[{i}] source [{s0}, {s1}) is not inside the source's completion "
                              f"[{c0}, {c1})", span=i, row_index=row_index)
        if s1 - s0 != d1 - d0 or not np.array_equal(ids_s[s0:s1], ids_r[d0:d1]):
            raise _unverified(f"token_spans[{i}]: the source ids [{s0}, {s1}) and the reader ids [{d0}, {d1}) differ",
                              span=i, row_index=row_index)
        covered.update(range(s0, s1))
    elig = eligible_positions(bs, ids_s)
    coverage = (sum(1 for p in elig if p in covered) / len(elig)) if elig else None
    return "verified", coverage


def _occurrences(hay: np.ndarray, pat: np.ndarray) -> list[int]:
    n, m = len(hay), len(pat)
    return [i for i in range(n - m + 1) if np.array_equal(hay[i:i + m], pat)]


def match_spans(reader_trace: Any, source_trace: Any) -> list[list[int]]:
    """token_spans="auto": each maximal run of the source's eligible output (its bound
    completion range minus excluded ids) searched as exact token ids in the reader's prompt
    (its bound stream before its completion; all of it without one). A run not found whole is
    trimmed by up to two boundary tokens per side, fewest trimmed tokens first; several
    placements at the first trim that finds any refuse as ambiguous, none at all as unmatched."""
    bs, ids_s = _side(source_trace)
    br, ids_r = _side(reader_trace)
    if bs is None or bs.completion is None or ids_s is None or br is None or ids_r is None:
        why = ("the source has no bound completion range" if bs is None or bs.completion is None
               else "a member's token ids were not retained")
        raise BundleError("bundle_relation_auto_spans_unavailable", f"fed_by token_spans='auto': {why}",
                          remedy="attach a token_boundary_v1 binding naming the source's completion range, on "
                                 "captures that saved their token ids (or give the spans yourself)", reason=why)
    prompt = ids_r[: (br.completion[0] if br.completion is not None else len(ids_r))]
    spans: list[list[int]] = []
    for a, b in _runs(eligible_positions(bs, ids_s)):
        found: list[tuple[int, int, int, int]] = []
        for total in range(5):
            for left in range(min(2, total) + 1):
                right = total - left
                s0, s1 = a + left, b - right
                if right > 2 or s1 <= s0:
                    continue
                found += [(s0, s1, p, p + s1 - s0) for p in _occurrences(prompt, ids_s[s0:s1])]
            if found:
                break
        if len(found) > 1:
            raise BundleError("bundle_relation_auto_spans_ambiguous",
                              f"the source's output [{a}, {b}) has {len(found)} placements in the reader's prompt",
                              remedy="give token_spans yourself for this row", placements=[list(f) for f in found[:8]])
        if not found:
            raise BundleError("bundle_relation_auto_spans_unmatched",
                              f"the source's output [{a}, {b}) is not in the reader's prompt",
                              remedy="check the rows' members (reader, then source), or relate without spans",
                              start=a, end=b)
        spans.append(list(found[0]))
    if not spans:
        raise BundleError("bundle_relation_auto_spans_unmatched", "the source's completion has no eligible tokens",
                          remedy="relate without spans")
    return spans


def settle(row: Any, members: Mapping[str, Any]) -> Any:
    """The row as stored: spans bounds-checked; a verified/matched claim re-checked and written
    as verified (with its computed coverage) or declared (evidence missing); a matched row
    stays matched only while the matcher finds the same spans; "auto" is matched here."""
    from torchlens.bundle.relations import MemberRelationRow

    if not isinstance(row, MemberRelationRow) or row.kind != "fed_by":
        return row
    reader, source = row.members
    params = dict(row.params)
    if params.get("token_spans") == "auto":
        params["token_spans"] = match_spans(members[reader], members[source])
        params["basis"] = "matched"
    spans = params.get("token_spans") or []
    if spans:
        check_bounds(members[reader], members[source], spans)
    if params.get("basis") not in ("verified", "matched"):
        return row
    basis, coverage = verify_spans(members[reader], members[source], spans)
    if basis == "verified" and params.get("basis") == "matched":
        try:
            same = match_spans(members[reader], members[source]) == [list(s) for s in spans]
        except BundleError:
            same = False
        basis = "matched" if same else "verified"
    params["basis"] = basis
    if basis != "declared":
        params.pop("coverage", None)
        if coverage is not None:
            params["coverage"] = coverage
    return MemberRelationRow(row.kind, row.members, params)


# token_pairs -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenPairs:
    """The verified one-to-one token positions of "reader fed_by source" (experimental).
    `pairs` are (source_pos, reader_pos), each position at most once; `coverage` is the paired
    share of the source's eligible tokens (None without a bound completion range);
    `excluded` lists what was not paired: dicts with side, start, end, reason, row_index."""

    reader: str
    source: str
    pairs: tuple[tuple[int, int], ...]
    coverage: float | None
    excluded: tuple[Mapping[str, Any], ...]

    @property
    def source_positions(self) -> list[int]:
        return [s for s, _ in self.pairs]

    @property
    def reader_positions(self) -> list[int]:
        return [r for _, r in self.pairs]


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for p in sorted(positions):
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def token_pairs(rows: list[Any], members: Mapping[str, Any], reader: str, source: str) -> TokenPairs:
    from torchlens.bundle.relations import MemberRelationRow

    rt, st = members[reader], members[source]  # KeyError for an unknown name
    bs, ids_s = _side(st)
    br, ids_r = _side(rt)
    excluded: list[dict[str, Any]] = []

    def note(side: str, positions: list[int], reason: str, row_index: int | None) -> None:
        for a, b in _runs(positions):
            excluded.append({"side": side, "start": a, "end": b, "reason": reason, "row_index": row_index})

    tok_mismatch = (bs is not None and br is not None and bs.tokenizer is not None and br.tokenizer is not None
                    and bs.tokenizer != br.tokenizer)
    candidates: list[tuple[int, int, int]] = []  # (source_pos, reader_pos, row_index)
    for i, row in enumerate(rows):
        if not (isinstance(row, MemberRelationRow) and row.kind == "fed_by" and row.members == (reader, source)):
            continue
        spans = row.params.get("token_spans") or []
        basis = row.params.get("basis")
        if basis in ("verified", "matched"):
            basis, _ = verify_spans(rt, st, spans, row_index=i)  # re-checked now; raises on contradiction
        for s0, s1, d0, d1 in spans:
            if basis != "verified" or tok_mismatch:
                reason = "tokenizer_mismatch" if tok_mismatch else "declared"
                note("source", list(range(s0, s1)), reason, i)
                note("reader", list(range(d0, d1)), reason, i)
                continue
            for k in range(s1 - s0):
                candidates.append((s0 + k, d0 + k, i))
    keep: list[tuple[int, int, int]] = []
    for s, r, i in candidates:
        if bs is not None and int(ids_s[s]) in bs.excluded_ids:
            note("source", [s], "excluded_id", i)
        elif br is not None and ids_r is not None and int(ids_r[r]) in br.excluded_ids:
            note("reader", [r], "excluded_id", i)
        else:
            keep.append((s, r, i))
    src_count: dict[int, int] = {}
    dst_count: dict[int, int] = {}
    for s, r, _ in keep:
        src_count[s] = src_count.get(s, 0) + 1
        dst_count[r] = dst_count.get(r, 0) + 1
    pairs: list[tuple[int, int]] = []
    for s, r, i in keep:
        if src_count[s] > 1 or dst_count[r] > 1:
            side = "source" if src_count[s] > 1 else "reader"
            note(side, [s if side == "source" else r], "claimed_twice", i)
        elif (s, r) not in pairs:
            pairs.append((s, r))
    pairs.sort()
    coverage = None
    if bs is not None and ids_s is not None and bs.completion is not None:
        elig = eligible_positions(bs, ids_s)
        paired = {s for s, _ in pairs}
        note("source", [p for p in elig if p not in paired], "uncovered", None)
        coverage = (sum(1 for p in elig if p in paired) / len(elig)) if elig else None
    return TokenPairs(reader, source, tuple(pairs), coverage, tuple(excluded))


# token_divergence ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenDivergence:
    """Where two members' prompts and completions part, by exact token ids (experimental)."""

    original: str
    rerun: str
    prompt_divergence: int | None
    completion_divergence: int | None
    lengths: tuple[tuple[int, int], tuple[int, int]]
    shared: tuple[tuple[int, int, int, int], ...]
    intervened: tuple[bool | None, bool | None]

    @property
    def prompt_same(self) -> bool:
        return self.prompt_divergence is None

    @property
    def completion_same(self) -> bool:
        return self.completion_divergence is None


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first position whose ids differ; the shorter length when one extends the other;
    None when equal."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    if diff.size:
        return int(diff[0])
    return None if len(a) == len(b) else n


def _parts(name: str, trace: Any) -> tuple[np.ndarray, np.ndarray, int]:
    def unavailable(reason: str) -> BundleError:
        return BundleError("bundle_token_divergence_unavailable", f"member {name!r}: {reason}",
                           remedy="attach a torchlens.boundary_facts token_boundary_v1 binding naming the member's "
                                  "completion range, on a capture that saved its token ids",
                           member=name, reason=reason)

    b, ids = _side(trace)
    if b is None:
        raise unavailable("no token-stream binding")
    if b.completion is None:
        raise unavailable("its binding names no completion range")
    if ids is None:
        raise unavailable("its token ids were not retained")
    if b.ids_digest is not None and b.ids_digest != ids_digest(ids):
        raise unavailable("its retained ids no longer match the binding's ids_digest")
    c0, c1 = b.completion
    return ids[:c0], ids[c0:c1], c0


def _intervened(trace: Any) -> bool | None:
    from torchlens.errors import TorchLensError

    try:
        pristine = trace.is_pristine
    except TorchLensError:
        return None
    return None if pristine is None else not pristine


def token_divergence(members: Mapping[str, Any], original: str, rerun: str) -> TokenDivergence:
    to, tr = members[original], members[rerun]  # KeyError for an unknown name
    po, co, c0o = _parts(original, to)
    pr, cr, c0r = _parts(rerun, tr)
    pd = first_difference(po, pr)
    cd = first_difference(co, cr)
    shared: list[tuple[int, int, int, int]] = []
    k = len(po) if pd is None else pd
    if k:
        shared.append((0, k, 0, k))
    if pd is not None:
        limit = min(len(po), len(pr)) - k
        t = 0
        while t < limit and po[len(po) - 1 - t] == pr[len(pr) - 1 - t]:
            t += 1
        if t:
            shared.append((len(po) - t, len(po), len(pr) - t, len(pr)))
    m = len(co) if cd is None else cd
    if m:
        shared.append((c0o, c0o + m, c0r, c0r + m))
    return TokenDivergence(original, rerun, pd, cd, ((len(po), len(co)), (len(pr), len(cr))), tuple(shared),
                           (_intervened(to), _intervened(tr)))


__all__ = ["TokenPairs", "TokenDivergence", "token_pairs", "token_divergence", "settle", "verify_spans",
           "first_difference", "match_spans"]
