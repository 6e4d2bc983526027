"""Trace.draw(fold_repeats=True) and show_containers="collapsed"/"nodes" on torch models.

Expected node/edge counts come from the op records alone (each op mapped to the node it
must land on, by hand rules below), never from the renderer's own IR.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import InvalidArgumentError


class Block(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU()

    def forward(self, x):
        return x + self.act(self.fc(x))


def _seq(n_blocks: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), *[Block() for _ in range(n_blocks)], nn.Linear(4, 2))


def _expected(trace, hidden_calls, box_depth: int | None = None) -> tuple[int, set[tuple[str, str]]]:
    """(nodes, edges) when every op inside one of `hidden_calls` lands on its run's '+N more'
    node (a set: one run; a dict: call -> run name) and (with box_depth) every op deeper
    than box_depth lands on its module-call box."""
    runs = hidden_calls if isinstance(hidden_calls, dict) else dict.fromkeys(hidden_calls, "run")

    def group(op) -> str:
        calls = [c for c, a in zip(op.module_calls, op.modules) if a != "self"]
        for c in calls:
            if c in runs:
                return "MORE:" + runs[c]
        if box_depth is not None and len(calls) >= box_depth:
            return "box:" + calls[box_depth - 1]
        return op.label

    groups = {op.label: group(op) for op in trace}
    edges = {(groups[p], groups[op.label]) for op in trace for p in op.parents if groups[p] != groups[op.label]}
    return len(set(groups.values())), edges


def _node_titles(source: str) -> list[str]:
    return re.findall(r'VALIGN="TOP"><B>([^<]*)</B>', source)


def test_sequential_of_blocks_folds_to_representative_plus_more(tmp_path):
    trace = tl.trace(_seq(4), torch.randn(2, 4))
    full = trace.draw(tmp_path / "full.dot")
    d = trace.draw(tmp_path / "fold.dot", fold_repeats=True)
    n, edges = _expected(trace, {"2:1", "3:1", "4:1"})
    assert full.num_nodes == trace.num_ops == 16
    # input, linear 0, block 1's three ops, '+3 more', linear 5, output
    assert d.num_nodes == n == 8
    assert d.num_edges == len(edges) == 8
    src = str(d)
    assert "+3 more" in _node_titles(src)
    assert "2 .. 4: Block" in src and "3 x 3 ops" in src
    assert src.count(" -> ") == 8
    # every op of blocks 2..4 maps to the one '+N more' node, block 1 keeps its own nodes
    more = {d.node_ids[op.label] for op in trace if op.modules[1:2] and op.modules[1] in ("2", "3", "4")}
    assert len(more) == 1
    assert len({d.node_ids[op.label] for op in trace if len(op.modules) > 1 and op.modules[1] == "1"}) == 3
    assert "1 drawn, 2 .. 4 folded (+3 more)" in src


def test_fold_repeats_with_depth_folds_the_boxes(tmp_path):
    trace = tl.trace(_seq(4), torch.randn(2, 4))
    d = trace.draw(tmp_path / "f.dot", fold_repeats=True, depth=1)
    n, edges = _expected(trace, {"2:1", "3:1", "4:1"}, box_depth=1)
    assert (d.num_nodes, d.num_edges) == (n, len(edges)) == (6, 5)
    assert _node_titles(str(d)) == ["input_1", "0", "1", "+3 more", "5", "output_1"]


def test_fold_repeats_off_by_default_and_breaks_on_a_different_block(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), Block(8 // 2), nn.Linear(4, 8), Block(8), Block(8))
    trace = tl.trace(model, torch.randn(2, 4))
    assert "more" not in str(trace.draw(tmp_path / "a.dot"))
    d = trace.draw(tmp_path / "b.dot", fold_repeats=True)
    titles = _node_titles(str(d))
    # blocks 0..2 are one run (+2 more); blocks 4..5 (width 8) another (+1 more); linear 3 splits them
    assert titles.count("+2 more") == 1 and titles.count("+1 more") == 1
    n, edges = _expected(trace, {"1:1": "a", "2:1": "a", "5:1": "b"})
    assert (d.num_nodes, d.num_edges) == (n, len(edges))


def test_recurrence_is_not_run_folding(tmp_path):
    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = Block()

        def forward(self, x):
            for _ in range(3):
                x = self.cell(x)
            return x

    trace = tl.trace(Loop(), torch.randn(2, 4))
    plain = trace.draw(tmp_path / "a.dot")
    d = trace.draw(tmp_path / "b.dot", fold_repeats=True)
    assert d.num_nodes == plain.num_nodes == trace.num_ops  # same module called again: never folded
    assert "more" not in str(d)


def test_parallel_siblings_do_not_fold(tmp_path):
    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.q(x) * self.k(x) + self.v(x)

    trace = tl.trace(QKV(), torch.randn(2, 4))
    d = trace.draw(tmp_path / "a.dot", fold_repeats=True)
    assert "more" not in str(d) and d.num_nodes == trace.num_ops


def test_fold_repeats_rolled(tmp_path):
    trace = tl.trace(_seq(3), torch.randn(2, 4))
    d = trace.draw(tmp_path / "r.dot", fold_repeats=True, rolled=True)
    assert "+2 more" in _node_titles(str(d))
    assert d.num_nodes == len(trace.layers) - 6 + 1  # blocks 2 and 3 (3 layers each) -> one node
    more = d.node_ids[next(op.layer_label for op in trace if op.modules[1:2] == ("3",))]
    assert f"{more} -> {more}" not in str(d)  # block 2 feeding block 3 is inside the fold, not a loop
    plain = trace.draw(tmp_path / "p.dot", rolled=True)
    # plain: input->linear0, 4 per block (x->fc, fc->relu, relu->add, x->add) x3, add->linear4, linear4->output = 15
    # folded: input->linear0, block 1's 4, block1->'+2 more' (fc and residual merge), '+2 more'->linear4,
    # linear4->output = 8
    assert (plain.num_edges, d.num_edges) == (15, 8)


def test_gpt2_four_layers_fold(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=4, n_embd=16, n_head=2, n_positions=16, vocab_size=50,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    trace = tl.trace(model, torch.randint(0, 50, (1, 5)))
    hidden = {c for op in trace for c, a in zip(op.module_calls, op.modules)
              if a in ("transformer.h.1", "transformer.h.2", "transformer.h.3")}
    assert len(hidden) == 3
    d = trace.draw(tmp_path / "g.dot", fold_repeats=True)
    n, edges = _expected(trace, hidden)
    assert (d.num_nodes, d.num_edges) == (n, len(edges))
    titles = _node_titles(str(d))
    assert titles.count("+3 more") == 1
    assert "transformer.h.1 .. transformer.h.3: GPT2Block" in str(d)
    d2 = trace.draw(tmp_path / "g2.dot", fold_repeats=True, depth=2)
    n2, edges2 = _expected(trace, hidden, box_depth=2)
    assert (d2.num_nodes, d2.num_edges) == (n2, len(edges2))
    assert "transformer.h.0" in _node_titles(str(d2)) and "+3 more" in _node_titles(str(d2))


def test_bad_values_refuse_typed(tmp_path):
    trace = tl.trace(_seq(2), torch.randn(2, 4))
    for kwargs, code in [({"fold_repeats": "yes"}, "draw_option_invalid"),
                         ({"fold_repeats": 1}, "draw_option_invalid"),
                         ({"show_containers": "boxes"}, "visualization_show_containers_invalid"),
                         ({"show_containers": "auto"}, "visualization_show_containers_invalid"),
                         ({"show_containers": "cluster"}, "visualization_show_containers_invalid"),
                         ({"show_containers": "nodes", "container_max_inline": 0}, "draw_option_invalid"),
                         ({"container_max_inline": True}, "draw_option_invalid")]:
        with pytest.raises(InvalidArgumentError) as e:
            trace.draw(tmp_path / "x.dot", **kwargs)
        assert e.value.code == code, kwargs
        assert e.value.remedy
        assert not (tmp_path / "x.dot").exists()
    with pytest.raises(InvalidArgumentError) as e:
        trace.draw(tmp_path / "x.dot", show_containers="auto")
    assert "'collapsed'" in str(e.value)


class Fan(nn.Module):
    """Returns a dict: 'o' is a list of 14 same-shape leaves, 'h' a pair from split."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, d, xs):
        a = self.l(d["a"]) + d["b"]
        outs = [a * i for i in range(14)]
        h, c = torch.split(a + xs[0] + xs[1], 2, dim=1)
        return {"o": outs, "h": (h, c)}


