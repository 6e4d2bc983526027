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
    assert not _pending(t)  # nothing to walk: the reason is stored at capture time, no node is held
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

    def broken(*args):
        raise RuntimeError("next_functions unavailable")

    monkeypatch.setattr(records, "_walk", broken)
    # deferred (save="all") and eager (save="none"): the failure is kept as the reason either way
    for save in ("all", "none"):
        t = tl.trace(MLP(), torch.randn(2, 3), save=save)
        assert t.output.shape == (2, 2) and t.autograd.grad_fns is None
        assert "next_functions unavailable" in t.autograd.unavailable["grad_fns"]
    monkeypatch.setattr(records, "_prepare", broken)  # the part read at capture time
    t = tl.trace(MLP(), torch.randn(2, 3))
    assert t.output.shape == (2, 2) and "next_functions unavailable" in t.autograd.unavailable["grad_fns"]


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


# --- the walk deferred to the first read (issue 26) -------------------------------------------------------------


class SmallCNN(nn.Module):
    """Conv, eval batch norm, in-place ReLU, a residual add and a pooled linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu_(self.bn(self.conv(x)))
        h = h + self.conv2(h)
        return self.fc(h.mean(dim=(2, 3)))


def _stored(t):
    """The stored record dict, read through the accessor (which settles a deferred walk)."""
    assert t.autograd.grad_fns is not None
    return t.provenance.extra["grad_fns"]


def _pending(t) -> bool:
    return bool(t.provenance.__dict__.get("_deferred_extra"))


def _eager(monkeypatch):
    """Force the walk at capture time (the issue-25 behaviour) for the captures that follow."""
    import torchlens_torch.autograd_records as records

    monkeypatch.setattr(records, "_holds_every_seed", lambda *a: False)


def _cases():
    torch.manual_seed(0)
    return [(MLP(extra=True), torch.randn(2, 3)), (Branchy(), torch.randn(2, 4, requires_grad=True)),
            (SmallCNN().eval(), torch.randn(1, 3, 6, 6))]


def test_deferred_records_equal_the_eager_walk(monkeypatch):
    """A save="all" capture walks nothing until the first read; what it then stores equals the
    rows the walk at capture time stores (labels, edges, input_nr, op links, parameters)."""
    lazy = []
    for model, x in _cases():
        t = tl.trace(model, x)
        assert _pending(t) and "grad_fns" not in t.provenance.extra  # nothing walked yet
        lazy.append(t)
    _eager(monkeypatch)
    for (model, x), t in zip(_cases(), lazy):
        e = tl.trace(model, x)
        assert not _pending(e) and "grad_fns" in e.provenance.extra  # walked during the capture
        assert _stored(t) == e.provenance.extra["grad_fns"]
        assert not _pending(t)  # the read ran it, once
        mapping, _ = _pair(t.output.grad_fn, t.autograd.grad_fns)  # and it is torch's graph
        assert len(mapping) == len(t.autograd.grad_fns)
    # which captures defer: only where the trace's payloads already hold the whole graph
    model, x = _cases()[0]
    monkeypatch.undo()
    assert _pending(tl.trace(model, x, capture=tl.CaptureOptions(save_mode="reference")))
    for save, capture in (("none", None), ("stats", None), ("all", tl.CaptureOptions(detach_saved_activations=True)),
                          ("all", tl.CaptureOptions(save_mode="view")), ("all", tl.CaptureOptions(backward_ready=True)),
                          (["linear_1_1"], None)):
        t = tl.trace(model, x, save=save, capture=capture)
        assert not _pending(t) and t.provenance.extra["grad_fns"]["rows"], (save, capture)


def test_output_changed_in_place_after_capture_keeps_the_capture_graph(monkeypatch):
    """The roots are the output's grad_fns at the end of the forward, not whatever the output
    tensor carries when the records are first read."""
    model, x = _cases()[2]
    t = tl.trace(model, x)
    before = t.output.grad_fn
    t.output.mul_(3)  # a new grad_fn on the output: MulBackward0 -> the capture's AddmmBackward0
    assert t.output.grad_fn is not before and type(t.output.grad_fn).__name__ == "MulBackward0"
    rows = _stored(t)
    assert not any(r[1] == "MulBackward0" for r in rows["rows"])
    _eager(monkeypatch)
    assert rows == _stored(tl.trace(model, x))
    assert rows["roots"] == [_pair(before, t.autograd.grad_fns)[0][id(before)]]


def test_backward_before_the_first_read_gives_the_same_records(monkeypatch):
    """A backward frees the saved tensors, not the graph: next_functions and
    AccumulateGrad.variable stay readable, so the deferred walk still gives the eager records."""
    lazy = []
    for model, x in _cases():
        t = tl.trace(model, x)
        t.output.sum().backward()
        assert _pending(t)
        lazy.append(t)
    _eager(monkeypatch)
    for (model, x), t in zip(_cases(), lazy):
        assert _stored(t) == _stored(tl.trace(model, x))
        params = dict(model.named_parameters())
        assert {g.param for g in t.autograd.grad_fns if g.param} == set(params)


def test_save_and_pickle_before_the_first_read_keep_the_records(tmp_path, monkeypatch):
    import pickle

    model, x = _cases()[1]
    t = tl.trace(model, x)
    assert _pending(t)
    path = str(tmp_path / "t.tlspec")
    t.save(path)  # the save settles the walk first: the file holds the records
    t2 = tl.trace(model, x)
    copied = pickle.loads(pickle.dumps(t2.provenance))
    _eager(monkeypatch)
    eager = _stored(tl.trace(model, x))
    assert tl.load(path).provenance.extra["grad_fns"] == eager == _stored(t)
    assert copied.extra["grad_fns"] == eager and not copied.__dict__.get("_deferred_extra")
    assert not _pending(t) and not _pending(t2)


def test_a_fork_reads_the_records_after_its_root_is_gone(monkeypatch):
    import gc

    model, x = _cases()[0]
    t = tl.trace(model, x)
    fork = t.fork()
    del t
    gc.collect()
    _eager(monkeypatch)
    assert _stored(fork) == _stored(tl.trace(model, x))


class Discards(nn.Module):
    """Computes a branch it does not return: the branch's autograd nodes hold `u` for
    backward, and nothing else does once the forward is over (unless the capture keeps it)."""

    probe: list = []
    probe_h: list = []

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        import weakref

        h = self.a(x)  # saved by the returned linear's AddmmBackward0
        Discards.probe_h.append(weakref.ref(h))
        u = torch.sin(h)
        v = u * u  # noqa: F841 - discarded: MulBackward0 saves u
        Discards.probe.append(weakref.ref(u))
        return self.b(h)


def test_deferred_walk_keeps_nothing_alive_the_eager_walk_released():
    """save="none" / "stats" walk at once: the discarded branch's saved activation is freed
    when the capture returns, as before. save="all" defers: its payloads hold that activation
    anyway (eager too), and cleanup() settles the walk and releases it with the payloads; the
    output's own graph goes when the caller drops the output."""
    import gc

    model, x = Discards(), torch.randn(2, 3)
    for save in ("none", "stats"):
        t = tl.trace(model, x, save=save)
        gc.collect()
        assert Discards.probe[-1]() is None, save  # released by the capture, nothing waits on it
        assert t.autograd.grad_fns is not None
    t = tl.trace(model, x)
    gc.collect()
    assert _pending(t) and Discards.probe[-1]() is not None  # the payloads hold it (as for an eager walk)
    out = t.output
    t.cleanup()
    gc.collect()
    assert Discards.probe[-1]() is None  # the pending walk went with the payloads
    assert not _pending(t)
    assert len(t.autograd.grad_fns) > 0  # the records stay readable after cleanup
    assert Discards.probe_h[-1]() is not None  # the caller's output still holds its graph
    del out
    gc.collect()
    assert Discards.probe_h[-1]() is None  # and nothing else does


