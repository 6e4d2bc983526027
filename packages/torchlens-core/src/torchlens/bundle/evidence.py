"""Checked evidence items for relation rows (experimental).

An evidence item of a member-measured class (member_input, member_output, member_state,
member_params) may carry a CLAIM that TorchLens checks against the members' saved values
every time a grade is read (`Bundle.relation_grades`); the result is never stored. A
declared_carry item may carry the same claim when it names member values; the other
exogenous classes (declared_transform, harness_record) are never measured.

Item format (keys besides `class`, `seam`, `grade` and free notes)::

    {"class": "member_input",
     "at": {"member": "later", "site": "input_1"},         # the value the claim is about
     "equals": {"member": "earlier", "site": "linear_2_3"},  # ... equals this other value
     "atol": 1e-6, "rtol": 0.0}                            # optional tolerance

or `"sha256": "<64 hex>"` instead of `equals` (the value's `value_digest`). A ref names the
row's `"later"` member (members[0]) or its `"earlier"` one (members[1]) and either a
`site` (an op label: the op's saved output payload; several output slots are read as one
flat vector) or, for member_params only, a `param` address (read from the member's
capture-time parameter snapshot; a live reference is never read).

Item grades: same shape and equal values -> verified; otherwise within `atol`/`rtol` (as
`numpy.allclose`, NaN equal to NaN) when a tolerance is given -> consistent; otherwise
divergent (a shape mismatch is divergent). A digest claim is exact: verified or divergent.
A value that cannot be read makes the item unchecked with a reason: `payload_not_saved`,
`site_missing`, `param_values_live` (no snapshot), `param_missing`. An item with no claim
and no stored grade is unchecked with reason `item_has_no_claim`; a stored grade (always
`disclosed`, the user's original under `declared_grade`) stays disclosed.

The row grade then follows the ladder in `grade_items`.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any, Mapping

import numpy as np

MEMBER_CLASSES = ("member_input", "member_output", "member_state", "member_params")
CHECKABLE_CLASSES = MEMBER_CLASSES + ("declared_carry",)
ROLES = ("later", "earlier")
CLAIM_KEYS = ("at", "equals", "sha256", "atol", "rtol")
_HEX = re.compile(r"^[0-9a-f]{64}$")


def value_digest(value: Any) -> str:
    """sha256 (hex) of `"<dtype name>:<comma-joined shape>\\n"` (UTF-8) followed by the
    array's values as little-endian bytes in C order, e.g. "float32:1,16\\n" + bytes."""
    a = np.asarray(value)
    head = f"{a.dtype.name}:{','.join(str(n) for n in a.shape)}\n".encode("utf-8")
    body = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()
    return hashlib.sha256(head + body).hexdigest()


def check_claim(i: int, item: Mapping[str, Any], bad: Any) -> None:
    """Structural check of one item's claim keys (relate and load); `bad(why, item=i)` makes
    the bundle_relation_schema_invalid error."""
    if not any(k in item for k in CLAIM_KEYS):
        return
    cls = item.get("class")
    if cls not in CHECKABLE_CLASSES:
        raise bad(f"evidence item {i}: a claim (at/equals/sha256) needs a class of {CHECKABLE_CLASSES}; "
                  f"{cls!r} is never measured", item=i)
    if "at" not in item:
        raise bad(f"evidence item {i}: a claim names the value it is about under 'at'", item=i)
    if ("equals" in item) == ("sha256" in item):
        raise bad(f"evidence item {i}: a claim has exactly one of 'equals' (another value) or 'sha256' (a digest)",
                  item=i)
    want = "param" if cls == "member_params" else "site"
    for key in ("at", "equals"):
        if key not in item:
            continue
        ref = item[key]
        if not (isinstance(ref, Mapping) and set(ref) == {"member", want}):
            raise bad(f"evidence item {i}: {key!r} is a mapping {{'member': 'later'|'earlier', {want!r}: name}} "
                      f"for class {cls!r}", item=i)
        if ref["member"] not in ROLES:
            raise bad(f"evidence item {i}: {key}.member must be 'later' or 'earlier'", item=i)
        if not (type(ref[want]) is str and ref[want]):
            raise bad(f"evidence item {i}: {key}.{want} must be a non-empty string", item=i)
    if "sha256" in item:
        if not (type(item["sha256"]) is str and _HEX.match(item["sha256"])):
            raise bad(f"evidence item {i}: sha256 must be 64 lowercase hex characters", item=i)
        if "atol" in item or "rtol" in item:
            raise bad(f"evidence item {i}: a digest claim is exact; atol/rtol go with 'equals'", item=i)
    for key in ("atol", "rtol"):
        v = item.get(key)
        if v is not None and not (type(v) in (int, float) and math.isfinite(v) and v >= 0):
            raise bad(f"evidence item {i}: {key} must be a finite number >= 0", item=i)


def check_sites(row: Any, members: Mapping[str, Any]) -> None:
    """Every site and param a row's claims name exists in its member (relate and load)."""
    from torchlens.errors import BundleError

    evidence = row.params.get("evidence")
    items = evidence.get("items") if isinstance(evidence, Mapping) else None
    for i, item in enumerate(items or ()):
        for key in ("at", "equals"):
            ref = item.get(key)
            if not isinstance(ref, Mapping):
                continue
            name = row.members[ROLES.index(ref["member"])]
            trace = members[name]
            if "site" in ref and ref["site"] not in trace._ops:
                missing, what = ref["site"], "site"
            elif "param" in ref and ref["param"] not in trace._params:
                missing, what = ref["param"], "param"
            else:
                continue
            raise BundleError("bundle_relation_evidence_site_missing",
                              f"{row.kind} evidence item {i}: {key} names {what} {missing!r}, which member "
                              f"{name!r} does not have",
                              remedy="name an op label (site) or parameter address (param) of that member",
                              kind=row.kind, item=i, member=name, missing=missing)


