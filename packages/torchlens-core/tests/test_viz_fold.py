"""fold_repeats and show_containers on hand-built traces (no ML framework), and their
pass-through in Bundle.draw's folded diff. Expected counts are derived from the op records
by hand rules, not from the renderer."""

from __future__ import annotations

import re

import numpy as np
import pytest

from torchlens.bundle import Bundle
from torchlens.errors import ArgumentTypeError, InvalidArgumentError
from torchlens.viz.bundle_draw import ZERO_FILL, diff_fill
from torchlens.viz.examples import example_trace


def _groups(trace, hidden: set[str], depth: int | None = None) -> dict[str, str]:
    def group(op) -> str:
        calls = [c for c, a in zip(op.module_calls, op.modules) if a != "self"]
        if any(c in hidden for c in calls):
            return "MORE"
        if depth is not None and len(calls) >= depth:
            return "box:" + calls[depth - 1]
        return op.label

    return {op.label: group(op) for op in trace}


def _counts(trace, groups: dict[str, str]) -> tuple[int, int]:
    edges = {(groups[p], groups[op.label]) for op in trace for p in op.parents if groups[p] != groups[op.label]}
    return len(set(groups.values())), len(edges)


def _titles(src: str) -> list[str]:
    return re.findall(r'VALIGN="TOP"><B>([^<]*)</B>', src)


@pytest.mark.parametrize("n_blocks", [2, 4])
def test_blocks_fold_to_first_block_plus_more(tmp_path, n_blocks):
    trace = example_trace("blocks", n_blocks=n_blocks)
    hidden = {f"blocks.{i}:1" for i in range(1, n_blocks)}
    d = trace.draw(tmp_path / "f.dot", fold_repeats=True)
    groups = _groups(trace, hidden)
    assert (d.num_nodes, d.num_edges) == _counts(trace, groups)
    # input, embedding, blocks.0's 13 ops, '+N more', head, output
    assert d.num_nodes == 2 + 13 + 1 + 2
    src = str(d)
    assert _titles(src).count(f"+{n_blocks - 1} more") == 1
    span = "blocks.1" if n_blocks == 2 else f"blocks.1 .. blocks.{n_blocks - 1}"
    assert f"{span}: Block" in src and f"{n_blocks - 1} x 13 ops" in src
    # q/k/v are same-class siblings but parallel, never a run
    assert {"linear_1_3", "linear_2_4", "linear_3_5"} <= set(_titles(src))
    # the '+N more' node has one edge in (from blocks.0's last add) and one out (to the head)
    more = d.node_ids["add_4_27"]
    assert [e for e in d.ir.edges if e[1] == more] == [(d.node_ids["add_2_14"], more)]
    assert [e for e in d.ir.edges if e[0] == more] == [(more, d.node_ids[trace.ops[-2].label])]
    line = next(l for l in src.splitlines() if l.strip().startswith(more + " ["))
    assert "dashed" in line and "peripheries=2" in line


def test_fold_with_depth_and_rolled(tmp_path):
    trace = example_trace("blocks", n_blocks=3)
    d = trace.draw(tmp_path / "d.dot", fold_repeats=True, depth=1)
    assert (d.num_nodes, d.num_edges) == _counts(trace, _groups(trace, {"blocks.1:1", "blocks.2:1"}, depth=1))
    assert _titles(str(d)) == ["input_1", "embedding_1_1", "blocks.0", "+2 more", "head", "output_1"]
    plain = trace.draw(tmp_path / "p.dot", depth=1)
    assert plain.num_nodes == d.num_nodes + 1 and "more" not in str(plain)


def test_loop_recurrence_never_folds(tmp_path):
    trace = example_trace("loop", steps=3)
    assert trace.draw(tmp_path / "a.dot", fold_repeats=True).num_nodes == trace.num_ops
    assert "more" not in str(trace.draw(tmp_path / "b.dot", fold_repeats=True, rolled=True))


def test_refusals(tmp_path):
    trace = example_trace("mlp")
    for kwargs, code in [({"fold_repeats": None}, "draw_option_invalid"),
                         ({"show_containers": True}, "visualization_show_containers_invalid"),
                         ({"container_max_inline": -1}, "draw_option_invalid")]:
        with pytest.raises(InvalidArgumentError) as e:
            trace.draw(tmp_path / "x.dot", **kwargs)
        assert e.value.code == code and e.value.remedy
    assert not (tmp_path / "x.dot").exists()


def _node_fill(src: str, nid: str) -> str:
    line = next(l for l in src.splitlines() if l.strip().startswith(nid + " ["))
    return re.findall(r'fillcolor="([^"]+)"', line)[-1]


def test_bundle_folded_diff_passes_fold_repeats_through(tmp_path):
    a, b = example_trace("blocks", n_blocks=3), example_trace("blocks", n_blocks=3)
    op = b._ops["matmul_5_32"]  # inside blocks.2, a folded member
    op.replace_outputs((op.out * np.float32(2.0),))
    bundle = Bundle({"a": a, "b": b})
    d = bundle.draw(tmp_path / "f.dot", graph="diff", depth=2, fold_repeats=True)
    rows = dict(bundle.compare("a", "b", metric="relative_l2"))
    more = d.node_ids["matmul_5_32"]
    assert more == d.node_ids["add_3_23"]  # blocks.1 and blocks.2 are one '+2 more' node
    vals = [rows[l] for l, nid in d.node_ids.items() if nid == more and l in rows]
    top = max(v for v in rows.values() if v == v)
    assert max(vals) == pytest.approx(1.0, rel=1e-6)
    assert _node_fill(str(d), more) == diff_fill(max(vals), top) != ZERO_FILL
    assert _node_fill(str(d), d.node_ids["matmul_1_6"]) == ZERO_FILL
    assert "+2 more" in _titles(str(d))


def test_bundle_draw_refuses_fold_keywords_outside_the_folded_diff(tmp_path):
    bundle = Bundle({"a": example_trace("mlp"), "b": example_trace("mlp")})
    for kwargs in ({"fold_repeats": True}, {"show_containers": "nodes"},
                   {"graph": "diff", "fold_repeats": True}, {"container_max_inline": 3}):
        with pytest.raises(ArgumentTypeError) as e:
            bundle.draw(tmp_path / "x.dot", **kwargs)
        assert e.value.code == "bundle_draw_keyword_unsupported"
        assert e.value.fields["keyword"] in ("fold_repeats", "show_containers", "container_max_inline")
    with pytest.raises(InvalidArgumentError) as e:
        bundle.draw(tmp_path / "x.dot", graph="diff", depth=1, fold_repeats="yes")
    assert e.value.code == "draw_option_invalid"
    assert not (tmp_path / "x.dot").exists()