def test_every_node_a_deferred_walk_holds_is_held_by_the_trace_already():
    """The memory rule for the captures that defer: each root and seed node the pending walk
    holds is reachable from a payload the trace keeps or from its output, so holding them
    keeps nothing alive that the trace would otherwise release."""
    for model, x in _cases():
        for capture in (None, tl.CaptureOptions(save_mode="reference")):
            t = tl.trace(model, x, capture=capture)
            walk = t.provenance.__dict__["_deferred_extra"]["grad_fns"]
            roots, found = walk.args[0], walk.args[1]
            held, todo = {}, [o.grad_fn for op in t._ops.values() for o in op._outputs if isinstance(o, torch.Tensor)]
            todo.append(t.output.grad_fn)
            while todo:
                n = todo.pop()
                if n is not None and id(n) not in held:
                    held[id(n)] = n
                    todo.extend(m for m, _ in n.next_functions)
            assert found and all(id(g) in held for _, g in found) and all(id(r) in held for r in roots)


def test_grad_fn_calls_ignore_a_backward_through_another_capture_of_the_same_model():
    """torch shares a parameter's AccumulateGrad node between live graphs: a backward through
    one capture's graph (or a loss on a parameter alone) runs it, and must not be recorded as
    a run of another capture's graph."""
    torch.manual_seed(0)
    model = MLP()
    opts = tl.CaptureOptions(backward_ready=True)
    first = tl.trace(model, torch.randn(2, 3), capture=opts)
    second = tl.trace(model, torch.randn(2, 3), capture=opts)
    mapping, hold = _pair(second.output.grad_fn, second.autograd.grad_fns)
    fired = []
    for n in hold:
        n.register_prehook(lambda g, n=n: fired.append(mapping[id(n)]))
    second.backward(second.output.sum())
    model.a.weight.sum().backward()  # a loss on a parameter alone: runs the shared AccumulateGrad only
    assert first.autograd.grad_fn_calls is None and "no backward pass" in first.autograd.unavailable["grad_fn_calls"]
    assert [c.label for c in second.autograd.grad_fn_calls] == fired[:len(second.autograd.grad_fns)]
    assert len(second.autograd.grad_fn_calls) == len(second.autograd.grad_fns)
    first.backward(first.output.sum())  # its own backward is recorded in full
    assert len(first.autograd.grad_fn_calls) == len(first.autograd.grad_fns)


def test_a_second_reader_waits_for_a_deferred_walk_another_thread_is_running():
    """Two threads read one trace's records: the one that does not run the walk waits for it
    instead of reading "no records" while the walk is under way."""
    import threading
    import time

    model, x = _cases()[0]
    t = tl.trace(model, x)
    pending = t.provenance.__dict__["_deferred_extra"]
    (key, walk), = pending.items()
    started = threading.Event()

    def slow_walk():
        started.set()
        time.sleep(0.3)  # a long walk: the second reader arrives while it runs
        walk()

    pending[key] = slow_walk
    got = {}
    first = threading.Thread(target=lambda: got.setdefault("first", t.autograd.grad_fns))
    first.start()
    assert started.wait(5)
    got["second"] = t.autograd.grad_fns  # arrives mid-walk
    first.join(5)
    assert got["second"] is not None and got["first"] is not None
    assert got["second"].labels == got["first"].labels and len(got["second"]) > 0
