"""Bundle.why / Bundle.provenance / Bundle.episode_status on framework-free example traces.

Expected values are written by hand here: chains as hop lists, residuals with pure-Python
loops over the payloads (no NumPy linear algebra), fold results from the rule as stated in
docs/reference/experiments.md. Every refusal is checked to leave the bundle unchanged.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from torchlens.bundle import Bundle, EpisodeFoldResult, OpaqueRelationRow, WhyReport, attach_sidecar
from torchlens.errors import ERROR_CODES, BundleError, InvalidArgumentError, TorchLensError
from torchlens.viz.examples import example_trace


def _floats(x) -> list[float]:
    return [float(v) for v in np.asarray(x).reshape(-1).tolist()]


def hand_rel_l2(a, b) -> float:
    a, b = _floats(a), _floats(b)
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b))) / max(math.sqrt(sum(x * x for x in a)), 1e-12)


def _state(b: Bundle) -> tuple:
    return (b.relations, b.names, tuple(id(t) for t in b.members.values()), b._baseline, tuple(b.stored_comparison_names()))


def _edited(scale_relu=0.5, noise_at_fc2=None):
    """A clean mlp trace and a copy whose relu output is scaled and whose fc2 output gets
    noise (seeded by `noise_at_fc2`) added (the example's output_1 holds no payload)."""
    a, b = example_trace("mlp"), example_trace("mlp")
    op = b._ops["relu_1_2"]
    op.replace_outputs((op.out * np.float32(scale_relu),))
    if noise_at_fc2 is not None:
        op = b._ops["linear_2_3"]
        noise = np.random.default_rng(noise_at_fc2).standard_normal(op.out.shape) * 3.0
        op.replace_outputs((op.out + noise.astype(op.out.dtype),))
    return a, b


def _refuses(b: Bundle, code: str, fn, *args, **kwargs) -> TorchLensError:
    before = _state(b)
    with pytest.raises(TorchLensError) as e:
        fn(*args, **kwargs)
    assert e.value.code == code, (e.value.code, code)
    assert e.value.remedy and code in ERROR_CODES
    assert _state(b) == before  # nothing changed
    return e.value


# why: the four axes --------------------------------------------------------------------------
def test_why_on_unrelated_members_reports_each_axis_from_the_payloads():
    clean, edited = _edited(0.5, noise_at_fc2=7)
    b = Bundle({"clean": clean, "edited": edited})
    rep = b.why("edited")
    assert isinstance(rep, WhyReport)
    assert (rep.member, rep.relative_to) == ("edited", "clean")  # the baseline (first pristine member)
    # lineage: no row joins them
    assert (rep.lineage_status, rep.direction, rep.chain) == ("none", None, ())
    # payload fidelity: 5 aligned ops, output_1 saved in neither
    fid = rep.payload_fidelity
    assert (fid.status, fid.shared_sites, fid.saved_in_both) == ("partial", 5, 4)
    assert dict(fid.missing) == {"clean": ("output_1",), "edited": ("output_1",)}
    assert fid.direct_writes == () and dict(fid.outcomes) == {"clean": "UNATTESTED", "edited": "UNATTESTED"}
    # value residual: the largest hand relative_l2 over the four saved sites, anchored on clean
    hand = {lbl: hand_rel_l2(clean._ops[lbl].out, edited._ops[lbl].out)
            for lbl in ("input_1", "linear_1_1", "relu_1_2", "linear_2_3")}
    assert hand["input_1"] == hand["linear_1_1"] == 0.0 and hand["relu_1_2"] == pytest.approx(0.5)
    site = max(hand, key=hand.get)
    assert site == "linear_2_3" and hand[site] > 0.5  # the noise at fc2 dominates the halving
    res = rep.value_residual
    assert (res.metric, res.site, res.sites, res.output, res.reason) == ("relative_l2", site, 4, None, None)
    assert res.max == pytest.approx(hand[site], rel=1e-6)
    # ... and it is the largest row of the published compare
    assert res.max == max(dict(b.compare("clean", "edited", metric="relative_l2")).values())
    # comparability: the gate's grade, exactly as b.comparability reads it
    assert rep.comparability == b.comparability("clean", "edited")
    assert rep.comparability.grade == "same_inputs" and rep.comparability.comparable


def test_why_residual_ties_pick_the_first_site_and_outputs_are_read_when_saved():
    clean, edited = _edited(0.5)  # only relu changes: 0.5 away
    out = np.array([[1.0, -2.0]], np.float32)
    clean._ops["output_1"].replace_outputs((out,))
    edited._ops["output_1"].replace_outputs((out * np.float32(0.25),))
    rep = Bundle({"clean": clean, "edited": edited}).why("edited")
    # output residual by hand: |o - o/4| / |o| = 0.75, larger than relu's 0.5
    assert rep.value_residual.output == pytest.approx(0.75)
    assert rep.value_residual.max == pytest.approx(0.75) and rep.value_residual.site == "output_1"
    assert rep.payload_fidelity.status == "complete" and rep.payload_fidelity.saved_in_both == 5
    tie_a, tie_b = _edited(0.5)
    op = tie_b._ops["linear_2_3"]
    ref = tie_a._ops["linear_2_3"].out
    op.replace_outputs((ref * np.float32(0.5),))  # exactly 0.5 away too: the tie goes to relu_1_2 (execution order)
    rep = Bundle({"a": tie_a, "b": tie_b}).why("b")
    assert rep.value_residual.site == "relu_1_2" and rep.value_residual.max == pytest.approx(0.5)


def test_why_of_the_reference_itself_and_relative_to():
    clean, edited = _edited(2.0)
    b = Bundle({"clean": clean, "edited": edited})
    me = b.why("clean")
    assert (me.lineage_status, me.direction, me.chain, me.comparability) == ("self", None, (), None)
    assert me.value_residual.max is None and me.value_residual.reason == "the member is the reference"
    assert dict(me.payload_fidelity.missing) == {"clean": ("output_1",)}
    flipped = b.why("clean", relative_to="edited")
    assert flipped.relative_to == "edited"
    # anchored on edited now: |2r - r| / |2r| = 0.5 at relu
    assert flipped.value_residual.site == "relu_1_2" and flipped.value_residual.max == pytest.approx(0.5)
    assert flipped.comparability == b.comparability("edited", "clean")


def test_why_flags_direct_writes_and_failed_captures():
    clean, edited = _edited(0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        edited._ops["linear_1_1"].out = edited._ops["linear_1_1"].out * 0  # a direct write
    edited.annotations["partial"] = True
    b = Bundle({"clean": clean, "edited": edited})
    fid = b.why("edited").payload_fidelity
    assert fid.direct_writes == ("edited",)
    assert dict(fid.outcomes) == {"clean": "UNATTESTED", "edited": "FAILED"}


# why: lineage chains -----------------------------------------------------------------------------
def _family():
    names = ("base", "ft", "ft2", "cf", "other")
    b = Bundle({n: example_trace("mlp") for n in names}, baseline="base")
    b.relate("successor_of", "ft", "base")
    b.relate("forked_from", "ft2", "ft", label="lr sweep")
    b.relate("alternative_of", "cf", "ft2")
    return b


def _hops(rep):
    return [(h.frm, h.to, h.step, h.rows, h.kinds, h.grades) for h in rep.chain]


def test_why_chain_is_the_hand_written_path_of_rows():
    b = _family()
    rep = b.why("cf")
    assert _hops(rep) == [("cf", "ft2", "peer", (2,), ("alternative_of",), ("disclosed",)),
                          ("ft2", "ft", "up", (1,), ("forked_from",), ("disclosed",)),
                          ("ft", "base", "up", (0,), ("successor_of",), ("disclosed",))]
    assert (rep.lineage_status, rep.direction) == ("disclosed", "descends_from")
    down = b.why("base", relative_to="ft2")
    assert _hops(down) == [("base", "ft", "down", (0,), ("successor_of",), ("disclosed",)),
                           ("ft", "ft2", "down", (1,), ("forked_from",), ("disclosed",))]
    assert down.direction == "ancestor_of"
    peer = b.why("cf", relative_to="ft2")
    assert (peer.direction, len(peer.chain)) == ("peer", 1)
    # an ordered pair: the gate refuses, so no residual is computed, and the reason says so
    ft = b.why("ft")
    assert ft.comparability.grade == "ordered" and not ft.comparability.comparable
    assert ft.value_residual.max is None and ft.value_residual.reason.startswith("bundle_gate_ordered")
    assert ft.payload_fidelity.status == "partial"  # presence is read even when values are not compared
    # a member no row joins
    assert b.why("other").lineage_status == "none"


def test_two_rows_on_one_hop_are_one_hop_and_the_weakest_grade_wins():
    b = _family()
    b.relate("fed_by", "ft", "base")
    b.relate("successor_of", "ft2", "ft", evidence={"schema": "mine", "items": [{"note": "no grade"}]})
    rep = b.why("ft2")
    assert _hops(rep) == [("ft2", "ft", "up", (1, 4), ("forked_from", "successor_of"), ("disclosed", "unchecked")),
                          ("ft", "base", "up", (0, 3), ("successor_of", "fed_by"), ("disclosed", "disclosed"))]
    assert rep.lineage_status == "unchecked"


FAMILY = "torchlens.boundary_facts"
DRAFT = [1, 2, 3, 40, 41, 0, 42, 43]
CRITIQUE = [9, 9, 40, 41, 0, 7, 42, 43, 50, 51]


def _token_member(ids, completion, **facts):
    t = example_trace("mlp")
    t._ops["input_1"].replace_outputs((np.array([ids], dtype=np.int64),))
    attach_sidecar(t, FAMILY, {"completion": completion, **facts})
    return t


def test_lineage_reads_verified_and_divergent_rows():
    b = Bundle({"draft": _token_member(DRAFT, [3, 8], excluded_ids=[0]), "critique": _token_member(CRITIQUE, [8, 10])},
               baseline="draft")
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 6, 2, 5]], basis="verified")
    rep = b.why("critique")
    assert rep.lineage_status == "verified" and rep.chain[0].grades == ("verified",)
    changed = list(CRITIQUE)
    changed[3] = 77  # the quoted ids no longer match: the row re-grades divergent when read
    b["critique"]._ops["input_1"].replace_outputs((np.array([changed], dtype=np.int64),))
    assert b.why("critique").lineage_status == "divergent"


