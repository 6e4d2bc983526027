"""Trace.draw on hand-built traces (no ML framework): DOT structure, folding, rolling,
collapse, channels, legend, files and typed errors."""

from __future__ import annotations

import os
import re
import shutil
import sys

import numpy as np
import pytest

from torchlens.build import EventLog, ModelInfo, ModuleInfo, OpEvent, build_trace
from torchlens.errors import ERROR_CODES, InvalidArgumentError
from torchlens.records.trace import Provenance
from torchlens.viz import Drawing
from torchlens.viz import collapse as collapse_mod
from torchlens.viz.examples import EventBuilder, example_trace

HAS_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="graphviz 'dot' not installed")

FRAMEWORKS = ("torch", "jax", "tensorflow", "mlx", "paddle", "tinygrad")


def clusters(d: Drawing) -> int:
    return str(d).count("subgraph cluster_")


def node_lines(d: Drawing) -> list[str]:
    return re.findall(r"^\s+(n\d+) \[", str(d), flags=re.M)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def blocks():
    return example_trace("blocks", n_blocks=3)


@pytest.fixture
def loop():
    return example_trace("loop", steps=3)


def test_viz_imports_no_framework():
    import subprocess

    code = ("import sys, torchlens.viz; from torchlens.viz.examples import example_trace; "
            "t = example_trace('blocks'); str(t.draw('x.dot', color_by='flops')); t.summary(); t._repr_html_(); "
            f"print([m for m in {FRAMEWORKS!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_dot_source_and_drawing_api(blocks):
    d = blocks.draw("g.dot")
    assert isinstance(d, Drawing)
    text = str(d)
    assert text.startswith("digraph trace {") and text.rstrip().endswith("}")
    assert d.path == "g.dot" and open("g.dot").read() == text
    assert len(node_lines(d)) == blocks.num_ops == d.num_nodes
    assert d.num_edges == len(blocks.graph_edges)
    assert set(d.node_ids) == set(blocks.labels)


def test_unfolded_clusters_are_module_calls_with_two_or_more_nodes(blocks):
    d = blocks.draw("g.dot")
    expected = [c for c in blocks.module_calls if c.address != "self" and len(c.op_labels) >= 2]
    assert clusters(d) == len(expected) == 3 * 3  # each block, its attn and its mlp
    for c in expected:
        assert f"<B>{c.address}</B>" in str(d)


def test_single_node_frames_name_the_module_on_the_node(blocks):
    text = str(blocks.draw("g.dot"))
    assert "blocks.0.attn.q: Linear" in text


def test_depth_folds_module_calls_into_boxes(blocks):
    d1 = blocks.draw("d1.dot", depth=1)
    # input, embedding, 3 block boxes, head (one-op module box), output
    assert d1.num_nodes == 7 and clusters(d1) == 0
    assert str(d1).count("peripheries=2") == 4
    d2 = blocks.draw("d2.dot", depth=2)
    assert clusters(d2) == 3  # each block frames its folded children
    boxes = [c for c in blocks.module_calls if c.address.count(".") == 2]
    assert str(d2).count("peripheries=2") == len(boxes)  # head (depth 1, no children) stays an op
    assert d2.node_ids["linear_1_3"] == d2.node_ids["matmul_1_6"]  # both inside blocks.0.attn


def test_depth_box_edges_are_deduplicated(blocks):
    d = blocks.draw("d.dot", depth=1)
    edges = re.findall(r"^\s+(n\d+) -> (n\d+)", str(d), flags=re.M)
    assert len(edges) == len(set(edges)) == d.num_edges


def test_rolled_draws_each_layer_once_with_pass_counts(loop):
    unrolled = loop.draw("u.dot")
    rolled = loop.draw("r.dot", rolled=True)
    assert unrolled.num_nodes == loop.num_ops == 16
    assert rolled.num_nodes == len(loop.layers) == 8
    text = str(rolled)
    assert "linear_1_2 (x3)" in text and 'label="x3"' in text and 'label="x2"' in text
    assert "cell (x3)" in text
    assert clusters(unrolled) == 3 and clusters(rolled) == 1


def test_collapse_modes(blocks):
    full = blocks.draw("a.dot", collapse="none")
    mx = blocks.draw("b.dot", collapse="max")
    half = blocks.draw("c.dot", collapse=0.5)
    assert full.collapse_plan == () and full.num_nodes == blocks.num_ops
    assert set(mx.collapse_plan) == {"blocks.0", "blocks.1", "blocks.2"}
    assert mx.num_nodes < half.num_nodes < full.num_nodes
    assert blocks.draw("d.dot", collapse=0.0).num_nodes == full.num_nodes
    with pytest.raises(InvalidArgumentError) as e:
        blocks.draw("e.dot", collapse=1.5)
    assert e.value.code == "collapse_value_invalid"


def test_collapse_schedule_is_monotone(blocks):
    sched = blocks.draw("s.dot").collapse_schedule
    sizes = [s for _, _, s in sched]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == blocks.num_ops


def test_collapse_scores(blocks):
    order = collapse_mod.module_collapse_order(blocks)
    scores = dict(order)
    assert scores["self"] == 0.0
    assert scores["blocks.0.attn.q"] == 0.0  # one layer
    assert scores["blocks.0"] == 1.0
    assert 0 < scores["blocks.0.attn"] < 1
    assert order[0][1] == 1.0
    assert collapse_mod.collapse_score(blocks.modules["blocks.0.mlp"]) == scores["blocks.0.mlp"]


def test_collapse_budget_fallback(monkeypatch, blocks):
    monkeypatch.setattr(collapse_mod, "COLLAPSE_OPTIMIZER_MAX_OPS", 20)
    d = blocks.draw("f.dot", collapse=0.3)
    assert [c for c, _ in d.notes] == ["collapse_budget_fallback"]
    assert d.num_nodes <= 20
    assert "collapse_budget_fallback" not in str(d) and "compact fallback" in str(d)
    auto = blocks.draw("g.dot")  # auto over the limit: fallback, never a wall
    assert auto.num_nodes <= 20 and auto.notes


def test_collapse_pathological_skip(monkeypatch, blocks):
    monkeypatch.setattr(collapse_mod, "COLLAPSE_OPTIMIZER_MAX_OPS", 1)
    d = blocks.draw("p.dot", collapse="max")
    assert d.notes[0][0] == "collapse_pathological_skip"
    with pytest.raises(InvalidArgumentError) as e:
        d.collapse_plan
    assert e.value.code == "collapse_plan_unavailable"
    assert len(d.collapse_schedule) == 1


def test_node_kinds_are_styled(blocks):
    text = str(blocks.draw("k.dot", theme="light"))
    assert "#d3f5dc" in text and "#ffdcd7" in text and "#dde3ea" in text  # input, output, param op


def test_themes(blocks):
    for name in ("light", "dark", "paper", "torchlens"):
        assert "digraph" in str(blocks.draw(f"{name}.dot", theme=name))
    assert 'bgcolor="#0d1117"' in str(blocks.draw("x.dot", theme="dark"))
    with pytest.raises(InvalidArgumentError) as e:
        blocks.draw("y.dot", theme="neon")
    assert e.value.code == "visualization_theme_invalid"


def test_direction(blocks):
    assert 'rankdir="LR"' in str(blocks.draw("lr.dot", direction="LR"))
    assert 'rankdir="BT"' in str(blocks.draw("bt.dot", direction="bottomup"))
    with pytest.raises(InvalidArgumentError):
        blocks.draw("z.dot", direction="diagonal")


def test_legend_tristate(blocks):
    none = str(blocks.draw("a.dot"))
    true = str(blocks.draw("b.dot", show_legend=True))
    assert "model input" not in none and "model input" in true and "module call (frame)" in true
    colored = str(blocks.draw("c.dot", color_by="flops"))
    assert "FLOPs: " in colored and "model input" not in colored  # auto: channel key alone
    off = str(blocks.draw("d.dot", color_by="flops", show_legend=False))
    assert "FLOPs: " not in off


def test_color_by_fills_eligible_nodes(blocks):
    d = blocks.draw("c.dot", color_by="flops")
    state = d.encoding["color"]
    linears = [op for op in blocks if op.func_name == "linear"]
    assert len(state.values) == len(linears) + 2 * 3  # linears and the two matmuls per block
    assert state.vmin == min(op.flops for op in blocks if op.flops) and state.vmax == max(op.flops for op in blocks if op.flops)
    assert "#fde725" in str(d)  # the lowest value takes the light end on a light page


def test_color_by_callable_field_and_errors(blocks):
    d = blocks.draw("a.dot", color_by=lambda op: op.index)
    assert len(d.encoding["color"].values) > 0
    assert blocks.draw("b.dot", color_by="numel").encoding["color"].values
    for bad, code in [("nope", "encoding_source_invalid"), ("func_name", "encoding_value_invalid"),
                      (lambda op: 1 / 0, "encoding_callable_error")]:
        with pytest.raises(InvalidArgumentError) as e:
            blocks.draw("c.dot", color_by=bad)
        assert e.value.code == code
    with pytest.raises(InvalidArgumentError) as e:
        blocks.draw("c.dot", color_by=lambda op: 1 / 0)
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_collapsed_boxes_encode_member_sums(blocks):
    d = blocks.draw("a.dot", depth=1, color_by="flops")
    state = d.encoding["color"]
    box = d.node_ids["linear_1_3"]
    expected = sum(op.flops for op in blocks if op.flops and "blocks.0" in op.modules)
    assert state.values[box] == expected
    assert "module boxes: sum of member ops" in state.aggregation
    d2 = blocks.draw("b.dot", depth=1, color_by="pass_number")
    assert box not in d2.encoding["color"].values and d2.encoding["color"].notes


def test_size_by(blocks):
    d = blocks.draw("s.dot", size_by="bytes")
    text = str(d)
    sizes = [(float(w), float(h)) for w, h in re.findall(r"width=([\d.]+), height=([\d.]+)", text)]
    areas = sorted(w * h for w, h in sizes)
    assert areas and abs(areas[-1] / areas[0] - 2.0) < 0.01  # largest value: twice the typical area
    assert "size: output bytes, 64 B ... 256 B" in text  # auto legend: the channel key alone
    assert "size: output bytes" not in str(blocks.draw("s2.dot", size_by="bytes", show_legend=False))
    lin = blocks.draw("s3.dot", size_by="dims", size_scale="linear")
    assert lin.encoding["size"].scale == "linear"
    with pytest.raises(InvalidArgumentError) as e:
        blocks.draw("x.dot", size_scale="linear")
    assert e.value.code == "scale_requires_size_by"
    with pytest.raises(InvalidArgumentError) as e:
        blocks.draw("x.dot", size_by="bytes", size_scale="log")
    assert e.value.code == "encoding_scale_invalid"


def test_rolled_encodings(loop):
    d = loop.draw("a.dot", rolled=True, color_by="total_flops")
    assert "rolled layers: sum over passes" in d.encoding["color"].aggregation
    assert loop.draw("b.dot", rolled=True, color_by="flops").encoding["color"].values  # uniform per pass
    with pytest.raises(InvalidArgumentError) as e:
        loop.draw("c.dot", rolled=True, color_by="index")
    assert e.value.code == "encoding_source_invalid"
    with pytest.raises(InvalidArgumentError) as e:
        loop.draw("d.dot", rolled=True, size_by=lambda layer: 1.0, color_by=None, stack_by=True)
    assert e.value.code == "stack_by_requires_unrolled"


def test_size_by_rolled_varying():
    b = EventBuilder("Vary")
    x = b.input((1, 4))
    for i in range(2):
        x = b.op("relu", (x,), (1, 4 * (i + 1)), "r")
    b.output(x)
    t = b.build(x)
    with pytest.raises(InvalidArgumentError) as e:
        t.draw("v.dot", rolled=True, size_by="bytes")
    assert e.value.code == "size_by_rolled_varying"
    d = t.draw("w.dot", rolled=True, color_by="bytes")  # colour leaves it unencoded
    assert d.encoding["color"].notes


def test_stack_by(loop):
    d = loop.draw("s.dot", stack_by=True)
    groups = d.ir.stack_rank_groups
    assert len(groups) == 3 and all(len(g) == 4 for g in groups)
    assert "newrank" in str(d) and str(d).count("rank=same") == 3
    assert "stacked by pass_number" in str(d)
    assert loop.draw("e.dot", stack_by="pass_number").ir.stack_rank_groups


def test_stack_by_auto_underivable():
    b = EventBuilder("TwoLoops")
    x = b.input((1, 2))
    for site in ("a", "b"):
        for _ in range(2):
            x = b.op("relu", (x,), (1, 2), site)
    b.output(x)
    t = b.build(x)
    with pytest.raises(InvalidArgumentError) as e:
        t.draw("s.dot", stack_by=True)
    assert e.value.code == "stack_by_auto_underivable"
    assert t.draw("t.dot", stack_by=lambda op: op.pass_number).ir.stack_rank_groups


def test_channels_refuse_rank_layout(blocks):
    with pytest.raises(InvalidArgumentError) as e:
        blocks.draw("a.dot", layout="rank", color_by="flops")
    assert e.value.code == "encoding_requires_dot_layout"
    d = blocks.draw("b.dot", layout="rank")
    assert 'pos="' in str(d) and clusters(d) == 0 and d.engine == "neato"


def test_file_format_rules(blocks):
    with pytest.raises(InvalidArgumentError) as e:
        blocks.draw("a.svg", file_format="png")
    assert e.value.code == "draw_format_mismatch"
    with pytest.raises(InvalidArgumentError) as e:
        blocks.draw("a", file_format="bmpx")
    assert e.value.code == "file_format_unsupported"
    d = blocks.draw("noext", file_format="gv")
    assert d.path == "noext.gv" and os.path.exists("noext.gv")
    assert blocks.draw("x.gv", file_format="dot").path == "x.gv"


def test_show_containers(blocks):
    with pytest.raises(InvalidArgumentError) as e:
        blocks.draw("a.dot", show_containers="cluster")
    assert e.value.code == "visualization_show_containers_invalid" and e.value.fields["replacement"] == "labels"


def test_overrides(blocks):
    d = blocks.draw("o.dot", graph_overrides={"ranksep": 0.9}, node_overrides={"add_1_10": {"color": "red"}},
                    edge_overrides={("add_2_14", "layernorm_2_15"): {"penwidth": 3}})
    text = str(d)
    assert "ranksep=0.9" in text and 'color="red"' in text and "penwidth=3" in text
    with pytest.raises(InvalidArgumentError):
        blocks.draw("p.dot", node_overrides={"nope": {}})


def test_multi_output_container_labels():
    log = EventLog()
    info = ModelInfo("Split", modules=[ModuleInfo("self", "Split")])
    i = log.new_id()
    log.append(OpEvent(i, "input", "input", outputs=(np.zeros(4),), shapes=((4,),), dtypes=("float32",), path="x"))
    s = log.new_id()
    log.append(OpEvent(s, "op", "split", parents=((i, 0),), outputs=(np.zeros(2), np.ones(2)), shapes=((2,), (2,)),
                       dtypes=("float32", "float32"), module_stack=(("self", 1),), site="s", multi_output=True))
    a = log.new_id()
    log.append(OpEvent(a, "op", "add", parents=((s, 1), (s, 0)), outputs=(np.ones(2),), shapes=((2,),),
                       dtypes=("float32",), module_stack=(("self", 1),), site="a"))
    o = log.new_id()
    log.append(OpEvent(o, "output", "output", parents=((a, 0),), outputs=(None,), shapes=((2,),), dtypes=("float32",)))
    t = build_trace(info, log, provenance=Provenance("fake", model_class="Split"))
    assert 'label="[' in str(t.draw("c.dot", show_containers="labels"))
    assert "2, 2" in str(t.draw("d.dot"))  # both output shapes on the split node


def test_options_validated(blocks):
    for kw in ({"depth": 0}, {"depth": "2"}, {"layout": "circo"}, {"show_legend": "yes"}):
        with pytest.raises(InvalidArgumentError) as e:
            blocks.draw("x.dot", **kw)
        assert e.value.code == "draw_option_invalid"


def test_all_raised_codes_are_registered():
    for code in ("visualization_theme_invalid", "stack_by_auto_underivable", "stack_by_requires_unrolled",
                 "encoding_requires_dot_layout", "encoding_source_invalid", "encoding_value_invalid",
                 "encoding_callable_error", "encoding_scale_invalid", "scale_requires_size_by",
                 "size_by_rolled_varying", "collapse_plan_unavailable", "collapse_value_invalid",
                 "graph_render_unavailable", "draw_format_mismatch", "file_format_unsupported",
                 "flop_convention_unavailable", "flop_convention_invalid", "flop_keyword_removed",
                 "table_render_unavailable", "draw_option_invalid", "visualization_show_containers_invalid"):
        assert code in ERROR_CODES


def test_missing_dot_raises_typed_error_but_dot_text_works(blocks, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    d = blocks.draw("ok.dot")
    assert "digraph" in str(d)
    with pytest.raises(InvalidArgumentError) as e:
        blocks.draw("no.svg")
    assert e.value.code == "graph_render_unavailable" and "apt-get install graphviz" in e.value.remedy
    assert not os.path.exists("no.svg")


@needs_dot
def test_bare_call_writes_collision_safe_file(blocks, capsys):
    d1 = blocks.draw()
    d2 = blocks.draw()
    assert d1.path == os.path.join(".", "trace_TinyTransformer_1.svg")
    assert d2.path == os.path.join(".", "trace_TinyTransformer_2.svg")
    assert open(d1.path).read().lstrip().startswith(("<?xml", "<svg"))
    assert "trace_TinyTransformer_1.svg" in capsys.readouterr().out


@needs_dot
def test_notebook_returns_drawing_without_file(blocks, monkeypatch):
    from torchlens.viz import draw as draw_mod

    monkeypatch.setattr(draw_mod, "in_notebook", lambda: True)
    d = blocks.draw()
    assert d.path is None and not os.listdir(".")
    assert "<svg" in d._repr_svg_()


@needs_dot
@pytest.mark.parametrize("ext", ["svg", "png", "pdf"])
def test_render_formats(blocks, ext):
    d = blocks.draw(f"g.{ext}", depth=2, show_legend=True)
    assert d.path == f"g.{ext}" and os.path.getsize(d.path) > 500
    head = open(d.path, "rb").read(8)
    assert {"png": head.startswith(b"\x89PNG"), "pdf": head.startswith(b"%PDF"), "svg": b"<" in head}[ext]


@needs_dot
def test_every_option_renders(blocks, loop):
    """Each emitted variant is valid DOT that graphviz accepts."""
    for t, kw in [(blocks, {"color_by": "flops", "size_by": "bytes", "show_legend": True}),
                  (blocks, {"collapse": "max", "theme": "dark"}), (loop, {"rolled": True, "show_legend": True}),
                  (loop, {"stack_by": True, "direction": "LR"}), (blocks, {"layout": "rank"})]:
        assert t.draw(**kw, path="g.svg").pipe("svg").startswith(b"<?xml")


def test_progress_is_off_when_not_interactive(blocks, capsys):
    from torchlens.viz.progress import progress, progress_enabled, set_progress

    assert not progress_enabled(10_000)  # pytest's stderr is captured, not a TTY
    items = list(range(5))
    assert progress(items, total=5) is items
    set_progress(False)
    try:
        assert not progress_enabled(10_000, None)
    finally:
        set_progress(None)
    blocks.draw("p.dot", progress=False)
    assert capsys.readouterr().err == ""


def test_node_title_has_room_under_it_for_underscores():
    """At small sizes an underscore on the title's baseline merged into the next line
    (`linear_1_1` read as `linear 1 1`): the title sits in its own cell, taller than its font."""
    import re

    from torchlens.viz import dot as D
    from torchlens.viz.ir import RNode

    node = RNode.__new__(RNode)
    node.title, node.lines = "linear_1_1", ["linear", "2x4"]
    label = D.node_label(node)
    m = re.search(r'<TD CELLPADDING="0" HEIGHT="(\d+)" VALIGN="TOP"><B>linear_1_1</B></TD>', label)
    assert m and int(m.group(1)) >= D.TITLE_PT + 2
    assert label.index("linear_1_1") < label.index(">linear<") < label.index(">2x4<")
