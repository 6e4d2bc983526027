"""Issue 27, the rest: notebook HTML a researcher keeps open (styled, collapsible by module,
value histograms, attention heatmaps, NaN/Inf flags, HTML for every record and collection),
Q/K/V labels in drawings, edits checked when staged, and save= enforced by core."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchlens as tl


class Attn(nn.Module):
    """Eager attention: softmax(q k^T / sqrt(d)) v, with a NaN-producing option."""

    def __init__(self, d: int = 8, nan: bool = False):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.nan = nan
        self.register_buffer("scale", torch.tensor(d ** -0.5))

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        probs = torch.softmax(q @ k.transpose(-1, -2) * self.scale, dim=-1)
        h = self.out(probs @ v)
        if self.nan:
            h = torch.log(h)  # negative entries become NaN
        return h


class Fused(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x))


@pytest.fixture(scope="module")
def attn_trace():
    torch.manual_seed(0)
    return tl.trace(Attn(), torch.randn(1, 5, 8))


def _rects(svg: str) -> list[dict[str, str]]:
    return [dict(re.findall(r"(\w[\w-]*)='([^']*)'", r)) for r in re.findall(r"<rect [^>]*/>", svg)]


# notebook HTML ----------------------------------------------------------------------------

def test_trace_html_is_styled_and_collapsible_by_module_call(attn_trace):
    html = attn_trace._repr_html_()
    assert "<style>" in html and "font-family" in html and "border" in html and "<script" not in html
    calls = {c for op in attn_trace for c in op.module_calls if not c.startswith("self:")}
    assert calls == {"q:1", "k:1", "v:1", "out:1"}
    assert html.count("<details") == len(calls) and html.count("</details>") == len(calls)
    for c in calls:
        assert f"<summary>{c}<span" in html
    assert all(op.label in html for op in attn_trace)
    assert "http" not in html  # nothing fetched from anywhere


def test_op_histogram_counts_match_numpy(attn_trace):
    from torchlens.viz.notebook import histogram_svg

    op = next(o for o in attn_trace if o.func_name == "linear")
    values = op.out.detach().numpy().reshape(-1).astype(np.float64)
    counts, _ = np.histogram(values, bins=16, range=(values.min(), values.max()))
    svg = histogram_svg(values)
    bars = [r for r in _rects(svg) if r.get("fill") == "#0969da"]
    assert len(bars) == int((counts > 0).sum())
    tallest = max(bars, key=lambda r: float(r["height"]))
    width = float(bars[0]["width"]) + 0.5
    assert round(float(tallest["x"]) / width) == int(np.argmax(counts))
    assert f"histogram of {values.size} finite values" in svg
    assert svg in op._repr_html_()


def test_attention_probabilities_get_a_heatmap_at_the_argmax():
    torch.manual_seed(1)
    trace = tl.trace(Attn(), torch.randn(2, 4, 8))  # [batch, q, k] probabilities
    probs_op = next(o for o in trace if o.func_name == "softmax")
    from torchlens.viz.notebook import heatmap_svg, is_attention_probs

    assert is_attention_probs(probs_op)
    assert not any(is_attention_probs(o) for o in trace if o.func_name != "softmax")
    probs = probs_op.out.detach().numpy()
    svg = heatmap_svg(probs, head=1)
    full = [r for r in _rects(svg) if r.get("fill-opacity") == "1.00"]
    i, j = np.unravel_index(np.argmax(probs[1]), probs[1].shape)
    cell = float(full[0]["width"])
    assert (round(float(full[0]["y"]) / cell), round(float(full[0]["x"]) / cell)) == (i, j)
    card = probs_op._repr_html_()
    assert "attention map, head 0: 4 queries x 4 keys" in card and "attention map, head 1" in card


def test_nan_and_inf_are_flagged():
    torch.manual_seed(0)
    trace = tl.trace(Attn(nan=True), torch.randn(1, 5, 8))
    log_op = next(o for o in trace if o.func_name == "log")
    n_nan = int(torch.isnan(log_op.out).sum())
    assert n_nan > 0
    assert f"<span class='flag' title='NaN elements'>NaN x{n_nan}</span>" in log_op._repr_html_()
    assert f"NaN x{n_nan}</span>" in trace._repr_html_()
    clean = next(o for o in trace if o.func_name == "softmax")
    assert "class='flag'" not in clean._repr_html_()


def test_every_record_and_collection_has_html(attn_trace):
    t = attn_trace
    things = {
        "op": t.ops["linear_1_1"], "layer": t.layers["linear_1_1"], "module": t.modules["q"],
        "module call": t.modules["q"].calls[0], "param": t.params["q.weight"], "buffer": t.buffers["scale"],
        "selection": tl.func("softmax").resolve(t),
        "ops": t.ops, "layers": t.layers, "modules": t.modules, "params": t.params, "buffers": t.buffers,
    }
    for name, obj in things.items():
        html = obj._repr_html_()
        assert html.startswith("<div class='tlv'><style>") and "<table>" in html and "<h3>" in html, name
    w = t.params["q.weight"].value.detach().numpy()
    assert f"histogram of {w.size} finite values" in things["param"]._repr_html_()
    assert "q.weight" in things["params"]._repr_html_() and "scale" in things["buffers"]._repr_html_()
    sel = things["selection"]._repr_html_()
    assert "softmax" in sel and "attention map" in sel


# drawings ---------------------------------------------------------------------------------

def test_qkv_edges_labelled_for_eager_and_fused_attention(tmp_path):
    from torchlens.viz.attention import qkv_edges

    torch.manual_seed(0)
    eager = tl.trace(Attn(), torch.randn(1, 5, 8))
    roles = qkv_edges(eager)
    by_role = {role: parent for (parent, _op), role in roles.items()}
    assert eager.ops[by_role["Q"]].module == "q"           # q feeds the score matmul directly
    assert eager.ops[by_role["K"]].func_name == "transpose"  # k^T
    assert list(eager.ops[by_role["K"]].parents) == ["linear_2_2"] and eager.ops["linear_2_2"].module == "k"
    assert eager.ops[by_role["V"]].module == "v"
    fused = tl.trace(Fused(), torch.randn(1, 5, 8))
    roles = qkv_edges(fused)
    assert sorted((fused.ops[p].module, r) for (p, _), r in roles.items()) == [("k", "K"), ("q", "Q"), ("v", "V")]
    src = str(fused.draw(str(tmp_path / "f.dot")))
    text = (tmp_path / "f.dot").read_text() if (tmp_path / "f.dot").exists() else src
    assert all(f'label="{r}"' in text for r in "QKV")


# section 4 errors ----------------------------------------------------------------------------

def test_edit_helper_passed_uncalled_is_refused_at_staging(attn_trace):
    f = attn_trace.fork()
    before = f.ops["linear_1_1"].out.clone()
    with pytest.raises(tl.errors.InterventionError) as info:
        f.do(tl.func("linear"), tl.zero_ablate)
    assert info.value.code == "intervention_edit_invalid" and info.value.remedy == "did you mean tl.zero_ablate()?"
    assert torch.equal(f.ops["linear_1_1"].out, before) and len(f.recipe.rules) == 0
    with pytest.raises(tl.errors.InterventionError, match=r"did you mean tl.scale\(\)"):
        tl.when(tl.func("linear"), tl.scale)


def test_units_mask_of_the_wrong_shape_is_refused_at_staging(attn_trace):
    f = attn_trace.fork()
    with pytest.raises(tl.errors.InterventionError) as info:
        f.do(tl.units(tl.func("softmax"), torch.ones(3, dtype=torch.bool)), tl.zero_ablate())
    assert info.value.code == "edit_argument_shape_mismatch" and "(1, 5, 5)" in str(info.value)
    assert len(f.recipe.rules) == 0


def test_steer_direction_of_the_wrong_length_says_the_expected_length(attn_trace):
    f = attn_trace.fork()
    with pytest.raises(tl.errors.InterventionError) as info:
        f.do("linear_1_1", tl.steer(torch.ones(7)))
    err = info.value
    assert err.code == "steer_direction_invalid" and "dim=" not in err.remedy
    assert "length 8" in err.remedy and err.fields["expected_lengths"] == [1, 5, 8]
    f.do("linear_1_1", tl.steer(torch.ones(8)))  # the suggested length works


def test_core_refuses_a_backend_that_ignores_the_save_plan(monkeypatch):
    import torchlens_torch.backend as tb

    torch.manual_seed(0)
    model, x = Attn(), torch.randn(1, 5, 8)
    kept = tl.trace(model, x, save=tl.func("softmax"))
    assert [o.func_name for o in kept if o.saved and o.kind != "output"] == ["softmax"]
    monkeypatch.setattr(tb, "apply_save", lambda trace, plan, **k: None)  # a backend that skips apply_save
    with pytest.raises(tl.errors.PluginError) as info:
        tl.trace(model, x, save=tl.func("softmax"))
    err = info.value
    assert err.code == "backend_save_plan_ignored" and err.fields["backend"] == "torch"
    assert err.fields["num_extra"] == sum(1 for o in kept if o.kind != "output") - 1
    assert tl.trace(model, x).num_ops == kept.num_ops  # save="all" still works


def test_missing_runtime_remedies_use_the_wheelhouse_install_hint(monkeypatch):
    import sys

    import torchlens_torch.plugin as plugin
    from torchlens.backends.registry import install_hint

    monkeypatch.setitem(sys.modules, "torchlens_mechinterp", None)  # the kit "not installed": its import fails
    with pytest.raises(tl.errors.BackendUnsupportedError) as info:
        tl.mechinterp.residual_decomposition  # noqa: B018
    assert info.value.remedy == install_hint("mechinterp") and "find-links" in info.value.remedy
    monkeypatch.setitem(sys.modules, "torchlens_torch.backend", None)  # torch "missing": the import fails
    with pytest.raises(tl.errors.BackendUnsupportedError) as info:
        plugin._protocol()
    assert info.value.code == "runtime_missing" and info.value.remedy == install_hint("torch")
