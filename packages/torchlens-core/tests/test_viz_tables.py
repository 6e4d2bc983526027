"""summary(), to_pandas() tables and notebook HTML on hand-built traces (no ML framework)."""

from __future__ import annotations

import builtins

import numpy as np
import pytest

from torchlens.errors import InvalidArgumentError
from torchlens.viz.examples import EventBuilder, example_trace


@pytest.fixture
def blocks():
    return example_trace("blocks", n_blocks=2)


def test_summary_header_and_rows(blocks):
    text = blocks.summary()
    assert text.splitlines()[0] == "Trace of TinyTransformer (numpy backend)"
    assert f"ops {blocks.num_ops}" in text and "modules 22" in text
    assert "FLOPs" in text and "(fma2)" in text
    for op in blocks:
        assert op.label in text
    assert "1x4x16" in text and "256 B" in text


def test_summary_flop_conventions(blocks):
    fma2 = blocks.summary()
    fma1 = blocks.summary(flop_convention="fma1")
    total2 = sum(op.flops for op in blocks if op.flops)
    total1 = sum(op.flops - op.macs for op in blocks if op.flops)
    from torchlens.viz.units import fmt_count

    assert f"FLOPs {fmt_count(total2)} (fma2)" in fma2
    assert f"FLOPs {fmt_count(total1)} (fma1)" in fma1
    with pytest.raises(InvalidArgumentError) as e:
        blocks.summary(flop_convention="fma3")
    assert e.value.code == "flop_convention_invalid"
    with pytest.raises(InvalidArgumentError) as e:
        blocks.summary(count_fma_as_two=True)
    assert e.value.code == "flop_keyword_removed" and e.value.fields["keyword"] == "count_fma_as_two"


def test_fma1_needs_mac_split():
    b = EventBuilder("NoSplit")
    x = b.input((1, 2))
    y = b.op("custom", (x,), (1, 2), "c", meta={"flops": 10})
    b.output(y)
    t = b.build(y)
    assert "FLOPs 10 (fma2)" in t.summary()
    with pytest.raises(InvalidArgumentError) as e:
        t.summary(flop_convention="fma1")
    assert e.value.code == "flop_convention_unavailable" and e.value.fields["label"] == "custom_1_1"


def test_summary_by_layer_module_and_max_rows():
    t = example_trace("loop", steps=3)
    by_layer = t.summary(by="layer")
    assert "linear_1_2" in by_layer and "passes" in by_layer
    by_module = t.summary(by="module")
    assert "cell.ih" in by_module and "Cell" in by_module
    short = t.summary(max_rows=4)
    assert "more rows" in short and len(short.splitlines()) < len(t.summary().splitlines())
    with pytest.raises(InvalidArgumentError):
        t.summary(by="param")


def test_to_pandas_one_row_per_op(blocks):
    df = blocks.to_pandas()
    assert len(df) == blocks.num_ops
    for col in ("label", "layer_label", "pass_number", "num_passes", "func_name", "kind", "module", "shape",
                "dtype", "numel", "nbytes", "parents", "children", "params", "flops", "macs", "saved"):
        assert col in df.columns
    row = df.set_index("label").loc["linear_1_3"]
    assert row["func_name"] == "linear" and row["shape"] == (1, 4, 8) and row["macs"] == 256
    assert row["params"] == ["blocks.0.attn.q.weight", "blocks.0.attn.q.bias"]
    assert df.flops.isna().sum() == sum(1 for op in blocks if op.flops is None)


def test_accessor_tables(blocks):
    assert len(blocks.layers.to_pandas()) == len(blocks.layers)
    mods = blocks.modules.to_pandas()
    assert list(mods.address)[:2] == ["self", "blocks.0"] and "num_params" in mods
    params = blocks.params.to_pandas()
    assert params.numel.sum() == blocks.params.numel
    assert len(blocks.module_calls.to_pandas()) == len(blocks.module_calls)
    assert len(blocks.ops.compute.to_pandas()) == len(blocks.ops.compute)
    loop = example_trace("loop")
    assert loop.layers.to_pandas().set_index("label").loc["linear_1_2"].num_passes == 3


def test_selection_to_dataframe(blocks):
    import torchlens as tl

    df = blocks[tl.func("linear")].to_dataframe()
    assert set(df.func_name) == {"linear"} and len(df) == sum(1 for op in blocks if op.func_name == "linear")


def test_missing_pandas_is_a_typed_error(blocks, monkeypatch):
    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "pandas":
            raise ImportError("no pandas")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(InvalidArgumentError) as e:
        blocks.to_pandas()
    assert e.value.code == "table_render_unavailable" and "pip install" in e.value.remedy


def test_html_reprs(blocks):
    html = blocks._repr_html_()
    assert "TinyTransformer" in html and "linear_1_3" in html and "<table>" in html and "min " in html
    op = blocks.ops["linear_1_3"]
    ohtml = op._repr_html_()
    value = np.asarray(op.out).reshape(-1)[0]
    assert f"{value:.4g}" in ohtml and "self:1 &gt; blocks.0:1" in ohtml and "layernorm_1_2" in ohtml
    assert "1x4x8" in ohtml and "float32" in ohtml
    lhtml = example_trace("loop").layers["linear_1_2"]._repr_html_()
    assert "pass 3" in lhtml and "cell.ih" in lhtml
    mhtml = blocks.modules["blocks.0.attn.q"]._repr_html_()
    assert "Linear" in mhtml and "8x8" in mhtml


def test_values_shown_through_backend_host_copy():
    class Boxed:
        def __init__(self, a):
            self.a = a

    class FakeBackend:
        calls = 0

        def host_copy(self, v):
            FakeBackend.calls += 1
            return np.asarray(v.a)

    b = EventBuilder("Boxed")
    x = b.input((1, 3))
    t = b.build(None)
    t._backend = FakeBackend()
    t.ops["input_1"]._outputs = (Boxed(np.array([[1.5, 2.5, 3.5]])),)
    html = t.ops["input_1"]._repr_html_()
    assert "[1.5, 2.5, 3.5]" in html and FakeBackend.calls == 1
    t._backend = None
    assert "values" in t.ops["input_1"]._repr_html_()  # no backend: no values, no error


def test_unsaved_op_says_so():
    t = example_trace("mlp")
    assert "(not saved)" in t.ops["output_1"]._repr_html_()
