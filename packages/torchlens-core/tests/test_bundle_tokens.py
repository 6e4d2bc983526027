"""Token-stream bindings, verified fed_by rows, Bundle.token_pairs and Bundle.token_divergence
on hand-built traces (no ML framework). Every expected position, coverage and divergence is
written out by hand or computed here with plain Python loops, never by the code under test."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pytest

from torchlens.bundle import Bundle, TokenDivergence, attach_sidecar
from torchlens.errors import ArtifactError, BundleError
from torchlens.viz.examples import example_trace

FAMILY = "torchlens.boundary_facts"


def _member(ids, completion=None, **facts):
    """A trace whose first input holds `ids` (batch of one), bound with `completion`."""
    t = example_trace("mlp")
    t._ops["input_1"].replace_outputs((np.array([ids], dtype=np.int64),))
    if completion is not None or facts:
        attach_sidecar(t, FAMILY, {"completion": completion, **facts})
    return t


# draft: prompt [1, 2, 3], completion [40, 41, 0, 42, 43] (0 = padding, excluded)
DRAFT = [1, 2, 3, 40, 41, 0, 42, 43]
# critique quotes draft's completion positions 3..5 at its positions 2..4, and 6..8 at 6..8
CRITIQUE = [9, 9, 40, 41, 0, 7, 42, 43, 50, 51]


def _pair(**draft_facts):
    draft = _member(DRAFT, [3, 8], excluded_ids=[0], **draft_facts)
    critique = _member(CRITIQUE, [8, 10])
    return Bundle({"draft": draft, "critique": critique})


def test_binding_fills_length_and_digest_and_refuses_a_contradiction():
    t = _member(DRAFT)
    b = attach_sidecar(t, FAMILY, {"schema": "token_boundary_v1", "completion": [3, 8], "tokenizer": "gpt2"})
    want = hashlib.sha256(np.array(DRAFT, dtype="<i8").tobytes()).hexdigest()
    assert (b.length, b.ids_digest, b.completion, b.stream, b.batch_row) == (8, want, (3, 8), "input", 0)
    for facts, field in [({"length": 9}, "length"), ({"ids_digest": "0" * 64}, "ids_digest"),
                         ({"completion": [3, 9]}, "completion"), ({"completion": [5, 4]}, "completion"),
                         ({"stream": "logits"}, "stream"), ({"schema": "other_v1"}, "schema"),
                         ({"excluded_ids": [0.5]}, "excluded_ids"), ({"colour": 1}, "colour")]:
        with pytest.raises(BundleError) as e:
            attach_sidecar(t, FAMILY, facts)
        assert e.value.code == "token_binding_invalid" and e.value.fields["field"] == field, facts
    with pytest.raises(BundleError) as e:
        attach_sidecar(t, "acme.facts", {})
    assert e.value.code == "token_binding_invalid"


def test_verified_claim_checks_out_with_hand_coverage():
    b = _pair()
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 6, 2, 5], [6, 8, 6, 8]], basis="verified")
    row = b.relations[0]
    # eligible draft positions: completion 3..7 minus the padding at 5 -> {3, 4, 6, 7}, all covered
    assert row.params["basis"] == "verified" and row.params["coverage"] == 1.0
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 5, 2, 4]], basis="matched", coverage=0.1)
    # no matcher yet: spans that check out are stored verified, coverage recomputed: {3, 4} of 4
    assert b.relations[1].params["basis"] == "verified" and b.relations[1].params["coverage"] == 0.5


@pytest.mark.parametrize("span, why", [([[3, 6, 3, 6]], "differ"),        # draft 40,41,0 vs critique 41,0,7
                                       ([[1, 3, 1, 3]], "completion"),     # draft prompt, not its completion
                                       ([[3, 5, 2, 5]], "differ")])        # unequal lengths
def test_contradicting_spans_refuse_and_leave_the_table_unchanged(span, why):
    b = _pair()
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 5, 2, 4]], label="kept")
    with pytest.raises(BundleError) as e:
        b.relate("fed_by", "critique", "draft", token_spans=span, basis="verified")
    assert e.value.code == "bundle_relation_span_unverified" and why in str(e.value)
    assert len(b.relations) == 1 and b.relations[0].params["label"] == "kept"


def test_missing_evidence_stores_declared():
    # the source binding names no completion range; an unbound derived stream has none either
    draft, critique = _member(DRAFT), _member(CRITIQUE)
    b = Bundle({"draft": draft, "critique": critique})
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 5, 2, 4]], basis="verified", coverage=0.25)
    assert b.relations[0].params["basis"] == "declared" and b.relations[0].params["coverage"] == 0.25


def test_token_pairs_pairs_exactly_the_verified_positions():
    b = _pair()
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 6, 2, 5]], basis="verified")
    b.relate("fed_by", "critique", "draft", token_spans=[[6, 8, 6, 8]], label="said so")  # declared
    tp = b.token_pairs("critique", "draft")
    # verified span 3..6 -> 2..5 minus the padding id 0 at draft 5: (3, 2), (4, 3)
    assert tp.pairs == ((3, 2), (4, 3)) and tp.source_positions == [3, 4] and tp.reader_positions == [2, 3]
    assert tp.coverage == 0.5  # 2 of the eligible {3, 4, 6, 7}
    got = {(e["side"], e["start"], e["end"], e["reason"], e["row_index"]) for e in tp.excluded}
    assert got == {("source", 5, 6, "excluded_id", 0), ("source", 6, 8, "declared", 1),
                   ("reader", 6, 8, "declared", 1), ("source", 6, 8, "uncovered", None)}
    with pytest.raises(KeyError):
        b.token_pairs("critique", "nobody")


def test_token_pairs_drops_positions_claimed_twice_and_other_tokenizers():
    b = _pair()
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 5, 2, 4]], basis="verified")
    # draft 42,43 at 6..8 equal critique 6..8; draft 3 (id 40) also at critique 2: claimed twice
    b.relate("fed_by", "critique", "draft", token_spans=[[6, 8, 6, 8], [3, 4, 2, 3]], basis="verified")
    tp = b.token_pairs("critique", "draft")
    assert tp.pairs == ((4, 3), (6, 6), (7, 7))
    assert {(e["start"], e["reason"]) for e in tp.excluded if e["reason"] == "claimed_twice"} == {(3, "claimed_twice")}
    other = _pair(tokenizer="gpt2")
    attach_sidecar(other["critique"], FAMILY, {"completion": [8, 10], "tokenizer": "llama"})
    other.relate("fed_by", "critique", "draft", token_spans=[[3, 5, 2, 4]], basis="verified")
    tp = other.token_pairs("critique", "draft")
    assert tp.pairs == () and {e["reason"] for e in tp.excluded} == {"tokenizer_mismatch", "uncovered"}


def test_verified_rows_recheck_at_call_time():
    b = _pair()
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 5, 2, 4]], basis="verified")
    changed = list(CRITIQUE)
    changed[2] = 99
    b["critique"]._ops["input_1"].replace_outputs((np.array([changed], dtype=np.int64),))
    with pytest.raises(BundleError) as e:
        b.token_pairs("critique", "draft")
    assert e.value.code == "bundle_relation_span_unverified"


def _hand_divergence(a, b):
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def test_token_divergence_by_hand():
    original = _member([5, 6, 7, 8, 9, 10, 11, 12], [5, 8])
    rerun = _member([5, 6, 1, 8, 9, 10, 11, 13, 14], [5, 9])
    b = Bundle({"orig": original, "rerun": rerun})
    d = b.token_divergence("orig", "rerun")
    assert isinstance(d, TokenDivergence) and (d.original, d.rerun) == ("orig", "rerun")
    assert (d.prompt_divergence, d.completion_divergence) == (2, 2)
    assert d.lengths == ((5, 3), (5, 4))
    # common prompt prefix [5, 6]; common prompt tail [8, 9]; common completion prefix [10, 11]
    assert d.shared == ((0, 2, 0, 2), (3, 5, 3, 5), (5, 7, 5, 7))
    assert not d.prompt_same and not d.completion_same and d.intervened == (False, False)
    same = b.token_divergence("orig", "orig")
    assert same.prompt_same and same.completion_same and same.shared == ((0, 5, 0, 5), (5, 8, 5, 8))


def test_token_divergence_matches_a_plain_loop_on_random_streams():
    rng = random.Random(0)
    for _ in range(40):
        base = [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
        p1 = base + [rng.randrange(4) for _ in range(rng.randrange(3))]
        p2 = base + [rng.randrange(4) for _ in range(rng.randrange(3))]
        c1 = [rng.randrange(4) for _ in range(rng.randrange(1, 5))]
        c2 = c1[: rng.randrange(len(c1) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(3))]
        b = Bundle({"a": _member(p1 + c1, [len(p1), len(p1) + len(c1)]),
                    "b": _member(p2 + c2, [len(p2), len(p2) + len(c2)])})
        d = b.token_divergence("a", "b")
        assert d.prompt_divergence == _hand_divergence(p1, p2)
        assert d.completion_divergence == _hand_divergence(c1, c2)
        for s0, s1, r0, r1 in d.shared:  # every shared stretch really is shared
            assert (p1 + c1)[s0:s1] == (p2 + c2)[r0:r1] and s1 > s0


def test_token_divergence_unavailable_names_the_member_and_reason():
    bound = _member([1, 2, 3], [2, 3])
    for other, reason in [(_member([1, 2, 3]), "no completion range"),
                          (example_trace("mlp"), "no token-stream binding")]:
        with pytest.raises(BundleError) as e:
            Bundle({"a": bound, "b": other}).token_divergence("a", "b")
        assert e.value.code == "bundle_token_divergence_unavailable" and e.value.fields["member"] == "b"
        assert reason in e.value.fields["reason"]
    with pytest.raises(KeyError):
        Bundle({"a": bound}).token_divergence("a", "zzz")


def test_bindings_and_verified_rows_round_trip_and_a_tampered_binding_refuses(tmp_path):
    b = _pair(tokenizer="gpt2")
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 6, 2, 5]], basis="verified")
    path = b.save(tmp_path / "b")
    loaded = Bundle.load(path)
    assert loaded.relations[0].params["basis"] == "verified"
    assert loaded.token_pairs("critique", "draft").pairs == b.token_pairs("critique", "draft").pairs
    assert loaded.token_divergence("draft", "critique").prompt_divergence == 0
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["members"][0]["binding"]["completion"] = [2, 8]
    manifest["members"][0]["binding"]["ids_digest"] = "0" * 64
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError) as e:
        Bundle.load(path)
    assert e.value.code == "bundle_artifact_malformed" and "binding" in str(e.value)


# token_spans="auto": the matcher ---------------------------------------------------------------
def test_auto_spans_match_each_eligible_run_and_are_written_matched():
    b = _pair()
    b.relate("fed_by", "critique", "draft", token_spans="auto")
    row = b.relations[0]
    # draft's eligible runs: [3, 5) = 40 41 and [6, 8) = 42 43; critique's prompt is its positions 0..7
    # 40 41 sits at 2..4 and 42 43 at 6..8, once each
    assert row.params["token_spans"] == [[3, 5, 2, 4], [6, 8, 6, 8]]
    assert row.params["basis"] == "matched" and row.params["coverage"] == 1.0
    assert b.token_pairs("critique", "draft").pairs == ((3, 2), (4, 3), (6, 6), (7, 7))


def test_auto_spans_trim_boundary_tokens_and_refuse_ambiguity_and_no_match():
    draft = _member([1, 2, 60, 61, 62, 63], [2, 6])
    # the reader quotes 61 62 63 only (the run's first token replaced by a template delimiter)
    quoted = _member([5, 99, 61, 62, 63, 98], [6, 6])
    b = Bundle({"draft": draft, "quoted": quoted})
    b.relate("fed_by", "quoted", "draft", token_spans="auto")
    assert b.relations[0].params["token_spans"] == [[3, 6, 2, 5]] and b.relations[0].params["coverage"] == 0.75
    twice = _member([60, 61, 62, 63, 7, 60, 61, 62, 63], [9, 9])
    absent = _member([70, 71, 72, 73, 74], [5, 5])
    for reader, code in ((twice, "bundle_relation_auto_spans_ambiguous"),
                         (absent, "bundle_relation_auto_spans_unmatched")):
        bb = Bundle({"draft": draft, "reader": reader})
        with pytest.raises(BundleError) as e:
            bb.relate("fed_by", "reader", "draft", token_spans="auto")
        assert e.value.code == code and bb.relations == ()


def test_a_matched_claim_stays_matched_only_with_the_matchers_spans(tmp_path):
    b = _pair()
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 5, 2, 4], [6, 8, 6, 8]], basis="matched")
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 5, 2, 4]], basis="matched")  # checks out, not the match
    assert [r.params["basis"] for r in b.relations] == ["matched", "verified"]
    loaded = Bundle.load(b.save(tmp_path / "m"))
    assert [r.params["basis"] for r in loaded.relations] == ["matched", "verified"]


# relation grades ------------------------------------------------------------------------------
def test_grades_follow_the_spans_and_the_stored_item_grades():
    b = _pair()
    b.add("judge", _member([1, 2], [1, 2]))
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 5, 2, 4]], basis="verified")
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 5, 2, 4]])  # declared
    evidence = {"schema": "turn_boundary_v1", "items": [
        {"class": "member_output", "grade": "verified", "seam": "template"},   # user-written: stored disclosed
        {"class": "declared_carry", "grade": "disclosed"},
        {"class": "harness_record", "grade": "divergent"}]}
    b.relate("successor_of", "judge", "critique", carry_mode="summarized", seams=["template"], evidence=evidence)
    items = b.relations[2].params["evidence"]["items"]
    assert [(i["grade"], i.get("declared_grade")) for i in items] == [("disclosed", "verified"), ("disclosed", None),
                                                                      ("disclosed", "divergent")]
    grades = b.relation_grades()
    assert [g.grade for g in grades] == ["verified", "disclosed", "disclosed"]
    g = grades[2]
    assert dict(g.items_by_class) == {"member_output": 1, "declared_carry": 1, "harness_record": 1}
    assert g.exogenous_items == 2 and dict(g.items_by_grade) == {"disclosed": 3}
    b.relate("successor_of", "judge", "draft", evidence={"schema": "mine", "items": [{"note": "no grade"}]})
    assert b.relation_grades()[3].grade == "unchecked"
    # the verified fed_by row is re-checked when read: changed ids grade it divergent
    changed = list(CRITIQUE)
    changed[3] = 77
    b["critique"]._ops["input_1"].replace_outputs((np.array([changed], dtype=np.int64),))
    assert b.relation_grades()[0].grade == "divergent"


@pytest.mark.parametrize("evidence, params", [
    ({"schema": "version_boundary_v1", "items": [{"grade": "disclosed"}]}, {}),           # class required
    ({"schema": "version_boundary_v1", "items": [{"class": "harness_record"}]}, {}),      # not accepted there
    ({"schema": "mine", "items": [{"class": "rumour"}]}, {}),                             # not one of the seven
    ({"schema": "mine", "items": [{"class": "member_input", "seam": "tokenizer"}]}, {"seams": ["template"]}),
    ({"schema": "mine", "items": [{"grade": "broken"}]}, {}),
    ({"schema": "mine", "items": ["text"]}, {}),
])
def test_malformed_evidence_items_refuse(evidence, params):
    b = _pair()
    with pytest.raises(BundleError) as e:
        b.relate("successor_of", "critique", "draft", evidence=evidence, **params)
    assert e.value.code == "bundle_relation_schema_invalid" and b.relations == ()