def _fan_trace():
    torch.manual_seed(0)
    return tl.trace(Fan(), {"a": torch.randn(2, 4), "b": torch.randn(2, 4)}, [torch.randn(2, 4), torch.randn(2, 4)])


def test_show_containers_collapsed_folds_same_shape_leaves(tmp_path):
    trace = _fan_trace()
    plain = trace.draw(tmp_path / "p.dot")
    outs_o = [op for op in trace if op.kind == "output" and str(op.path).startswith("output['o']")]
    assert len(outs_o) == 14
    d = trace.draw(tmp_path / "c.dot", show_containers="collapsed")  # default max inline 12 < 14
    assert d.num_nodes == plain.num_nodes - 14 + 1
    box = {d.node_ids[op.label] for op in outs_o}
    assert len(box) == 1
    (bid,) = box
    assert d.ir.nodes[bid].title == "output['o'] x14"
    # the 14 mul ops each feed the box: 14 edges into it, nothing else changed
    into = [e for e in d.ir.edges if e[1] == bid]
    assert len(into) == 14
    assert d.num_edges == plain.num_edges
    # a higher limit keeps them inline; the 2-leaf 'h' tuple never folds
    d2 = trace.draw(tmp_path / "c2.dot", show_containers="collapsed", container_max_inline=14)
    assert d2.num_nodes == plain.num_nodes
    line = next(l for l in str(d).splitlines() if l.strip().startswith(bid + " "))
    assert "dashed" in line


