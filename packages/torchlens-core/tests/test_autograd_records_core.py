"""Core side of the grad_fn records (no ML framework): parsing the stored rows into
`trace.autograd.grad_fns`, the collection's lookups, the reasons when there are none, and the
backward / combined bundle drawings from hand-written records on reference traces."""

from __future__ import annotations

import json
import re

import pytest

from torchlens.bundle import Bundle
from torchlens.errors import AmbiguousOpLookupError, BundleError, LookupMissError
from torchlens.records.autograd import GradFn
from torchlens.viz.examples import example_trace

#: a hand-written grad_fn graph for example_trace("mlp") (input -> linear -> relu -> linear -> output)
ROWS = [
    ["AddmmBackward0_2", "AddmmBackward0", [["AccumulateGrad_1", 0], ["ReluBackward0_1", 0], ["TBackward0_1", 0]],
     ["linear_2_3"], None],
    ["TBackward0_1", "TBackward0", [["AccumulateGrad_2", 0]], [], None],
    ["AccumulateGrad_2", "AccumulateGrad", [], [], "fc2.weight"],
    ["ReluBackward0_1", "ReluBackward0", [["AddmmBackward0_1", 0]], ["relu_1_2"], None],
    ["AddmmBackward0_1", "AddmmBackward0", [[None, 0], ["AccumulateGrad_3", 0]], ["linear_1_1"], None],
    ["AccumulateGrad_3", "AccumulateGrad", [], [], "fc1.weight"],
    ["AccumulateGrad_1", "AccumulateGrad", [], [], "fc2.bias"],
]


def _with_rows(rows=ROWS):
    t = example_trace("mlp")
    t.provenance.extra["grad_fns"] = {"format": 1, "roots": [rows[0][0]], "rows": [list(r) for r in rows]}
    return t


def test_rows_become_grad_fn_records_in_order():
    a = _with_rows().autograd
    assert a.grad_fn_order == tuple(r[0] for r in ROWS)
    first = a.grad_fns[0]
    assert first == GradFn("AddmmBackward0_2", "AddmmBackward0",
                           (("AccumulateGrad_1", 0), ("ReluBackward0_1", 0), ("TBackward0_1", 0)), ("linear_2_3",),
                           None, 0)
    assert a.grad_fns["AddmmBackward0_1"].next_functions == ((None, 0), ("AccumulateGrad_3", 0))
    assert a.grad_fns["AddmmBackward0_1"].next_labels == ("AccumulateGrad_3",)  # the None edge is no arrow
    assert len(a.grad_fns.edges) == 6
    assert [g.label for g in a.grad_fns.without_op] == ["TBackward0_1"]
    assert a.grad_fns.roots == ("AddmmBackward0_2",)
    assert "grad_fns" not in a.unavailable and "backward_ready" in a.unavailable["grad_fn_calls"]


def test_lookup_by_grad_fn_label_op_label_substring():
    g = _with_rows().autograd.grad_fns
    assert g["relu_1_2"].label == "ReluBackward0_1"  # an op label gives the op's grad_fn
    assert g["Relu"].label == "ReluBackward0_1"  # a substring of exactly one label
    with pytest.raises(AmbiguousOpLookupError) as e:
        g["Addmm"]
    assert e.value.code == "ambiguous_op_lookup" and len(e.value.fields["matches"]) == 2
    with pytest.raises(LookupMissError) as e:
        g["conv2d_1_1"]
    assert e.value.code == "label_unknown"
    with pytest.raises(LookupMissError):
        g[99]
    assert g.get("nothing") is None and "relu_1_2" in g and "ReluBackward0_1" in g


def test_no_records_say_why():
    t = example_trace("mlp")
    a = t.autograd
    assert a.grad_fns is None and a.grad_fn_order is None and a.grad_fn_calls is None
    assert "numpy backend records no grad_fn graph" in a.unavailable["grad_fns"]
    t.provenance.extra["grad_fns"] = {"format": 99, "rows": []}
    assert "unknown format" in t.autograd.unavailable["grad_fns"]
    t.provenance.extra["grad_fns"] = {"format": 1, "rows": None, "why": "ran under no_grad"}
    assert t.autograd.unavailable["grad_fns"] == "ran under no_grad"


def test_calls_rows_become_grad_fn_calls():
    t = _with_rows()
    t.provenance.extra["grad_fn_calls"] = [["AddmmBackward0_2", 1], ["ReluBackward0_1", 1], ["AddmmBackward0_2", 2]]
    calls = t.autograd.grad_fn_calls
    assert [(c.label, c.backward_pass, c.index) for c in calls] == [
        ("AddmmBackward0_2", 1, 0), ("ReluBackward0_1", 1, 1), ("AddmmBackward0_2", 2, 2)]


