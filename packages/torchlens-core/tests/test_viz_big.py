"""Drawing big graphs (issue 12 §4): a typed warning with the expected cost before a slow
uncollapsed `dot` layout, none for the default auto-collapse or for DOT text, and the fast
`layout="rank"` path on a Mask R-CNN-shaped graph."""

from __future__ import annotations

import shutil
import time
import warnings

import pytest

import torchlens as tl
from torchlens.errors import DrawCostWarning
from torchlens.viz import cost, draw as draw_mod
from torchlens.viz.examples import example_trace


@pytest.fixture(scope="module")
def big():
    return example_trace("detection", n_dets=800)  # 4,828 ops, edges spanning hundreds of ranks


def _no_layout(monkeypatch, seen):
    """Replace the Graphviz call: record whether the warning came before it, run nothing."""
    def fake_write(source, path, fmt, engine="dot"):
        seen.append(("write", engine))
    monkeypatch.setattr(draw_mod, "write", fake_write)


def test_layout_units_count_nodes_and_skipped_ranks():
    # a -> b -> c -> d, plus a -> d (skips ranks 1 and 2) and d -> b (back, spans 2 ranks: skips 1)
    nodes = ["a", "b", "c", "d"]
    edges = [("a", "b"), ("b", "c"), ("c", "d"), ("a", "d"), ("d", "b")]
    assert cost.layout_units(nodes, edges) == 4 + 2 + 1


def test_uncollapsed_big_graph_warns_with_its_cost_before_the_layout(big, monkeypatch, tmp_path):
    seen: list = []
    _no_layout(monkeypatch, seen)

    def record(message, category=None, stacklevel=1, **kw):
        seen.append(("warn", message))
    monkeypatch.setattr(cost.warnings, "warn", record)
    big.draw(tmp_path / "big.svg", collapse="none")
    assert [k for k, _ in seen] == ["warn", "write"]  # warned first, then laid out
    w = seen[0][1]
    assert isinstance(w, DrawCostWarning) and isinstance(w, UserWarning)
    assert w.code == "draw_layout_slow"
    assert w.fields["num_nodes"] == big.num_ops and w.fields["estimated_s"] > cost.LAYOUT_WARN_SECONDS
    assert w.fields["layout_units"] > w.fields["num_nodes"]  # the long edges count
    assert "layout='rank'" in w.remedy and "collapse='auto'" in w.remedy


def test_the_warning_is_a_real_python_warning(big, monkeypatch, tmp_path):
    _no_layout(monkeypatch, [])
    with pytest.warns(DrawCostWarning, match="draw_layout_slow"):
        big.draw(tmp_path / "big.svg", collapse="none")


@pytest.mark.parametrize("kwargs,suffix", [
    ({}, "svg"),                                   # default auto-collapse folds it
    ({"rolled": True}, "svg"),                     # one node per layer
    ({"collapse": "none", "layout": "rank"}, "svg"),  # the fast layout runs no dot
    ({"collapse": "none"}, "dot"),                 # DOT text: no layout runs at all
])
def test_no_warning_where_no_slow_layout_runs(big, monkeypatch, tmp_path, kwargs, suffix):
    _no_layout(monkeypatch, [])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DrawCostWarning)
        d = big.draw(tmp_path / f"big.{suffix}", **kwargs)
    if kwargs == {}:
        assert d.num_nodes < big.num_ops and d.collapse_plan  # auto-collapse stayed the default


def test_estimate_tracks_the_measured_drawings():
    # the five measured drawings the fit is taken from: within a factor 3 of each
    for nodes, units, seconds in [(2605, 4805, 3.35), (2428, 14028, 3.55), (3195, 47562, 47.6),
                                  (707, 9040, 1.27), (1687, 2358, 1.33)]:
        est = cost.estimate_dot_seconds(nodes, units)
        assert seconds / 3 <= est <= seconds * 3, (nodes, units, est)
    assert cost.estimate_dot_seconds(3195, 47562) > cost.LAYOUT_WARN_SECONDS > cost.estimate_dot_seconds(707, 9040)


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz is not installed")
def test_rank_layout_draws_the_big_graph_in_seconds(big, tmp_path):
    t0 = time.perf_counter()
    d = big.draw(tmp_path / "big.svg", collapse="none", layout="rank")
    elapsed = time.perf_counter() - t0
    assert d.num_nodes == big.num_ops and (tmp_path / "big.svg").stat().st_size > 0
    assert elapsed < 10.0, elapsed


def test_dot_text_of_the_big_graph_is_cheap(big, tmp_path):
    t0 = time.perf_counter()
    d = big.draw(tmp_path / "big.dot", collapse="none")
    assert time.perf_counter() - t0 < 5.0 and d.num_nodes == big.num_ops
    assert isinstance(tl.viz.estimate_dot_seconds(d.num_nodes, tl.viz.layout_units(d.ir.nodes, d.ir.edges)), float)
