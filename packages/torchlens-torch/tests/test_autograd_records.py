"""grad_fn records (`trace.autograd.grad_fns`, `grad_fn_order`, `grad_fn_calls`) and the
backward / combined bundle drawings, checked against torch's own autograd graph: a manual
walk of `out.grad_fn.next_functions`, forward hooks and autograd pre-hooks in the test."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.bundle import Bundle
from torchlens.errors import BundleError


class MLP(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.act = nn.ReLU()
        self.b = nn.Linear(4, 2)
        self.extra = extra

    def forward(self, x):
        h = self.act(self.a(x))
        if self.extra:
            h = h * 2
        return self.b(h)


class Branchy(nn.Module):
    """A multi-output op (chunk), a reused parameter and an input that requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        p, q = self.a(x).chunk(2, dim=-1)
        r = torch.tanh(p) * q
        return self.a(torch.cat([r, r], dim=-1)).sum(dim=-1)


def _pair(live_root, grad_fns):
    """Walk torch's graph from `live_root` alongside the records from their first root and
    return {id(live node): label}, asserting names and edges agree at every node and that the
    map is one-to-one. Live nodes are held in `hold` so their ids stay valid."""
    records = {g.label: g for g in grad_fns}
    mapping: dict[int, str] = {}
    hold = []
    stack = [(live_root, grad_fns.roots[0])]
    while stack:
        node, label = stack.pop()
        if id(node) in mapping:
            assert mapping[id(node)] == label, "one live node, two labels"
            continue
        hold.append(node)
        mapping[id(node)] = label
        rec = records[label]
        assert rec.name == type(node).__name__
        live_next = node.next_functions
        assert len(rec.next_functions) == len(live_next)
        for (nxt, i), (lbl, j) in zip(live_next, rec.next_functions):
            assert i == j
            assert (nxt is None) == (lbl is None)
            if nxt is not None:
                stack.append((nxt, lbl))
    assert len(set(mapping.values())) == len(mapping), "two live nodes share a label"
    return mapping, hold


def test_grad_fns_equal_a_manual_walk_of_next_functions():
    torch.manual_seed(0)
    for model in (MLP(), Branchy()):
        x = torch.randn(2, model.a.in_features, requires_grad=isinstance(model, Branchy))
        t = tl.trace(model, x)
        gf = t.autograd.grad_fns
        mapping, hold = _pair(t.output.grad_fn, gf)
        assert len(mapping) == len(gf)  # every record is a node of torch's graph, and every node is recorded
        # a plain forward (no TorchLens) builds a graph of the same shape: count node types by hand
        plain = model(x)
        seen, todo, names = set(), [plain.grad_fn], []
        while todo:
            n = todo.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            names.append(type(n).__name__)
            todo.extend(m for m, _ in n.next_functions)
        assert sorted(names) == sorted(g.name for g in gf)
        # grad_fn_order is topological: each node comes before every node it sends gradient to
        pos = {lbl: i for i, lbl in enumerate(t.autograd.grad_fn_order)}
        assert all(pos[a] < pos[b] for a, b in gf.edges)
        # labels are stable: a second capture gives the same records
        assert tl.trace(model, x).autograd.grad_fns == gf


def test_forward_op_link_equals_the_hooked_output_grad_fn():
    torch.manual_seed(0)
    model = MLP()
    hooked = {}
    handles = [m.register_forward_hook(lambda mod, i, o, name=name: hooked.__setitem__(name, o.grad_fn))
               for name, m in model.named_children()]
    try:
        t = tl.trace(model, torch.randn(2, 3))
    finally:
        for h in handles:
            h.remove()
    mapping, hold = _pair(t.output.grad_fn, t.autograd.grad_fns)
    assert set(hooked) == {"a", "act", "b"}
    for name, live in hooked.items():
        call = t.module_calls[f"{name}:1"]
        (op_label,) = call.output_labels
        rec = t.autograd.grad_fns[op_label]  # looked up by the forward op's label
        assert rec.label == mapping[id(live)]  # the very node torch hung on that op's output
        assert rec.op == op_label
    # AccumulateGrad nodes point at exactly the model's parameters, by identity
    params = dict(model.named_parameters())
    accs = {g.param: g for g in t.autograd.grad_fns if g.is_accumulate_grad}
    assert set(accs) == set(params)
    by_label = {lbl: k for k, lbl in mapping.items()}
    live_nodes = {id(n): n for n in hold}
    for addr, g in accs.items():
        assert live_nodes[by_label[g.label]].variable is params[addr]
    # nodes no recorded op produced: the weight transposes inside F.linear
    assert sorted(g.name for g in t.autograd.grad_fns.without_op) == ["TBackward0", "TBackward0"]