def test_show_containers_nodes_records_and_keyed_ties(tmp_path):
    trace = _fan_trace()
    collapsed = trace.draw(tmp_path / "c.dot", show_containers="collapsed")
    d = trace.draw(tmp_path / "n.dot", show_containers="nodes")
    src = str(d)
    # containers by hand from the leaf paths: args[0] (dict a,b), args[1] (list 0,1),
    # output (dict o,h), output['o'] (list), output['h'] (tuple)
    records = [n for n in d.ir.nodes.values() if n.label_html is not None]
    assert sorted(n.title for n in records) == ["args[0]", "args[1]", "output", "output['h']", "output['o']"]
    assert d.num_nodes == collapsed.num_nodes + 5
    ties = [l for l in src.splitlines() if ":k" in l and "->" in l]
    # inputs: 2 + 2 keyed source edges; outputs: 'h' 2 sinks, 'o' 1 tie from the folded box,
    # output <- output['o'] and output <- output['h']: 2
    assert len(ties) == 4 + 2 + 1 + 2
    assert all('color="#8c959f"' in l for l in ties)
    o_rec = next(n for n in records if n.title == "output['o']")
    assert o_rec.label_html.count("PORT=") == 1 and "[0] .. [13]" in o_rec.label_html
    assert any("label=\"['a']\"" in l for l in ties)
    ida = d.node_ids["input_1"]
    assert any(re.match(rf"\s*r\d+:k0 -> {ida} ", l) for l in ties)
    # data edges are unchanged
    assert d.num_edges == collapsed.num_edges
    # the pair split returned sits in a dotted box of its own (not a module frame)
    split = next(op for op in trace if op.func_name == "split")
    boxes = re.findall(r"subgraph cluster_tuple_\d+ \{\n\s*graph \[([^\n]*)\];\n\s*(n\d+) \[", src)
    assert [(b[1], 'style="dotted"' in b[0], "2 outputs" in b[0]) for b in boxes] == [(d.node_ids[split.label], True, True)]
    assert d.num_clusters == collapsed.num_clusters
    assert "cluster_tuple" not in str(collapsed)


def test_show_containers_nodes_mid_graph_tuple(tmp_path):
    class Pair(nn.Module):
        def forward(self, x):
            return x.sin(), x.cos()

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = Pair()

        def forward(self, x):
            a, b = self.pair(x)
            return a * b

    trace = tl.trace(M(), torch.randn(2, 3))
    d = trace.draw(tmp_path / "t.dot", show_containers="nodes")
    src = str(d)
    assert "pair:1 returned" in src
    member_of = [l for l in src.splitlines() if 'arrowhead="none"' in l]
    assert len(member_of) == 2 and all('style="dashed"' in l for l in member_of)
    assert {l.split("->")[0].strip() for l in member_of} == {d.node_ids["sin_1_1"], d.node_ids["cos_1_2"]}


def test_labels_put_the_leaf_key_on_edges_into_output_leaves(tmp_path):
    trace = _fan_trace()
    d = trace.draw(tmp_path / "l.dot", show_containers="labels")
    src = str(d)
    for op in trace:
        if op.kind != "output":
            continue
        key = re.findall(r"\[[^\[\]]*\]", str(op.path))[-1]  # by hand: the last [..] of the path
        (parent,) = op.parents
        line = next(l for l in src.splitlines() if l.strip().startswith(f"{d.node_ids[parent]} -> {d.node_ids[op.label]}"))
        assert f'label="{key}"' in line, (op.label, line)
    assert 'label="[' not in str(trace.draw(tmp_path / "p.dot"))


def test_string_show_containers_forces_dot(tmp_path):
    trace = _fan_trace()
    d = trace.draw(tmp_path / "r.dot", show_containers="labels", layout="rank")
    assert d.engine == "dot" and "pos=" not in str(d)