def _arrows(source):
    names = {m.group(1): m.group(2).split("\\n")[0]
             for m in re.finditer(r'^\s*(\w+) \[label="([^"]*)"', source, flags=re.M)}
    out = set()
    for m in re.finditer(r'^\s*(\w+) -> (\w+)(?: \[(.*)\])?;$', source, flags=re.M):
        a, b, attrs = names[m.group(1)], names[m.group(2)], m.group(3) or ""
        out.add((b, a) if 'dir="back"' in attrs else (a, b))
    return names, out


def test_backward_drawing_from_hand_written_records(tmp_path):
    other = [list(r) for r in ROWS]
    other[3] = ["ReluBackward0_1", "ReluBackward0", [["AddmmBackward0_1", 0]], [], None]  # b: relu not linked
    bundle = Bundle({"a": _with_rows(), "b": _with_rows(other)})
    d = bundle.draw(tmp_path / "bw.dot", graph="backward")
    names, arrows = _arrows(str(d))
    assert set(names.values()) == {r[0] for r in ROWS}
    assert arrows == {("AddmmBackward0_2", "AccumulateGrad_1"), ("AddmmBackward0_2", "ReluBackward0_1"),
                      ("AddmmBackward0_2", "TBackward0_1"), ("TBackward0_1", "AccumulateGrad_2"),
                      ("ReluBackward0_1", "AddmmBackward0_1"), ("AddmmBackward0_1", "AccumulateGrad_3")}
    c = bundle.draw(tmp_path / "c.dot", graph="combined")
    names, arrows = _arrows(str(c))
    links = {(a, b) for a, b in arrows if not a[0].isupper() and b[0].isupper()}
    assert links == {("linear_2_3", "AddmmBackward0_2"), ("relu_1_2", "ReluBackward0_1"),
                     ("linear_1_1", "AddmmBackward0_1")}
    assert re.search(r'-> \w+ \[style="dotted", arrowhead="none", constraint="false", color="[^"]+", label="a"\]',
                     str(c))  # the relu link only member a has
    assert c.num_edges == len(example_trace("mlp").graph_edges) + 6 + 3


def test_member_without_records_refuses_before_writing(tmp_path):
    bundle = Bundle({"a": _with_rows(), "plain": example_trace("mlp")})
    with pytest.raises(BundleError) as e:
        bundle.draw(tmp_path / "x.dot", graph="combined")
    assert e.value.code == "bundle_draw_grad_fns_missing" and e.value.fields["member"] == "plain"
    assert "numpy backend" in e.value.fields["reason"] and "graph='forward'" in e.value.remedy
    assert not (tmp_path / "x.dot").exists()


def _deferred(calls):
    """A trace whose backend deferred its grad_fn rows to the first read (as torch's save="all"
    capture does): the rows exist only once `Provenance.settle_extra` runs the pending entry."""
    t = example_trace("mlp")

    def walk():
        calls.append(1)
        t.provenance.extra["grad_fns"] = {"format": 1, "roots": [ROWS[0][0]], "rows": [list(r) for r in ROWS]}

    t.provenance.__dict__["_deferred_extra"] = {"grad_fns": walk}
    return t


def test_a_deferred_walk_runs_once_on_the_first_read():
    calls = []
    t = _deferred(calls)
    assert "grad_fns" not in t.provenance.extra and not calls
    assert t.autograd.grad_fn_order == tuple(r[0] for r in ROWS) and calls == [1]
    assert t.autograd.grad_fns["relu_1_2"].label == "ReluBackward0_1" and calls == [1]  # settled: not again
    assert not t.provenance.__dict__["_deferred_extra"]


def test_save_export_pickle_and_cleanup_settle_a_deferred_walk(tmp_path):
    import pickle

    import torchlens as tl

    expect = _with_rows().autograd.grad_fns
    for how in ("save", "export", "pickle", "cleanup", "draw"):
        calls = []
        t = _deferred(calls)
        if how == "save":
            t.save(str(tmp_path / "t.tlspec"))
            back = tl.load(str(tmp_path / "t.tlspec"))
        elif how == "export":
            back = tl.export.safetensors(t, str(tmp_path / "t.safetensors"))
            back = tl.io.read_safetensors(str(tmp_path / "t.safetensors"))
        elif how == "pickle":
            back = pickle.loads(pickle.dumps(t.provenance))
            assert "_deferred_extra" not in back.__dict__
        elif how == "cleanup":
            t.cleanup()
            back = t
        else:
            Bundle({"a": t}).draw(tmp_path / "bw.dot", graph="backward")
            back = t
        assert calls == [1], how  # the walk ran before the rows were needed
        if how == "export":  # the header keeps provenance.extra as tagged JSON
            assert "ReluBackward0_1" in json.dumps(back.trace_fields["provenance.extra"], default=str)
            continue
        extra = back.provenance.extra if hasattr(back, "provenance") else back.extra
        assert extra["grad_fns"]["rows"] == [list(r) for r in ROWS], how
    assert t.autograd.grad_fns == expect