def test_input_requiring_grad_links_its_accumulate_grad_to_the_input_op():
    x = torch.randn(2, 4, requires_grad=True)
    t = tl.trace(Branchy(), x)
    (acc,) = [g for g in t.autograd.grad_fns if g.is_accumulate_grad and g.param is None]
    assert acc.ops == ("input_1",)
    chunk = [g for g in t.autograd.grad_fns if g.name == "SplitBackward0"]
    assert len(chunk) == 1 and len(chunk[0].ops) == 1  # one node for both outputs of the chunk op


def test_no_grad_capture_has_no_records_and_says_why():
    with torch.no_grad():
        t = tl.trace(MLP(), torch.randn(2, 3))
    a = t.autograd
    assert a.grad_fns is None and a.grad_fn_order is None and a.grad_fn_calls is None
    assert "no_grad" in a.unavailable["grad_fns"]


def test_records_survive_save_and_load_as_plain_data(tmp_path):
    t = tl.trace(MLP(), torch.randn(2, 3), capture=tl.CaptureOptions(backward_ready=True))
    t.backward(t.output.sum())
    stored = t.provenance.extra["grad_fns"]
    json.dumps(stored)  # plain data only: no autograd object in what is saved
    path = str(tmp_path / "t.tlspec")
    t.save(path)
    loaded = tl.load(path)
    assert loaded.autograd.grad_fns == t.autograd.grad_fns
    assert loaded.autograd.grad_fn_order == t.autograd.grad_fn_order
    assert loaded.autograd.grad_fn_calls == t.autograd.grad_fn_calls
    # a saved bundle's members keep them too, and draw the same backward graph after loading
    bundle = Bundle({"a": t, "b": tl.trace(MLP(), torch.randn(2, 3))})
    bundle.save(str(tmp_path / "bundle"))
    again = Bundle.load(str(tmp_path / "bundle"))
    assert again["a"].autograd.grad_fns == t.autograd.grad_fns
    assert str(again.draw(tmp_path / "l.dot", graph="backward")) == str(bundle.draw(tmp_path / "o.dot", graph="backward"))
    del loaded.provenance.extra["grad_fns"]  # what an artifact from an older build looks like
    loaded.__dict__.pop("_grad_fn_cache", None)
    assert loaded.autograd.grad_fns is None and "saved by a build" in loaded.autograd.unavailable["grad_fns"]


def test_grad_fn_calls_follow_the_backward_torch_runs():
    torch.manual_seed(0)
    t = tl.trace(MLP(), torch.randn(2, 3), capture=tl.CaptureOptions(backward_ready=True))
    assert t.autograd.grad_fn_calls is None and "no backward pass" in t.autograd.unavailable["grad_fn_calls"]
    mapping, hold = _pair(t.output.grad_fn, t.autograd.grad_fns)
    fired = []
    for n in hold:  # the test's own pre-hooks on the same live nodes
        n.register_prehook(lambda g, n=n: fired.append(mapping[id(n)]))
    t.backward(t.output.sum(), retain_graph=True)
    calls = t.autograd.grad_fn_calls
    assert [c.label for c in calls] == fired and len(fired) == len(t.autograd.grad_fns)
    assert {c.backward_pass for c in calls} == {1}
    t.backward(t.output.sum())  # a second pass through the retained graph
    calls = t.autograd.grad_fn_calls
    assert [c.label for c in calls] == fired and len(fired) == 2 * len(t.autograd.grad_fns)
    assert [c.backward_pass for c in calls] == [1] * len(t.autograd.grad_fns) + [2] * len(t.autograd.grad_fns)
    # a capture that is not backward_ready records no runs (no hooks were put on its graph)
    plain = tl.trace(MLP(), torch.randn(2, 3))
    assert plain.autograd.grad_fn_calls is None and "backward_ready" in plain.autograd.unavailable["grad_fn_calls"]


