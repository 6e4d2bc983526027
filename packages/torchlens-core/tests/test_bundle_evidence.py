"""Checked evidence items on relation rows (torchlens.bundle.evidence) on hand-built member
pairs (no ML framework): a "turn 2" trace whose input is (or is not) "turn 1"'s output. Every
expected grade, count and premise is written out by hand from how the members were built;
digests are computed here with hashlib, never by the code under test."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from torchlens.bundle import Bundle
from torchlens.bundle.guard import attach_snapshot
from torchlens.errors import ERROR_CODES, BundleError
from torchlens.viz.examples import example_trace


def _turns(offset=None):
    """turn1: the example mlp. turn2: the same model whose input_1 is turn1's linear_2_3 output
    (exactly, or plus `offset`) and whose relu_1_2 output is turn1's plus 1 (payloads are set
    by hand, so every other op's payload stays equal to turn1's)."""
    t1, t2 = example_trace("mlp"), example_trace("mlp")
    carried = np.array(t1._ops["linear_2_3"].out, copy=True)
    if offset is not None:
        carried = carried + np.float32(offset)
    t2._ops["input_1"].replace_outputs((carried.astype(np.float32),))
    relu = t2._ops["relu_1_2"]
    relu.replace_outputs((relu.out + np.float32(1.0),))
    return Bundle({"turn1": t1, "turn2": t2}, baseline="turn1")


def _ref(member, site):
    return {"member": member, "site": site}


# turn2's input is turn1's output (holds by construction)
CARRY_IN = {"class": "member_input", "at": _ref("later", "input_1"), "equals": _ref("earlier", "linear_2_3")}
# turn2's relu output equals turn1's: false (turn2's is turn1's plus 1)
SAME_RELU = {"class": "member_state", "at": _ref("later", "relu_1_2"), "equals": _ref("earlier", "relu_1_2")}
# turn1's input equals turn2's input: false
SAME_IN = {"class": "member_input", "at": _ref("later", "input_1"), "equals": _ref("earlier", "input_1")}


def _ev(*items, schema="turn_boundary_v1"):
    return {"schema": schema, "items": [dict(i) for i in items]}


def _one(b):
    (g,) = b.relation_grades()
    return g


def _state(b):
    return (b.relations, b.names)


def test_exact_carry_verifies_and_a_changed_payload_re_grades_when_read():
    b = _turns()
    b.relate("successor_of", "turn2", "turn1", carry_mode="verbatim", evidence=_ev(CARRY_IN))
    g = _one(b)
    assert (g.grade, g.broken_premises, g.unchecked_reasons) == ("verified", (), ())
    assert dict(g.items_by_class) == {"member_input": 1} and dict(g.items_by_grade) == {"verified": 1}
    assert g.exogenous_items == 0
    # the grade is computed when read, never stored: change turn2's input and it diverges
    op = b["turn2"]._ops["input_1"]
    op.replace_outputs((op.out + np.float32(1.0),))
    g = _one(b)
    assert (g.grade, g.broken_premises) == ("broken", ("bulk_origin_failure",))  # 1 of 1 checked items diverges
    assert "grade" not in b.relations[0].params["evidence"]["items"][0]          # nothing written back


def test_within_tolerance_is_consistent_and_outside_it_divergent():
    b = _turns(offset=1e-4)
    loose = {**CARRY_IN, "atol": 1e-3}
    tight = {**CARRY_IN, "atol": 1e-6, "rtol": 1e-6}
    b.relate("successor_of", "turn2", "turn1", evidence=_ev(loose))
    b.relate("successor_of", "turn2", "turn1", evidence=_ev(tight, CARRY_IN, {**loose, "atol": 2e-4},
                                                            {**loose, "atol": 1e-3}))
    g1, g2 = b.relation_grades()
    assert (g1.grade, dict(g1.items_by_grade)) == ("consistent", {"consistent": 1})
    # 2 of 4 checked member items diverge: not more than half, so divergent, not broken
    assert (g2.grade, g2.broken_premises, dict(g2.items_by_grade)) == ("divergent", (), {"divergent": 2,
                                                                                         "consistent": 2})


def test_a_shape_mismatch_diverges_whatever_the_tolerance():
    b = _turns()
    flat = np.asarray(b["turn2"]._ops["input_1"].out).reshape(8)  # same values, shape (8,) instead of (1, 8)
    b["turn2"]._ops["input_1"].replace_outputs((flat,))
    same_fc1 = {"class": "member_state", "at": _ref("later", "linear_1_1"), "equals": _ref("earlier", "linear_1_1")}
    b.relate("successor_of", "turn2", "turn1", evidence=_ev({**CARRY_IN, "atol": 1.0}, same_fc1))
    g = _one(b)
    assert (g.grade, dict(g.items_by_grade)) == ("divergent", {"divergent": 1, "verified": 1})


def test_a_minority_divergence_is_divergent_and_a_majority_is_broken_by_bulk_origin_failure():
    b = _turns()
    b.relate("successor_of", "turn2", "turn1", evidence=_ev(CARRY_IN, SAME_RELU))         # 1 of 2
    b.relate("successor_of", "turn2", "turn1", evidence=_ev(CARRY_IN, SAME_RELU, SAME_IN))  # 2 of 3
    g1, g2 = b.relation_grades()
    assert (g1.grade, g1.broken_premises, dict(g1.items_by_grade)) == ("divergent", (), {"verified": 1, "divergent": 1})
    assert (g2.grade, g2.broken_premises) == ("broken", ("bulk_origin_failure",))
    assert dict(g2.items_by_class) == {"member_input": 2, "member_state": 1}


def test_verbatim_carry_failure_needs_carry_mode_verbatim():
    b = _turns(offset=0.5)
    carry = {"class": "declared_carry", "at": _ref("later", "input_1"), "equals": _ref("earlier", "linear_2_3")}
    ok_member = {"class": "member_state", "at": _ref("earlier", "relu_1_2"), "equals": _ref("earlier", "relu_1_2")}
    b.relate("successor_of", "turn2", "turn1", carry_mode="verbatim", evidence=_ev(ok_member, carry))
    b.relate("successor_of", "turn2", "turn1", carry_mode="summarized", evidence=_ev(ok_member, carry))
    g1, g2 = b.relation_grades()
    assert (g1.grade, g1.broken_premises) == ("broken", ("verbatim_carry_failure",))
    assert (g2.grade, g2.broken_premises) == ("divergent", ())
    assert g1.exogenous_items == 1 and dict(g1.items_by_class) == {"member_state": 1, "declared_carry": 1}
    # the carried value checks out within a tolerance that covers the offset: consistent, not broken
    b2 = _turns(offset=0.5)
    b2.relate("successor_of", "turn2", "turn1", carry_mode="verbatim", evidence=_ev({**carry, "atol": 0.6}))
    assert _one(b2).grade == "consistent"


def test_a_divergence_at_a_declared_seam_is_counted_and_never_broken():
    b = _turns(offset=0.5)
    b.relate("successor_of", "turn2", "turn1", seams=["template"], carry_mode="verbatim",
             evidence=_ev({**CARRY_IN, "seam": "template"}))
    b.relate("successor_of", "turn2", "turn1", seams=["template"], carry_mode="verbatim",
             evidence=_ev(CARRY_IN))  # the same divergence, not at the seam
    carry = {"class": "declared_carry", "at": _ref("later", "input_1"), "equals": _ref("earlier", "linear_2_3"),
             "seam": "template"}
    b.relate("successor_of", "turn2", "turn1", seams=["template"], carry_mode="verbatim", evidence=_ev(carry))
    g1, g2, g3 = b.relation_grades()
    assert (g1.grade, g1.broken_premises, g1.seam_local_divergences) == ("divergent", (), 1)
    assert (g2.grade, g2.broken_premises, g2.seam_local_divergences) == ("broken", ("bulk_origin_failure",), 0)
    assert (g3.grade, g3.broken_premises, g3.seam_local_divergences) == ("divergent", (), 1)


def test_unsaved_payloads_and_live_params_are_unchecked_with_reasons():
    b = _turns()
    out = {"class": "member_output", "at": _ref("earlier", "output_1"), "equals": _ref("later", "input_1")}
    par = {"class": "member_params", "at": {"member": "later", "param": "fc1.weight"},
           "equals": {"member": "earlier", "param": "fc1.weight"}}
    b.relate("successor_of", "turn2", "turn1", evidence=_ev(out))  # example output_1 holds no payload
    b.relate("successor_of", "turn2", "turn1", evidence=_ev(par, schema="version_boundary_v1"))  # no snapshot
    b.relate("successor_of", "turn2", "turn1", evidence=_ev(CARRY_IN, out))  # one check ran and agrees
    b.relate("successor_of", "turn2", "turn1", evidence=_ev({"class": "harness_record", "grade": "verified"}, CARRY_IN))
    g1, g2, g3, g4 = b.relation_grades()
    assert (g1.grade, g1.unchecked_reasons, dict(g1.items_by_grade)) == ("unchecked", ("payload_not_saved",),
                                                                         {"unchecked": 1})
    assert (g2.grade, g2.unchecked_reasons) == ("unchecked", ("param_values_live",))
    assert (g3.grade, g3.unchecked_reasons) == ("consistent", ("payload_not_saved",))
    # an exogenous item stays disclosed (the user's grade kept under declared_grade), so not every item is verified
    assert (g4.grade, g4.exogenous_items, dict(g4.items_by_grade)) == ("consistent", 1, {"disclosed": 1,
                                                                                         "verified": 1})
    assert b.relations[3].params["evidence"]["items"][0]["declared_grade"] == "verified"


def test_param_claims_read_the_snapshot_and_digests_are_exact():
    b = _turns()
    w = np.arange(128, dtype=np.float32).reshape(16, 8)
    attach_snapshot(b["turn1"], {"fc1.weight": w.copy()})
    attach_snapshot(b["turn2"], {"fc1.weight": w.copy() + np.float32(1e-3)})
    par = {"class": "member_params", "at": {"member": "later", "param": "fc1.weight"},
           "equals": {"member": "earlier", "param": "fc1.weight"}}
    digest = hashlib.sha256(b"float32:16,8\n" + w.astype("<f4").tobytes()).hexdigest()
    dig = {"class": "member_params", "at": {"member": "earlier", "param": "fc1.weight"}, "sha256": digest}
    out = b["turn1"]._ops["linear_2_3"].out
    out_digest = hashlib.sha256(b"float32:1,8\n" + np.asarray(out).astype("<f4").tobytes()).hexdigest()
    site_dig = {"class": "member_output", "at": _ref("earlier", "linear_2_3"), "sha256": out_digest}
    b.relate("successor_of", "turn2", "turn1", evidence=_ev({**par, "atol": 1e-2}, dig, site_dig,
                                                            schema="version_boundary_v1"))
    b.relate("successor_of", "turn2", "turn1", evidence=_ev(dig, site_dig, schema="version_boundary_v1"))
    b.relate("successor_of", "turn2", "turn1", evidence=_ev({**dig, "at": {"member": "later", "param": "fc1.weight"}},
                                                            schema="version_boundary_v1"))
    g1, g2, g3 = b.relation_grades()
    assert (g1.grade, dict(g1.items_by_grade)) == ("consistent", {"consistent": 1, "verified": 2})
    assert g2.grade == "verified"
    assert (g3.grade, g3.broken_premises) == ("broken", ("bulk_origin_failure",))  # turn2's weights are not w


def test_save_load_keeps_the_items_and_re_grades_identically(tmp_path):
    b = _turns(offset=0.5)
    b.relate("successor_of", "turn2", "turn1", seams=["template"], carry_mode="verbatim",
             evidence=_ev({**CARRY_IN, "seam": "template"}, {**CARRY_IN, "atol": 0.6},
                          {"class": "declared_carry", "at": _ref("later", "input_1"),
                           "equals": _ref("earlier", "linear_2_3")},
                          {"class": "harness_record", "grade": "consistent"}))
    b.relate("selected_by", "turn2", "turn1", chosen=1, evidence=_ev(SAME_RELU, SAME_IN, schema="router_v1"))
    for name in ("turn1", "turn2"):  # hand-made capture-time snapshots (they travel in the bundle file)
        attach_snapshot(b[name], {a: np.full(tuple(p.shape), float(i), dtype=np.float32)
                                  for i, (a, p) in enumerate(b[name]._params.items())})
    par = {"class": "member_params", "at": {"member": "later", "param": "fc2.bias"},
           "equals": {"member": "earlier", "param": "fc2.bias"}}
    b.relate("successor_of", "turn2", "turn1", evidence=_ev(par, {**par, "at": {"member": "later",
                                                                              "param": "fc1.bias"}},
                                                            schema="version_boundary_v1"))
    before = b.relation_grades()
    assert [(g.grade, g.broken_premises) for g in before] == [("broken", ("verbatim_carry_failure",)),
                                                              ("broken", ("bulk_origin_failure",)),
                                                              ("divergent", ())]  # fc1.bias: 16 ones, fc2.bias: 8 threes
    assert before[0].seam_local_divergences == 1
    assert dict(before[0].items_by_grade) == {"divergent": 2, "consistent": 1, "disclosed": 1}
    for lazy in (False, True):
        loaded = Bundle.load(b.save(tmp_path / f"ev{lazy}"), lazy=lazy)
        assert loaded.relations == b.relations
        assert loaded.relation_grades() == before
        assert loaded.why("turn2").lineage_status == "broken"


@pytest.mark.parametrize("item, why", [
    ({"class": "harness_record", "at": _ref("later", "input_1"), "sha256": "0" * 64}, "never measured"),
    ({"class": "declared_transform", "at": _ref("later", "input_1"), "equals": _ref("earlier", "input_1")},
     "never measured"),
    ({"class": "member_input", "equals": _ref("earlier", "input_1")}, "under 'at'"),
    ({"class": "member_input", "at": _ref("later", "input_1")}, "exactly one of"),
    ({**CARRY_IN, "sha256": "0" * 64}, "exactly one of"),
    ({**CARRY_IN, "at": _ref("self", "input_1")}, "'later' or 'earlier'"),
    ({**CARRY_IN, "at": {"member": "later", "param": "fc1.weight"}}, "'site'"),
    ({"class": "member_params", "at": _ref("later", "input_1"), "sha256": "0" * 64}, "'param'"),
    ({**CARRY_IN, "at": {"member": "later", "site": ""}}, "non-empty"),
    ({"class": "member_input", "at": _ref("later", "input_1"), "sha256": "XYZ"}, "64 lowercase hex"),
    ({"class": "member_input", "at": _ref("later", "input_1"), "sha256": "0" * 64, "atol": 0.1}, "exact"),
    ({**CARRY_IN, "atol": -1.0}, "finite number"),
    ({**CARRY_IN, "rtol": float("inf")}, "plain JSON"),  # refused by the JSON check already
    ({**CARRY_IN, "atol": "0.1"}, "finite number"),
])
def test_malformed_claims_refuse_before_the_table_changes(item, why):
    b = _turns()
    b.relate("successor_of", "turn2", "turn1")
    before = _state(b)
    with pytest.raises(BundleError) as e:
        b.relate("successor_of", "turn2", "turn1", evidence={"schema": "mine", "items": [item]})
    assert e.value.code == "bundle_relation_schema_invalid" and why in e.value.message, e.value.message
    assert e.value.remedy and _state(b) == before


@pytest.mark.parametrize("ref, missing", [(_ref("earlier", "linear_9_9"), "linear_9_9"),
                                          ({"member": "later", "param": "fc9.weight"}, "fc9.weight")])
def test_a_claim_naming_a_site_the_member_lacks_refuses(ref, missing):
    b = _turns()
    cls = "member_params" if "param" in ref else "member_state"
    before = _state(b)
    with pytest.raises(BundleError) as e:
        b.relate("successor_of", "turn2", "turn1", evidence=_ev({"class": cls, "at": ref, "sha256": "0" * 64},
                                                                   schema="version_boundary_v1"))
    assert e.value.code == "bundle_relation_evidence_site_missing" and e.value.fields["missing"] == missing
    assert e.value.remedy and "bundle_relation_evidence_site_missing" in ERROR_CODES and _state(b) == before


def test_a_tampered_claim_refuses_on_load(tmp_path):
    b = _turns()
    b.relate("successor_of", "turn2", "turn1", evidence=_ev(CARRY_IN))
    path = b.save(tmp_path / "ev")
    body = json.loads((path / "relations.json").read_text())
    body["rows"][0]["params"]["evidence"]["items"][0]["equals"]["site"] = "linear_9_9"
    data = (json.dumps(body) + "\n").encode()
    (path / "relations.json").write_bytes(data)
    m = json.loads((path / "manifest.json").read_text())  # an attacker who recomputes the digest
    m["files"]["relations.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError) as e:
        Bundle.load(path)
    assert e.value.code == "bundle_relation_evidence_site_missing"