# why: refusals -----------------------------------------------------------------------------------
def test_why_refuses_when_no_chain_is_exact_and_changes_nothing():
    b = _family()
    b.add("ft_b", example_trace("mlp"))
    b.relate("successor_of", "ft_b", "base")
    err = _refuses(b, "bundle_why_lineage_indirect", b.why, "ft_b", relative_to="ft")  # siblings
    assert err.fields["shared"] == ["base"]
    # a diamond: two paths from d to base
    b.add("d", example_trace("mlp"))
    b.relate("fed_by", "d", "ft")
    b.relate("fed_by", "d", "ft_b")
    err = _refuses(b, "bundle_why_lineage_ambiguous", b.why, "d")
    assert sorted(err.fields["paths"]) == ["d -up-> ft ; ft -up-> base", "d -up-> ft_b ; ft_b -up-> base"]
    assert b.why("d", relative_to="ft").chain[0].kinds == ("fed_by",)  # one exact path to ft
    # only an unregistered kind joins these two
    b.add("x", example_trace("mlp"))
    b.relate(OpaqueRelationRow("acme.reviewed", ("x", "other")))
    _refuses(b, "bundle_why_lineage_opaque", b.why, "x", relative_to="other")
    assert isinstance(_refuses(b, "bundle_member_unknown", b.why, "nope"), InvalidArgumentError)
    _refuses(b, "bundle_member_unknown", b.why, "ft", relative_to="nope")