def _dot_graph(source: str):
    """{node id: first label line} and the set of (from label, to label) arrows, a `dir=back`
    arrow read the way it points."""
    labels = {m.group(1): m.group(2).split("\\n")[0]
              for m in re.finditer(r'^\s*(\w+) \[label="([^"]*)"', source, flags=re.M)}
    edges = set()
    for m in re.finditer(r'^\s*(\w+) -> (\w+)(?: \[(.*)\])?;$', source, flags=re.M):
        a, b, attrs = m.group(1), m.group(2), m.group(3) or ""
        pair = (labels[b], labels[a]) if 'dir="back"' in attrs else (labels[a], labels[b])
        edges.add((pair, re.search(r'label="([^"]*)"', attrs).group(1) if 'label="' in attrs else None))
    return labels, edges


def _mlp_bundle():
    torch.manual_seed(0)
    clean, extra = MLP(), MLP(extra=True)
    extra.load_state_dict(clean.state_dict())
    x = torch.randn(2, 3)
    return Bundle({"clean": tl.trace(clean, x), "extra": tl.trace(extra, x)})


#: the two-member backward union, written by hand from the MLP: a -> relu -> (x2 in extra) -> b
EXPECTED_NODES = {"AddmmBackward0_1", "AddmmBackward0_2", "ReluBackward0_1", "MulBackward0_1", "TBackward0_1",
                  "TBackward0_2", "AccumulateGrad_1", "AccumulateGrad_2", "AccumulateGrad_3", "AccumulateGrad_4"}
EXPECTED_EDGES = {
    (("AddmmBackward0_2", "AccumulateGrad_3"), None),  # b.bias
    (("AddmmBackward0_2", "TBackward0_2"), None), (("TBackward0_2", "AccumulateGrad_4"), None),  # b.weight
    (("AddmmBackward0_2", "ReluBackward0_1"), "clean"),
    (("AddmmBackward0_2", "MulBackward0_1"), "extra"), (("MulBackward0_1", "ReluBackward0_1"), "extra"),
    (("ReluBackward0_1", "AddmmBackward0_1"), None),
    (("AddmmBackward0_1", "AccumulateGrad_1"), None),  # a.bias
    (("AddmmBackward0_1", "TBackward0_1"), None), (("TBackward0_1", "AccumulateGrad_2"), None),  # a.weight
}


def test_backward_union_drawing_has_exactly_the_expected_nodes_and_edges(tmp_path):
    bundle = _mlp_bundle()
    d = bundle.draw(tmp_path / "bw.dot", graph="backward")
    labels, edges = _dot_graph(str(d))
    assert set(labels.values()) == EXPECTED_NODES
    assert edges == EXPECTED_EDGES
    assert d.num_nodes == len(EXPECTED_NODES) and d.num_edges == len(EXPECTED_EDGES)
    assert re.search(r'label="MulBackward0_1\\n<- mul_1_3\\nin: extra"', str(d))
    assert 'label="AccumulateGrad_3\\nparam b.bias"' in str(d)  # labels count in forward order
    # the grad_fn both members share is linked to each member's op label
    assert 'AddmmBackward0_2\\n<- linear_2_3, linear_2_4"' in str(d)
    assert os.path.exists(d.path)


