"""tl.Bundle on framework-free traces: members, the comparison gate, metrics against hand
formulas, Super* views, stored comparisons, relations, save/load with tampering, drawing.

Every distance is checked against a pure-Python computation written here (loops over
floats, no NumPy linear algebra), so a wrong formula or a mis-paired site goes red.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings

import numpy as np
import pytest

import torchlens as tl
from torchlens.bundle import Bundle, snapshot_params
from torchlens.bundle import metrics as M
from torchlens.errors import (ERROR_CODES, ArgumentConflictError, ArgumentTypeError, ArtifactError, BundleError,
                              InvalidArgumentError)
from torchlens.viz.bundle_draw import MISSING_FILL, ZERO_FILL, diff_fill
from torchlens.viz.examples import EventBuilder, example_trace


# hand formulas -------------------------------------------------------------------------------
def _floats(x) -> list[float]:
    return [float(v) for v in np.asarray(x).reshape(-1).tolist()]


def hand_cosine(a, b) -> float:
    a, b = _floats(a), _floats(b)
    if a == b:
        return 0.0
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return 1.0 - dot / (na * nb)


def hand_rel_l2(a, b) -> float:
    a, b = _floats(a), _floats(b)
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b))) / max(math.sqrt(sum(x * x for x in a)), 1e-12)


def hand_rel_l1(a, b) -> float:
    a, b = _floats(a), _floats(b)
    return sum(abs(x - y) for x, y in zip(a, b)) / max(sum(abs(x) for x in a), 1e-12)


HAND = {"cosine": hand_cosine, "relative_l2": hand_rel_l2, "relative_l1": hand_rel_l1}


def _mlp_pair():
    """Two mlp traces with the same inputs; in the second the relu output and fc2 after it
    are halved, as an edit at the relu would change them (the example's output_1 holds no
    payload, so it has no distance)."""
    a, b = example_trace("mlp"), example_trace("mlp")
    for label in ("relu_1_2", "linear_2_3"):
        op = b._ops[label]
        op.replace_outputs((op.out * np.float32(0.5),))
    return a, b


def _with_inputs(t, value):
    t._ops["input_1"].replace_outputs((value,))
    return t


# metrics -------------------------------------------------------------------------------------
def test_metrics_match_hand_formulas():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    for name, hand in HAND.items():
        assert M.METRICS[name](a, b) == pytest.approx(hand(a, b), rel=1e-12)
    assert M.l2(a, b) == pytest.approx(math.sqrt(sum((x - y) ** 2 for x, y in zip(_floats(a), _floats(b)))))
    assert M.max_abs(a, b) == pytest.approx(max(abs(x - y) for x, y in zip(_floats(a), _floats(b))))
    assert M.cosine(a, a) == 0.0  # exactly zero for identical values (no 1e-16 residue)
    assert M.cosine(np.zeros(3), np.zeros(3)) == 0.0 and M.cosine(np.zeros(3), np.ones(3)) == 1.0
    # a scalar-like site always uses relative_l1, whatever was asked for
    assert M.distance(M.cosine, np.array([2.0]), np.array([3.0])) == pytest.approx(0.5)


def test_metric_refusals():
    with pytest.raises(InvalidArgumentError) as e:
        M.relative_l2(np.ones(3), np.ones(4))
    assert e.value.code == "metric_size_mismatch"
    with pytest.raises(InvalidArgumentError) as e:
        M.resolve("cosine_similarity")
    assert e.value.code == "metric_invalid" and e.value.remedy


# members and baseline ------------------------------------------------------------------------
def test_empty_bundle_add_and_member_access():
    b = Bundle()
    assert len(b) == 0 and b.baseline is None
    t1, t2 = example_trace("mlp"), example_trace("mlp")
    assert b.add("one", t1) is b
    b.add("two", t2)
    assert b.names == ("one", "two") and b["two"] is t2 and "one" in b and list(b) == ["one", "two"]
    with pytest.raises(KeyError):
        b["three"]
    for bad_name, bad in (("one", t1), ("", t1), (3, t1), ("x", object())):
        with pytest.raises(InvalidArgumentError) as e:
            b.add(bad_name, bad)
        assert e.value.code == ("bundle_member_exists" if bad_name == "one" else "bundle_member_invalid")
    assert b.names == ("one", "two")  # refusals changed nothing
    assert Bundle([t1, t2]).names == ("0", "1")  # both named "root": positions
    assert Bundle([t1.fork("a"), t2.fork("b")]).names == ("a", "b")
    with pytest.raises(InvalidArgumentError) as e:
        Bundle({"a": t1}, baseline="nope")
    assert e.value.code == "bundle_baseline_unknown"


def test_baseline_counts_only_pristine_members():
    touched, clean = example_trace("mlp"), example_trace("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        touched._ops["relu_1_2"].out = touched._ops["relu_1_2"].out * 0  # a direct write is a touch
    assert touched.is_pristine is False and clean.is_pristine is True
    b = Bundle({"touched": touched, "clean": clean})
    assert b.pristine == {"touched": False, "clean": True}
    assert b.baseline == "clean"
    assert Bundle({"touched": touched, "clean": clean}, baseline="touched").baseline == "touched"


# the comparison gate -------------------------------------------------------------------------
def test_compare_rows_equal_hand_metric_at_every_site():
    a, b = _mlp_pair()
    bundle = Bundle({"a": a, "b": b})
    for metric, hand in HAND.items():
        rows = bundle.compare("a", "b", metric=metric)
        assert [lbl for lbl, _ in rows] == [lbl for lbl in a.labels if lbl != "output_1"]
        assert list(rows.skipped) == ["output_1"]
        for label, d in rows:
            assert d == pytest.approx(hand(a._ops[label].out, b._ops[label].out), rel=1e-9, abs=1e-15), (metric, label)
        assert dict(rows)["input_1"] == 0.0
        # halving is invisible to cosine (scale-invariant), visible to the relative norms
        assert (dict(rows)["relu_1_2"] == 0.0) == (metric == "cosine")
    assert rows.relationship.grade == "same_inputs"


def test_comparability_grades_and_gate_codes():
    a, b = _mlp_pair()
    other_inputs = _with_inputs(example_trace("mlp"), np.ones((1, 8), np.float32))
    wide = example_trace("mlp", width=4)
    bundle = Bundle({"a": a, "b": b, "c": other_inputs, "w": wide})
    r = bundle.comparability("a", "b")
    assert (r.grade, r.comparable, r.inputs_equal, r.same_graph_shape) == ("same_inputs", True, True, True)
    r = bundle.comparability("a", "c")
    assert (r.grade, r.comparable, r.inputs_equal) == ("same_graph", True, False)
    r = bundle.comparability("a", "w")
    assert (r.grade, r.code, r.same_param_shapes) == ("foreign", "bundle_gate_param_shapes", False)
    with pytest.raises(BundleError) as e:
        bundle.compare("a", "w")
    assert e.value.code == "bundle_gate_param_shapes" and e.value.remedy
    bundle.relate("fed_by", "b", "c").relate("successor_of", "c", "a")
    r = bundle.comparability("b", "a")
    assert (r.grade, r.code, r.ordering_path) == ("ordered", "bundle_gate_ordered", ("b", "c", "a"))
    with pytest.raises(BundleError) as e:
        bundle.compare("a", "b")
    assert e.value.code == "bundle_gate_ordered"
    assert bundle.comparability("a", "b").comparable is False
    # a member is not ordered against itself, even when it sits on an ordering path
    r = bundle.comparability("a", "a")
    assert (r.grade, r.comparable, r.ordering_path) == ("same_inputs", True, ())


def _variant(func: str, x_value=None):
    """A tiny model whose middle op is `func` (same parameters whatever it is)."""
    bld = EventBuilder("Tiny")
    x = bld.input((1, 4))
    h = bld.linear(x, "fc", 4, 4)
    h = bld.op(func, (h,), (1, 4), "act")
    y = bld.op("neg", (h,), (1, 4), "neg")
    bld.output(y)
    t = bld.build(y)
    if x_value is not None:
        _with_inputs(t, x_value)
    return t


def test_graph_mismatch_refuses_unless_inputs_are_proven_equal():
    relu, gelu = _variant("relu"), _variant("gelu", np.full((1, 4), 2.0, np.float32))
    b = Bundle({"relu": relu, "gelu": gelu})
    r = b.comparability("relu", "gelu")
    assert (r.grade, r.code, r.same_graph_shape, r.inputs_equal) == ("different_graph", "bundle_gate_graph_mismatch",
                                                                       False, False)
    with pytest.raises(BundleError) as e:
        b.at("linear_1_1").compare()
    assert e.value.code == "bundle_gate_graph_mismatch"
    same_x = Bundle({"relu": relu, "gelu": _variant("gelu")})
    rows = same_x.compare("relu", "gelu", metric="relative_l2")
    assert same_x.comparability("relu", "gelu").grade == "same_inputs"
    # only labels both hold with the same callable and shapes line up (not relu_1_2 / gelu_1_2)
    assert [lbl for lbl, _ in rows] == ["input_1", "linear_1_1", "neg_1_3"]


# Super* views ---------------------------------------------------------------------------------
def test_at_compare_is_the_pairwise_matrix():
    a, b = _mlp_pair()
    c = _with_inputs(example_trace("mlp"), np.ones((1, 8), np.float32))
    bundle = Bundle({"a": a, "b": b, "c": c})
    mat = bundle.at("relu_1_2").compare("relative_l2")
    traces = {"a": a, "b": b, "c": c}
    for x in "abc":
        for y in "abc":
            want = 0.0 if x == y else hand_rel_l2(traces[x]._ops["relu_1_2"].out, traces[y]._ops["relu_1_2"].out)
            assert mat[x, y] == pytest.approx(want, rel=1e-9)
    sel = bundle.at(tl.func("relu")).compare("relative_l2")
    assert sel.values == mat.values  # a selector resolves to the same op in every member
    with pytest.raises(InvalidArgumentError) as e:
        bundle.at(tl.func("linear"))  # two ops per member
    assert e.value.code == "bundle_site_unresolved"


def test_at_converts_through_each_members_entry_point():
    a, b = example_trace("loop", steps=3), example_trace("loop", steps=3)
    bundle = Bundle({"a": a, "b": b})
    assert bundle.at("tanh_1_5:2").labels == {"a": ("tanh_1_5:2",), "b": ("tanh_1_5:2",)}
    assert bundle.at("cell:2").labels["a"] == tuple(o.label for o in a["cell:2"].output_ops)
    assert bundle.at("cell").labels["a"] == tuple(o.label for o in a["cell"].output_ops)
    for key, code in (("tanh_1_5:9", "pass_out_of_range"), ("nope", "label_unknown")):
        with pytest.raises(tl.errors.TorchLensError) as e:
            bundle.at(key)
        assert e.value.code == code  # the member's own refusal, unchanged


def test_layer_passes_are_joined_in_pass_order():
    a, b = example_trace("loop", steps=3), example_trace("loop", steps=3)
    for i, op in enumerate(b._layers["tanh_1_5"].ops):
        op.replace_outputs((op.out + np.float32(i),))
    bundle = Bundle({"a": a, "b": b})
    joined_a = sum((_floats(o.out) for o in a._layers["tanh_1_5"].ops), [])
    joined_b = sum((_floats(o.out) for o in b._layers["tanh_1_5"].ops), [])
    mat = bundle.at("tanh_1_5").compare("relative_l1")
    assert mat["a", "b"] == pytest.approx(hand_rel_l1(joined_a, joined_b), rel=1e-9)
    key = bundle.store_comparison("relative_l1")
    stored = bundle.stored_comparison(key)
    assert stored.values["b"]["tanh_1_5"] == pytest.approx(mat["a", "b"], rel=1e-12)
    assert stored.values["b"]["linear_1_2"] == 0.0 and stored.values["a"]["tanh_1_5"] == 0.0
    # per-pass rows of compare: pass 1 changed by +0 (zero distance), passes 2 and 3 did change
    rows = dict(bundle.compare("a", "b", metric="relative_l1"))
    assert rows["tanh_1_5:1"] == 0.0 and rows["tanh_1_5:2"] > 0 and rows["tanh_1_5:3"] > 0


def test_stored_comparisons_and_rank_changes():
    a, b = _mlp_pair()
    bundle = Bundle({"a": a, "b": b})
    assert bundle.store_comparison() == "relative_l2"
    assert bundle.store_comparison(lambda x, y: 1.0, name="ones") == "ones"
    assert bundle.stored_comparison_names() == ["relative_l2", "ones"]
    with pytest.raises(InvalidArgumentError) as e:
        bundle.store_comparison(lambda x, y: 1.0)
    assert e.value.code == "metric_invalid"
    with pytest.raises(BundleError) as e:
        bundle.stored_comparison("cosine")
    assert e.value.code == "comparison_unknown"
    ranked = bundle.rank_changes()
    assert [r[0] for r in ranked[:1]] == ["relu_1_2"]  # relu halved: relative_l2 0.5, the largest
    assert ranked[0][1] == pytest.approx(0.5, rel=1e-6)
    assert all(ranked[i][1] >= ranked[i + 1][1] for i in range(len(ranked) - 1))
    by_module = dict((m, d) for m, d, _ in bundle.rank_changes(by="module"))
    assert by_module["fc2"] == pytest.approx(0.5, rel=1e-6) and by_module["fc1"] == 0.0


# checkpoint live-ref guard ---------------------------------------------------------------------
def test_param_reads_refuse_without_snapshots_and_match_with_them():
    a, b = example_trace("mlp"), example_trace("mlp")
    b._params["fc1.weight"].value = b._params["fc1.weight"].value + np.float32(1.0)
    bundle = Bundle({"a": a, "b": b})
    for read in (lambda: bundle.at("fc1.weight").compare(), lambda: bundle.at("fc1.weight").out,
                 lambda: bundle.weight_norm_diff("a", "b")):
        with pytest.raises(BundleError) as e:
            read()
        assert e.value.code == "checkpoint_series_live_params" and e.value.fields["members"] == ["a", "b"]
    snapshot_params(a)
    with pytest.raises(BundleError) as e:
        bundle.weight_norm_diff("a", "b")
    assert e.value.fields["members"] == ["b"]
    snapshot_params(b)
    diff = bundle.weight_norm_diff("a", "b")
    n = a._params["fc1.weight"].value.size
    assert diff["fc1.weight"] == pytest.approx(math.sqrt(n), rel=1e-6) and diff["fc2.bias"] == 0.0
    wa, wb = a._params["fc1.weight"].value, b._params["fc1.weight"].value
    assert bundle.at("fc1.weight").compare()["a", "b"] == pytest.approx(hand_rel_l2(wa, wb), rel=1e-9)
    assert not bundle.at("fc1.weight").out["a"].flags.writeable


def test_capture_option_snapshot_params_is_validated_and_takes_the_snapshot():
    from torchlens.bundle.guard import snapshot_of, take_capture_snapshot
    from torchlens.options import CaptureOptions, TraceOptions

    assert CaptureOptions().snapshot_params is False  # opt-in: one copy of the parameters
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidArgumentError) as e:
            CaptureOptions(snapshot_params=bad)
        assert e.value.code == "capture_option_invalid" and e.value.fields["field"] == "snapshot_params"
    on = CaptureOptions(snapshot_params=True)
    # trace.options records the switch and gives it back for a recapture
    stored = TraceOptions.from_capture(on, save="all", structure_only=False)
    assert stored.snapshot_params is True and stored.capture_options() == on
    a, b = example_trace("mlp"), example_trace("mlp")
    take_capture_snapshot(a, CaptureOptions())  # switch off: nothing taken
    take_capture_snapshot(a, None)
    assert snapshot_of(a) is None
    take_capture_snapshot(a, on)
    take_capture_snapshot(b, on)
    snap = snapshot_of(a)
    assert sorted(snap) == sorted(a._params) and not snap["fc1.weight"].flags.writeable
    assert np.array_equal(snap["fc1.weight"], a._params["fc1.weight"].value)
    assert snap["fc1.weight"] is not a._params["fc1.weight"].value  # a copy, not the live value
    assert Bundle({"a": a, "b": b}).weight_norm_diff("a", "b")["fc1.weight"] == 0.0


def test_snapshots_round_trip_through_a_saved_bundle(tmp_path):
    a, b = example_trace("mlp"), example_trace("mlp")
    b._params["fc1.weight"].value = b._params["fc1.weight"].value + np.float32(1.0)
    snapshot_params(a)
    snapshot_params(b)
    bundle = Bundle({"a": a, "b": b, "bare": example_trace("mlp")})
    want = bundle.weight_norm_diff("a", "b")
    path = bundle.save(tmp_path / "snaps")
    assert sorted(os.listdir(path / "snapshots")) == ["0000.safetensors", "0001.safetensors"]
    loaded = Bundle.load(path)
    assert loaded.weight_norm_diff("a", "b") == want
    for n in ("a", "b"):
        for addr, p in bundle[n]._params.items():
            assert np.array_equal(Bundle({"x": loaded[n]}).at(addr).out["x"], p.value)
    with pytest.raises(BundleError) as e:  # saved without a snapshot: loads without one
        loaded.weight_norm_diff("a", "bare")
    assert e.value.code == "checkpoint_series_live_params" and e.value.fields["members"] == ["bare"]
    # a snapshot blob whose listing names other parameters refuses, even with its digest recomputed
    m = json.loads((path / "manifest.json").read_text())
    blob = (path / "snapshots" / "0000.safetensors").read_bytes()
    hacked = blob.replace(b'fc1.weight', b'fc9.weight')
    assert hacked != blob
    (path / "snapshots" / "0000.safetensors").write_bytes(hacked)
    m["files"]["snapshots/0000.safetensors"] = {"sha256": hashlib.sha256(hacked).hexdigest(), "size": len(hacked)}
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError) as e:
        Bundle.load(path)
    assert e.value.code == "bundle_artifact_malformed"


# relations ------------------------------------------------------------------------------------
def test_relate_checks_rows_and_leaves_the_table_unchanged_on_error():
    names = {n: example_trace("mlp") for n in ("draft", "critique", "router", "writer")}
    b = Bundle(names)
    b.relate("fed_by", "critique", "draft", token_spans=[[3, 7, 3, 7]], label="critique", basis="verified")
    row = b.relations[0]
    assert row.members == ("critique", "draft") and row.params["basis"] == "declared"  # no binding: declared
    b.relate({"kind": "selected_by", "members": ["writer", "router"], "params": {"chosen": 1, "candidates": [0, 1]}})
    assert b.upstream("critique") == ["draft"] and b.downstream("router") == ["writer"]
    cases = [
        (("no_such_kind", "critique", "draft"), {}, "bundle_relation_schema_invalid"),
        (("fed_by", "critique", "ghost"), {}, "bundle_relation_member_missing"),
        (("fed_by", "critique", "draft"), {"chosen": 1}, "bundle_relation_schema_invalid"),
        (("selected_by", "writer", "router"), {"chosen": True, "candidates": [0, 1]}, "bundle_relation_schema_invalid"),
        (("selected_by", "writer", "router"), {"candidates": [1, 1]}, "bundle_relation_schema_invalid"),
        (("fed_by", "critique", "draft"), {"token_spans": [[5, 3, 0, 1]]}, "bundle_relation_schema_invalid"),
        (("fed_by", "critique", "draft"), {"token_spans": "auto"}, "bundle_relation_auto_spans_unavailable"),
        (("fed_by", "critique", "draft"), {"token_spans": "all"}, "bundle_relation_schema_invalid"),
        (("successor_of", "draft", "critique"), {}, "bundle_relation_schema_invalid"),  # a cycle
        (("successor_of", "draft", "draft"), {}, "bundle_relation_schema_invalid"),
    ]
    for args, params, code in cases:
        with pytest.raises(BundleError) as e:
            b.relate(*args, **params)
        assert e.value.code == code, args
    with pytest.raises(BundleError) as e:
        b.relate("selected_by", "writer", "router", evidence={"items": ["x" * (1024 * 1024)]})
    assert e.value.code == "bundle_relation_evidence_over_budget"
    assert len(b.relations) == 2
    assert [g.grade for g in b.relation_grades()] == ["disclosed", "disclosed"]
    b.relate("successor_of", "writer", "critique", evidence={"schema": "s", "items": [{"class": "member_output"}]})
    assert b.relation_grades()[-1].grade == "unchecked"


# save / load ----------------------------------------------------------------------------------
def _saved(tmp_path):
    a, b = _mlp_pair()
    bundle = Bundle({"a": a, "b": b}, baseline="a")
    bundle.relate("alternative_of", "b", "a", label="peer")
    return bundle, bundle.save(tmp_path / "runs")


def _rewrite_relations(path, body, fix_digest: bool):
    data = (json.dumps(body) + "\n").encode()
    (path / "relations.json").write_bytes(data)
    if fix_digest:  # an attacker who recomputes the digest: only the re-check stands
        m = json.loads((path / "manifest.json").read_text())
        m["files"]["relations.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        (path / "manifest.json").write_text(json.dumps(m))


def test_save_load_round_trips_members_relations_and_baseline(tmp_path):
    bundle, path = _saved(tmp_path)
    loaded = Bundle.load(path)
    assert loaded.names == ("a", "b") and loaded.baseline == "a" and loaded.relations == bundle.relations
    assert list(loaded.compare("a", "b")) == list(bundle.compare("a", "b"))
    for n in ("a", "b"):
        for label in bundle[n].labels:
            if bundle[n]._ops[label].saved:
                assert np.array_equal(loaded[n]._ops[label].out, bundle[n]._ops[label].out)
    empty = Bundle().save(tmp_path / "empty")
    assert len(Bundle.load(empty)) == 0
    with pytest.raises(ArtifactError) as e:
        bundle.save(path)
    assert e.value.code == "bundle_path_exists"
    bundle.relate("forked_from", "a", "b")
    bundle.save(path, overwrite=True)
    assert len(Bundle.load(path).relations) == 2
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError) as e:
        bundle.save(tmp_path / "plain", overwrite=True)
    assert e.value.code == "bundle_path_not_artifact" and (tmp_path / "plain" / "notes.txt").exists()


@pytest.mark.parametrize("body,fix,code", [
    ({"schema": "tl.bundle_relations/1", "rows": []}, False, "bundle_artifact_malformed"),
    ({"schema": "tl.bundle_relations/1", "rows": [{"kind": "fed_by", "members": ["b", "ghost"], "params": {}}]},
     True, "bundle_relation_member_missing"),
    ({"schema": "tl.bundle_relations/1", "rows": [{"kind": "pickle", "members": ["b", "a"], "params": {}}]},
     True, "bundle_relation_schema_invalid"),
    ({"schema": "tl.bundle_relations/1", "rows": [{"kind": "fed_by", "members": ["b", "a"], "params": {}},
                                                 {"kind": "fed_by", "members": ["a", "b"], "params": {}}]},
     True, "bundle_relation_schema_invalid"),
    ({"schema": "tl.bundle_relations/1", "rows": {"kind": "fed_by"}}, True, "bundle_artifact_malformed"),
])
def test_tampered_relations_refuse(tmp_path, body, fix, code):
    _, path = _saved(tmp_path)
    _rewrite_relations(path, body, fix)
    with pytest.raises((ArtifactError, BundleError)) as e:
        Bundle.load(path)
    assert e.value.code == code


def test_unknown_namespaced_kind_loads_opaque_and_saves_back_verbatim(tmp_path):
    _, path = _saved(tmp_path)
    row = {"kind": "acme.reviewed", "members": ["b", "a"], "params": {"by": "alice", "score": [1, 2]}}
    _rewrite_relations(path, {"schema": "tl.bundle_relations/1", "rows": [row]}, True)
    loaded = Bundle.load(path)
    (opaque,) = loaded.relations
    assert type(opaque).__name__ == "OpaqueRelationRow" and opaque.to_json() == row
    (g,) = loaded.relation_grades()
    assert (g.grade, g.unchecked_reasons) == ("unchecked", ("kind_unregistered",))
    assert loaded.comparability("a", "b").comparable  # an opaque row orders nothing
    again = Bundle.load(loaded.save(tmp_path / "again"))
    assert [r.to_json() for r in again.relations] == [row]
    with pytest.raises(BundleError) as e:  # relate never makes one: only a loaded artifact carries them
        loaded.relate("acme.reviewed", "b", "a")
    assert e.value.code == "bundle_relation_schema_invalid"


def test_load_refuses_unlisted_entries_symlinks_and_duplicate_keys(tmp_path):
    _, path = _saved(tmp_path)
    (path / "extra.py").write_text("import os")
    with pytest.raises(ArtifactError) as e:
        Bundle.load(path)
    assert e.value.code == "bundle_artifact_malformed"
    os.remove(path / "extra.py")
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(ArtifactError) as e:
        Bundle.load(link)
    assert e.value.code == "load_path_symlink_rejected"
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text.replace('"baseline":', '"baseline": "b", "baseline":', 1))
    with pytest.raises(ArtifactError) as e:
        Bundle.load(path)
    assert e.value.code == "bundle_artifact_malformed"


# drawing --------------------------------------------------------------------------------------
def _fills(source: str, prefix: str) -> dict[str, str]:
    out = {}
    for m in re.finditer(rf'\b({prefix}\d+) \[label="([^"\\]+)\\n[^"]*", [^\]]*fillcolor="([^"]+)"', source):
        out[m.group(2)] = m.group(3)
    return out


def test_diff_drawing_colours_exactly_the_changed_ops(tmp_path):
    a, b = _mlp_pair()
    bundle = Bundle({"a": a, "b": b})
    d = bundle.draw(tmp_path / "diff.dot", graph="diff")
    assert d.members == ("a", "b") and os.path.exists(d.path) and d.format == "dot"
    rows = dict(bundle.compare("a", "b", metric="relative_l2"))
    rows["output_1"] = None  # no payload: grey, never white
    top = max(v for v in rows.values() if v is not None)
    for prefix in ("L", "R"):
        fills = _fills(str(d), prefix)
        assert set(fills) == set(a.labels)
        for label, fill in fills.items():
            assert fill == diff_fill(rows[label], top)
            assert (fill == ZERO_FILL) == (rows[label] == 0.0), label
    assert {lbl for lbl, f in _fills(str(d), "L").items() if f not in (ZERO_FILL, MISSING_FILL)} == {"relu_1_2", "linear_2_3"}
    assert _fills(str(d), "R")["output_1"] == MISSING_FILL
    assert "white = 0" in str(d)
    assert "white = 0" not in str(bundle.draw(tmp_path / "nolegend.dot", graph="diff", show_legend=False))


def test_bare_draw_writes_collision_safe_files_and_prints_the_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    a, b = _mlp_pair()
    bundle = Bundle({"a": a, "b": b})
    first, second = bundle.draw(file_format="dot"), bundle.draw(file_format="dot")
    diff = bundle.draw(graph="diff", file_format="dot")
    assert [os.path.basename(d.path) for d in (first, second, diff)] == [
        "bundle_modelgraph_1.dot", "bundle_modelgraph_2.dot", "bundle_diff_1.dot"]
    assert capsys.readouterr().out.split() == [first.path, second.path, diff.path]
    assert open(first.path).read() == str(first)
    with pytest.raises(ArgumentConflictError) as e:
        bundle.draw("x.svg", file_format="png")
    assert e.value.code == "draw_format_mismatch" and isinstance(e.value, InvalidArgumentError)
    assert "file_format_mismatch" not in ERROR_CODES  # the spec's code only, no alias
    assert not os.path.exists("x.svg") and not os.path.exists("x.png")
    with pytest.raises(ArgumentConflictError) as e:  # Trace.draw follows the same rule and code
        a.draw("y.svg", file_format="png")
    assert e.value.code == "draw_format_mismatch" and not os.path.exists("y.svg")


def test_diff_marks_ops_without_a_distance_grey(tmp_path):
    a, b = _mlp_pair()
    b._ops["linear_1_1"].saved = False
    d = Bundle({"a": a, "b": b}).draw(tmp_path / "d.dot", graph="diff")
    assert _fills(str(d), "L")["linear_1_1"] == MISSING_FILL and d.distances["linear_1_1"] is None


def _node_fill(source: str, nid: str) -> str:
    line = next(ln for ln in source.splitlines() if ln.strip().startswith(f"{nid} ["))
    return re.findall(r'fillcolor="([^"]+)"', line)[-1]  # the last assignment is the one Graphviz keeps


def test_folded_diff_fills_each_box_with_its_most_changed_op(tmp_path):
    a, b = example_trace("blocks", n_blocks=2), example_trace("blocks", n_blocks=2)
    for label, factor in (("matmul_3_19", 2.0), ("gelu_2_25", 1.5)):  # two ops inside blocks.1
        op = b._ops[label]
        op.replace_outputs((op.out * np.float32(factor),))
    bundle = Bundle({"a": a, "b": b})
    d = bundle.draw(tmp_path / "folded.dot", graph="diff", depth=1)
    rows = dict(bundle.compare("a", "b", metric="relative_l2"))
    boxes: dict[str, list[float]] = {}
    for label, nid in d.node_ids.items():
        if label in rows:
            boxes.setdefault(nid, []).append(rows[label])
    top = max(max(v) for v in boxes.values())
    assert top == pytest.approx(1.0, rel=1e-6)  # matmul_3_19 doubled: |2x - x| / |x|
    for nid, vals in boxes.items():
        assert _node_fill(str(d), nid) == diff_fill(max(vals), top), nid
    box1 = d.node_ids["matmul_3_19"]
    assert box1 == d.node_ids["gelu_2_25"] and _node_fill(str(d), box1) != ZERO_FILL
    assert _node_fill(str(d), d.node_ids["matmul_1_6"]) == ZERO_FILL  # blocks.0 unchanged
    assert d.members == ("a", "b") and "diff_key" in str(d)
    with pytest.raises(ArgumentTypeError) as e:
        bundle.draw(tmp_path / "x.dot", graph="diff", depth=1, node_overrides={"matmul_3_19": {"color": "red"}})
    assert e.value.fields["keyword"] == "node_overrides"


def test_draw_refusals_name_the_keyword(tmp_path):
    a, b = _mlp_pair()
    bundle = Bundle({"a": a, "b": b})
    for kwargs, kw in (({"graph": "diff", "rolled": True}, "rolled"), ({"graph": "diff", "nodes": "members"}, "nodes"),
                       ({"collapse": "auto"}, "collapse"), ({"depth": 2}, "depth")):
        with pytest.raises(ArgumentTypeError) as e:
            bundle.draw(tmp_path / "x.dot", **kwargs)
        assert e.value.code == "bundle_draw_keyword_unsupported" and e.value.fields["keyword"] == kw
        assert isinstance(e.value, TypeError)
    with pytest.raises(InvalidArgumentError) as e:
        bundle.draw(tmp_path / "x.dot", graph="sideways")
    assert e.value.code == "bundle_draw_option_invalid"
    assert not list(tmp_path.iterdir())  # nothing was written by a refusal


def test_union_and_member_graphs(tmp_path):
    relu, other = _variant("relu"), _variant("gelu")
    b = Bundle({"relu": relu, "gelu": other})
    src = str(b.draw(tmp_path / "u.dot"))
    assert "relu_1_2\\nin: relu" in src and "gelu_1_2\\nin: gelu" in src and '"input_1"' in src
    b.relate("forked_from", "gelu", "relu", label="swap")
    m = b.draw(tmp_path / "m.dot", nodes="members")
    assert m.num_nodes == 2 and m.num_edges == 1 and 'm0 -> m1 [label="forked_from\\nswap", style="dashed"]' in str(m)


def test_compare_on_grad_reads_the_saved_gradients():
    a, b = example_trace("mlp"), example_trace("mlp")
    rng = np.random.default_rng(1)
    for t, scale in ((a, 1.0), (b, 3.0)):
        t._ops["relu_1_2"].grads = (np.float32(scale) * rng.standard_normal((1, 16)).astype(np.float32),)
    rows = Bundle({"a": a, "b": b}).compare("a", "b", metric="relative_l1", on="grad")
    assert [lbl for lbl, _ in rows] == ["relu_1_2"] and set(rows.skipped) == set(a.labels) - {"relu_1_2"}
    assert rows[0][1] == pytest.approx(hand_rel_l1(a._ops["relu_1_2"].grads[0], b._ops["relu_1_2"].grads[0]), rel=1e-9)
    with pytest.raises(InvalidArgumentError):
        Bundle({"a": a, "b": b}).compare("a", "b", on="param")


def test_rolled_union_graph_draws_one_node_per_layer(tmp_path):
    a, b = example_trace("loop", steps=3), example_trace("loop", steps=3)
    bundle = Bundle({"a": a, "b": b})
    d = bundle.draw(tmp_path / "r.dot", rolled=True)
    assert set(d.node_ids) == set(a._layers) and d.num_nodes == len(a._layers)
    assert "tanh_1_5 (x3)" in str(d) and "input_1 (x" not in str(d)
    layer_edges = {(a._ops[s].layer_label, a._ops[t].layer_label) for s, t in a.graph_edges}
    assert d.num_edges == len(layer_edges)
    with pytest.raises(BundleError) as e:  # the example traces carry no grad_fn records
        bundle.draw(tmp_path / "b.dot", graph="backward")
    assert e.value.code == "bundle_draw_grad_fns_missing" and e.value.fields["member"] == "a"


def test_show_kinds(tmp_path):
    a, b = _mlp_pair()
    bundle = Bundle({"a": a, "b": b})
    assert bundle.show("repr") == {"a": repr(a), "b": repr(b)}
    strip = bundle.show("strip", path=tmp_path / "s.dot")
    assert sorted(os.path.basename(d.path) for d in strip.values()) == ["s_a.dot", "s_b.dot"]
    assert str(strip["a"]) == str(a.draw(tmp_path / "direct.dot"))
    with pytest.raises(InvalidArgumentError) as e:
        bundle.show("movie")
    assert e.value.code == "bundle_show_kind_invalid"


def test_vary_refuses_an_incomplete_mapping_before_changing_anything():
    a, b = _mlp_pair()
    bundle = Bundle({"a": a, "b": b})
    before = [np.array(bundle[n]._ops["relu_1_2"].out) for n in ("a", "b")]
    for mapping in ({"a": None}, {"a": None, "b": None, "c": None}):
        with pytest.raises(InvalidArgumentError) as e:
            bundle.vary(mapping)
        assert e.value.code == "bundle_vary_mapping_invalid"
    assert all(np.array_equal(x, bundle[n]._ops["relu_1_2"].out) for x, n in zip(before, ("a", "b")))
    assert bundle.vary({"a": None, "b": None}) is bundle


def test_tl_load_and_validate_dispatch_a_bundle_artifact(tmp_path):
    bundle, path = _saved(tmp_path)
    loaded = tl.load(path)
    assert isinstance(loaded, Bundle) and loaded.names == bundle.names
    assert tl.io.artifact.validate_artifact(path)["kind"] == "bundle"
    _rewrite_relations(path, {"schema": "tl.bundle_relations/1", "rows": []}, False)
    with pytest.raises(ArtifactError) as e:
        tl.load(path)
    assert e.value.code == "bundle_artifact_malformed"