def test_why_without_a_baseline_refuses_instead_of_guessing():
    touched, other = example_trace("mlp"), example_trace("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in (touched, other):
            t._ops["relu_1_2"].out = t._ops["relu_1_2"].out * 0  # a direct write: not pristine
    b = Bundle({"touched": touched, "other": other})
    assert b.baseline is None
    _refuses(b, "bundle_why_baseline_missing", b.why, "touched")
    _refuses(b, "bundle_why_baseline_missing", b.provenance.summary)
    assert b.why("touched", relative_to="other").relative_to == "other"


# provenance ---------------------------------------------------------------------------------------
def test_provenance_summary_is_why_per_member_with_refusals_as_rows():
    b = _family()
    b.add("ft_b", example_trace("mlp"))
    b.relate("successor_of", "ft_b", "base")
    before = _state(b)
    summary = b.provenance.summary()
    assert _state(b) == before
    assert summary.relative_to == "base" and [r.member for r in summary] == list(b.names)
    for row in summary:
        rep = b.why(row.member)
        assert row.report == rep
        assert (row.lineage_status, row.direction, row.chain, row.payload_fidelity, row.value_residual) == (
            rep.lineage_status, rep.direction, tuple(str(h) for h in rep.chain), rep.payload_fidelity.status,
            rep.value_residual.max)
    flat = {d["member"]: d for d in summary.as_dicts()}
    assert flat["cf"]["chain"] == ("cf -[alternative_of:peer]-> ft2", "ft2 -[forked_from:up]-> ft",
                                   "ft -[successor_of:up]-> base")
    assert (flat["base"]["lineage_status"], flat["base"]["comparability"]) == ("self", None)
    assert (flat["other"]["lineage_status"], flat["other"]["comparability"], flat["other"]["comparable"]) == (
        "none", "same_inputs", True)
    # relative to ft: ft_b is ft's sibling, so its row carries the refusal code and no facts
    rows = {r.member: r for r in b.provenance.summary(relative_to="ft")}
    assert (rows["ft_b"].error_code, rows["ft_b"].lineage_status, rows["ft_b"].report) == (
        "bundle_why_lineage_indirect", None, None)
    assert rows["base"].direction == "ancestor_of" and rows["ft2"].direction == "descends_from"
    assert Bundle().provenance.summary() == ()


# episode_status -----------------------------------------------------------------------------------
def _episode(outcomes=("COMPLETE", "COMPLETE", "COMPLETE")):
    b = Bundle({f"turn{i}": example_trace("mlp") for i in range(len(outcomes))})
    b.add("unrelated", example_trace("mlp"))
    for i, status in enumerate(outcomes):
        t = b[f"turn{i}"]
        if status == "FAILED":
            t.annotations["partial"] = True
        elif status is not None:
            t.provenance.extra["outcome"] = status
    b.relate("episode_member", "turn1", episode_id="ep1")
    b.relate("episode_member", "turn0", episode_id="ep1", label="first")
    b.relate("episode_member", "turn1", episode_id="ep1")  # a repeated row names the member once
    b.relate("episode_member", "turn2", episode_id="ep1")
    b.relate("episode_member", "unrelated", episode_id=1)  # another episode: the int 1, not "ep1"
    return b


def _ledger(**statuses):
    return {"episode_id": "ep1", "rows": [{"member": m, "status": s} for m, s in statuses.items()]}


def test_episode_without_a_ledger_falls_back_to_episode_unknown():
    b = _episode()
    before = _state(b)
    res = b.episode_status("ep1")
    assert isinstance(res, EpisodeFoldResult)
    assert (res.status, res.record, res.fallback, res.ledger_rows) == ("episode_unknown", False, True, None)
    assert res.members == ("turn1", "turn0", "turn2")  # table order, each once; the other episode's member left out
    assert dict(res.member_outcomes) == {"turn1": "COMPLETE", "turn0": "COMPLETE", "turn2": "COMPLETE"}
    assert _state(b) == before  # never stored
    # a failed capture needs no record
    failed = _episode(("COMPLETE", "FAILED", None)).episode_status("ep1")
    assert (failed.status, failed.fallback) == ("episode_failed", False)
    assert dict(failed.member_outcomes)["turn1"] == "FAILED" and dict(failed.member_outcomes)["turn2"] == "UNATTESTED"
    assert _episode(("COMPLETE",) * 3).episode_status(1).members == ("unrelated",)


@pytest.mark.parametrize("statuses, outcomes, want", [
    ({"turn0": "complete", "turn1": "complete", "turn2": "complete"}, ("COMPLETE",) * 3, "episode_complete"),
    ({"turn0": "complete", "turn1": "complete", "turn2": "complete"}, ("COMPLETE", None, "STOPPED"), "episode_complete"),
    ({"turn0": "complete", "turn1": "complete", "turn2": "complete", "turn3": "absent"}, ("COMPLETE",) * 3,
     "episode_incomplete"),
    ({"turn0": "complete", "turn1": "interrupted", "turn2": "complete", "turn3": "absent"}, ("COMPLETE",) * 3,
     "episode_interrupted"),
    ({"turn0": "complete", "turn1": "interrupted", "turn2": "complete"}, ("COMPLETE", "COMPLETE", "FAILED"),
     "episode_failed"),
])
def test_episode_fold_with_a_ledger(statuses, outcomes, want):
    b = _episode(outcomes)
    res = b.episode_status("ep1", episode_ledger=_ledger(**statuses))
    assert (res.status, res.record, res.fallback) == (want, True, False)
    assert dict(res.ledger_rows) == statuses


@pytest.mark.parametrize("ledger", [
    {"episode_id": "ep2", "rows": []},                                              # another episode
    {"episode_id": 1, "rows": []},                                                  # the int, not the string
    {"rows": [{"member": "turn0", "status": "complete"}]},                          # turn1, turn2 unlisted
    {"rows": [{"member": m, "status": "complete"} for m in ("turn0", "turn1", "turn2", "turn0")]},  # listed twice
    {"rows": [{"member": m, "status": "done"} for m in ("turn0", "turn1", "turn2")]},  # not a row status
    {"rows": [{"member": "turn0", "status": "complete"}, {"member": "turn1", "status": "complete"},
              {"member": "turn2", "status": "absent"}]},                            # absent, yet a member
    {"rows": [{"member": m, "status": "complete"} for m in ("turn0", "turn1", "turn2", "unrelated")]},  # other episode
    {"rows": [{"member": m, "status": "complete"} for m in ("turn0", "turn1", "turn2", "ghost")]},  # not held
    {"rows": [{"member": "turn0", "status": "complete", "step": 0}]},              # extra key
    {"episode_id": "ep1", "rows": [], "status": "complete"},                        # extra top-level key
    [("turn0", "complete")],                                                        # not a mapping
])
def test_episode_ledger_refusals(ledger):
    b = _episode()
    err = _refuses(b, "bundle_episode_ledger_invalid", b.episode_status, "ep1", episode_ledger=ledger)
    assert err.code == "bundle_episode_ledger_invalid" and err.remedy
    # the refusal folded nothing: without a ledger the episode still reads as unknown
    assert b.episode_status("ep1").status == "episode_unknown"


def test_episode_unknown_id_refuses():
    b = _episode()
    err = _refuses(b, "bundle_episode_id_unknown", b.episode_status, "ep9")
    assert err.fields["known"] == ["'ep1'", "1"]
    _refuses(b, "bundle_episode_id_unknown", b.episode_status, "1")  # the string, not the int
    _refuses(b, "bundle_episode_id_unknown", b.episode_status, True)  # True == 1 in Python, but not an id match
    # the ledger's episode_id is matched by type and value too
    _refuses(b, "bundle_episode_ledger_invalid", b.episode_status, 1,
             episode_ledger={"episode_id": True, "rows": [{"member": "unrelated", "status": "complete"}]})
    assert b.episode_status(1, episode_ledger={"episode_id": 1, "rows": [{"member": "unrelated", "status": "complete"}]
                                               }).status == "episode_complete"
    _refuses(b, "invalid_argument", b.episode_status, ["ep1"])
    with pytest.raises(BundleError):
        Bundle().episode_status("ep1")


def test_why_reads_the_same_after_save_and_load_and_nothing_extra_is_saved(tmp_path):
    b = _family()
    b.relate("episode_member", "ft", episode_id="e")
    before = b.why("cf")
    b.save(tmp_path / "plain.tlbundle")
    b.provenance.summary()
    b.episode_status("e")
    b.save(tmp_path / "after.tlbundle")
    # reading why / provenance / episode_status wrote nothing the artifact carries
    plain = sorted(p.relative_to(tmp_path / "plain.tlbundle") for p in (tmp_path / "plain.tlbundle").rglob("*"))
    after = sorted(p.relative_to(tmp_path / "after.tlbundle") for p in (tmp_path / "after.tlbundle").rglob("*"))
    assert plain == after
    for name in ("relations.json", "manifest.json"):
        assert (tmp_path / "plain.tlbundle" / name).read_bytes() == (tmp_path / "after.tlbundle" / name).read_bytes()
    loaded = Bundle.load(tmp_path / "after.tlbundle")
    again = loaded.why("cf")
    assert (again.lineage_status, again.direction, _hops(again)) == (before.lineage_status, before.direction,
                                                                     _hops(before))
    assert again.value_residual == before.value_residual
    assert loaded.episode_status("e").members == ("ft",)