def test_combined_drawing_links_each_forward_op_to_its_grad_fn(tmp_path):
    bundle = _mlp_bundle()
    d = bundle.draw(tmp_path / "c.dot", graph="combined")
    labels, edges = _dot_graph(str(d))
    forward = set(bundle["clean"]._ops) | set(bundle["extra"]._ops)
    assert set(labels.values()) == EXPECTED_NODES | forward
    links = {(pair, who) for pair, who in edges if pair[0] in forward and pair[1] in EXPECTED_NODES}
    # each member's own op -> grad_fn identity, from its records (checked against torch above)
    expect = set()
    for name in bundle.names:
        for g in bundle[name].autograd.grad_fns:
            for op in g.ops:
                expect.add((op, g.label))
    assert {pair for pair, _ in links} == expect == {
        ("linear_1_1", "AddmmBackward0_1"), ("relu_1_2", "ReluBackward0_1"), ("linear_2_3", "AddmmBackward0_2"),
        ("mul_1_3", "MulBackward0_1"), ("linear_2_4", "AddmmBackward0_2")}
    assert dict(links)[("linear_2_3", "AddmmBackward0_2")] == "clean"
    assert dict(links)[("relu_1_2", "ReluBackward0_1")] is None  # both members link it
    png = bundle.draw(tmp_path / "c.png", graph="combined")
    with open(png.path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_member_without_grad_fn_records_refuses_naming_it(tmp_path):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 3)
    with torch.no_grad():
        frozen = tl.trace(model, x)
    bundle = Bundle({"clean": tl.trace(model, x), "nograd": frozen})
    for graph in ("backward", "combined"):
        with pytest.raises(BundleError) as e:
            bundle.draw(tmp_path / f"{graph}.dot", graph=graph)
        assert e.value.code == "bundle_draw_grad_fns_missing" and e.value.fields["member"] == "nograd"
        assert "nograd" in str(e.value) and "no_grad" in e.value.remedy
        assert not os.path.exists(tmp_path / f"{graph}.dot")
    with pytest.raises(tl.errors.ArgumentTypeError) as e:
        bundle.draw(tmp_path / "r.dot", graph="backward", rolled=True)
    assert e.value.code == "bundle_draw_keyword_unsupported"


def test_a_graph_the_walk_cannot_read_leaves_no_records_and_the_capture_stands(monkeypatch):
    import torchlens_torch.autograd_records as records

    def broken(trace, rec, output):
        raise RuntimeError("next_functions unavailable")

    monkeypatch.setattr(records, "_record", broken)
    t = tl.trace(MLP(), torch.randn(2, 3))
    assert t.output.shape == (2, 2) and t.autograd.grad_fns is None
    assert "next_functions unavailable" in t.autograd.unavailable["grad_fns"]


def test_an_ablated_member_keeps_the_labels_of_the_nodes_it_still_runs(tmp_path):
    """zero_ablate on the ReLU cuts the output's graph there: the ablated member's backward
    graph is only the last linear's nodes, under the same labels the clean member gives them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    clean = tl.trace(model, x)
    ablated = tl.trace(model, x, intervene=tl.when(tl.module("1"), tl.zero_ablate()))
    live = ablated.output.grad_fn  # torch's own graph of the ablated run: addmm -> (bias, t -> weight) only
    names = sorted(type(n).__name__ for n in (live, *[m for m, _ in live.next_functions if m is not None]))
    assert "ReluBackward0" not in names and len(ablated.autograd.grad_fns) == 4
    assert set(ablated.autograd.grad_fns.labels) < set(clean.autograd.grad_fns.labels)
    d = Bundle({"clean": clean, "ablated": ablated}).draw(tmp_path / "a.dot", graph="backward")
    labels, edges = _dot_graph(str(d))
    only_clean = {"ReluBackward0_1", "AddmmBackward0_1", "TBackward0_1", "AccumulateGrad_1", "AccumulateGrad_2"}
    for nid, label in labels.items():
        assert (f'{nid} [label="{label}' in str(d)) and (("in: clean" in re.search(
            rf'^\s*{nid} \[label="([^"]*)"', str(d), flags=re.M).group(1)) == (label in only_clean))
    assert {pair for pair, who in edges if who == "clean"} == {
        ("AddmmBackward0_2", "ReluBackward0_1"), ("ReluBackward0_1", "AddmmBackward0_1"),
        ("AddmmBackward0_1", "AccumulateGrad_1"), ("AddmmBackward0_1", "TBackward0_1"),
        ("TBackward0_1", "AccumulateGrad_2")}


def test_save_stats_capture_links_grad_fns_of_outs_freed_during_the_forward():
    """save="stats" keeps no outs, so most outs are freed while the forward runs; their grad_fns
    still get the forward op link and the label a save="all" capture (checked above against
    torch's own graph) gives them."""
    torch.manual_seed(0)
    for model in (MLP(extra=True), Branchy()):
        x = torch.randn(2, model.a.in_features, requires_grad=isinstance(model, Branchy))
        full = tl.trace(model, x).autograd.grad_fns
        folded = tl.trace(model, x, save="stats").autograd.grad_fns
        rows = lambda gf: [(g.label, g.name, g.ops, g.next_labels, g.param) for g in gf]  # noqa: E731
        assert rows(folded) == rows(full)
        assert sum(1 for g in folded if g.ops) >= 3  # the links are there, not all empty on both sides