def _value(row: Any, members: Mapping[str, Any], ref: Mapping[str, Any]) -> tuple[np.ndarray | None, str | None]:
    from torchlens.bundle.align import joined, payload_arrays
    from torchlens.bundle.guard import snapshot_of

    trace = members[row.members[ROLES.index(ref["member"])]]
    if "param" in ref:
        snap = snapshot_of(trace)
        if snap is None:
            return None, "param_values_live"
        if ref["param"] not in snap:
            return None, "param_missing"
        return np.asarray(snap[ref["param"]]), None
    op = trace._ops.get(ref["site"])
    if op is None:
        return None, "site_missing"
    arrays = payload_arrays(trace, op, "out")
    if arrays is None:
        return None, "payload_not_saved"
    return np.asarray(joined(arrays)), None


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    nan = a.dtype.kind in "fc" and b.dtype.kind in "fc"
    return bool(np.array_equal(a, b, equal_nan=nan))


def check_item(row: Any, members: Mapping[str, Any], item: Mapping[str, Any]) -> tuple[str, str | None]:
    """(grade, unchecked reason or None) of one item, computed now."""
    if "at" not in item:
        stored = item.get("grade")
        return (stored, None) if stored is not None else ("unchecked", "item_has_no_claim")
    a, why = _value(row, members, item["at"])
    if a is None:
        return "unchecked", why
    if "sha256" in item:
        return ("verified" if value_digest(a) == item["sha256"] else "divergent"), None
    b, why = _value(row, members, item["equals"])
    if b is None:
        return "unchecked", why
    if a.shape != b.shape:
        return "divergent", None
    if _equal(a, b):
        return "verified", None
    if "atol" in item or "rtol" in item:
        try:
            close = bool(np.allclose(a, b, rtol=float(item.get("rtol", 0.0)), atol=float(item.get("atol", 0.0)),
                                     equal_nan=True))
        except TypeError:  # values allclose cannot compare (strings, objects): not within any tolerance
            close = False
        if close:
            return "consistent", None
    return "divergent", None


def grade_items(row: Any, items: list[Mapping[str, Any]], members: Mapping[str, Any] | None) -> dict[str, Any]:
    """The row grade from its items, by the glossary's ladder:

    - no items, or every item disclosed -> disclosed;
    - any divergent item -> divergent, raised to broken in exactly two cases (broken_premises):
      bulk_origin_failure (more than half of the checked member-measured items diverge, not
      counting divergences at a declared seam) and verbatim_carry_failure (carry_mode="verbatim"
      with a divergent declared_carry item not at a declared seam); a divergent item at a
      declared seam is counted in seam_local_divergences and never raises the row to broken;
    - no check ran (no item verified, consistent or divergent) -> unchecked, with the reasons;
    - every item verified -> verified; otherwise (every check that ran agrees, not all
      proven exact: a tolerance was used, or other items are disclosed/unchecked) -> consistent.
    """
    seams = set(row.params.get("seams") or ())
    graded = []
    for item in items:
        if members is None:
            g, why = (item.get("grade"), None) if item.get("grade") is not None else ("unchecked", "item_has_no_claim")
            if "at" in item:
                g, why = "unchecked", "members_unavailable"
        else:
            g, why = check_item(row, members, item)
        graded.append((item, g, why))
    by_class: dict[str, int] = {}
    by_grade: dict[str, int] = {}
    reasons: list[str] = []
    for item, g, why in graded:
        cls = item.get("class")
        if cls is not None:
            by_class[cls] = by_class.get(cls, 0) + 1
        by_grade[g] = by_grade.get(g, 0) + 1
        if why is not None and why not in reasons:
            reasons.append(why)
    checked = [(i, g) for i, g, _ in graded if g in ("verified", "consistent", "divergent")]
    divergent = [i for i, g in checked if g == "divergent"]
    at_seam = [i for i in divergent if i.get("seam") is not None and i.get("seam") in seams]
    out: dict[str, Any] = dict(items_by_class=by_class, items_by_grade=by_grade, unchecked_reasons=tuple(reasons),
                               seam_local_divergences=len(at_seam), broken_premises=())
    if not items or set(by_grade) == {"disclosed"}:
        out.update(grade="disclosed", unchecked_reasons=())
        return out
    if divergent:
        premises = []
        member_checked = [i for i, _ in checked if i.get("class") in MEMBER_CLASSES]
        member_div = [i for i in divergent if i.get("class") in MEMBER_CLASSES and not any(i is s for s in at_seam)]
        if member_checked and 2 * len(member_div) > len(member_checked):
            premises.append("bulk_origin_failure")
        if row.params.get("carry_mode") == "verbatim" and any(
                i.get("class") == "declared_carry" and not any(i is s for s in at_seam) for i in divergent):
            premises.append("verbatim_carry_failure")
        out.update(grade="broken" if premises else "divergent", broken_premises=tuple(premises))
        return out
    if not checked:
        out["grade"] = "unchecked"
        return out
    out["grade"] = "verified" if by_grade.get("verified", 0) == len(graded) else "consistent"
    return out


__all__ = ["value_digest", "check_item", "grade_items", "check_claim", "check_sites", "MEMBER_CLASSES",
           "CHECKABLE_CLASSES"]
