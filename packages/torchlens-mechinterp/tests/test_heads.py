"""Heads, circuits and neurons against the models' own weights and forward hooks."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
import torchlens_mechinterp as mi
import torchlens_mechinterp.heads as heads_module
from mi_models import BUILDERS, assert_unchanged, ids, snapshot
from torchlens.errors import MechInterpError

H, D, E = 4, 8, 32


def _hand_weights(family, model, layer=0):
    """(W_Q [H,E,D], W_K [Hkv,E,D], W_V, W_O [H,D,E]) read from the parameters by hand."""
    if family == "gpt2":  # Conv1D: [in, out]; c_attn's columns are q | k | v
        attn = model.transformer.h[layer].attn
        w = attn.c_attn.weight.detach()
        q, k, v = (w[:, i * E:(i + 1) * E].reshape(E, H, D).permute(1, 0, 2) for i in range(3))
        o = attn.c_proj.weight.detach().reshape(H, D, E)
        return q, k, v, o
    if family == "neox":  # Linear [out, in]; rows per head are q | k | v of that head
        attn = model.gpt_neox.layers[layer].attention
        w = attn.query_key_value.weight.detach().view(H, 3, D, E)
        q, k, v = (w[:, i].transpose(1, 2) for i in range(3))
        o = attn.dense.weight.detach().t().reshape(H, D, E)
        return q, k, v, o
    attn = model.model.layers[layer].self_attn  # Linear [out, in]; grouped-query K/V
    q = attn.q_proj.weight.detach().t().reshape(E, H, D).permute(1, 0, 2)
    k = attn.k_proj.weight.detach().t().reshape(E, 2, D).permute(1, 0, 2)
    v = attn.v_proj.weight.detach().t().reshape(E, 2, D).permute(1, 0, 2)
    o = attn.o_proj.weight.detach().t().reshape(H, D, E)
    return q, k, v, o


ATTN = {"gpt2": "transformer.h.{}.attn", "llama": "model.layers.{}.self_attn", "neox": "gpt_neox.layers.{}.attention"}


@pytest.mark.parametrize("family", ["gpt2", "llama", "neox"])
def test_qk_and_ov_circuits_equal_the_hand_products(family):
    model = BUILDERS[family](2)
    trace = tl.trace(model, ids(5))
    q, k, v, o = _hand_weights(family, model, layer=1)
    kv = [h // (H // k.shape[0]) for h in range(H)]
    qk = mi.qk_circuit(trace, ATTN[family].format(1))
    ov = mi.ov_circuit(trace, ATTN[family].format(1))
    assert isinstance(qk, mi.FactoredMatrix) and qk.shape == (H, E, E) and ov.shape == (H, E, E)
    for h in range(H):
        assert torch.allclose(qk.AB[h], q[h] @ k[kv[h]].T, atol=1e-6)
        assert torch.allclose(ov.AB[h], v[kv[h]] @ o[h], atol=1e-6)
    views = mi.head_weight_views(trace, ATTN[family].format(1))
    expect = {"gpt2": ("in_out", "Conv1D", True, 4), "llama": ("out_in", "Linear", False, 2),
              "neox": ("out_in", "Linear", True, 4)}[family]
    r = views.receipt
    assert (r["orientation"]["q"], r["module_class"]["q"], r["fused_qkv"], views.n_kv_heads) == expect
    assert views.n_heads == H and views.d_head == D and r["verified"] == {"q": True, "k": True, "v": True, "o": True}
    if family == "neox":
        assert r["slices"]["q"] == "interleaved"


def test_factored_matrix_svd_matches_the_product():
    trace = tl.trace(BUILDERS["gpt2"](1), ids(5))
    ov = mi.ov_circuit(trace, "transformer.h.0.attn")
    U, S, Vh = ov[2].svd()
    assert torch.allclose((U * S) @ Vh, ov.AB[2], atol=1e-5)
    assert torch.allclose(S, torch.linalg.svdvals(ov.AB[2])[:D], atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_head_contributions_equal_z_times_w_o_from_hooks(family):
    model, x = BUILDERS[family](1), ids(6, batch=2)
    trace = tl.trace(model, x)
    proj = model.transformer.h[0].attn.c_proj if family == "gpt2" else model.model.layers[0].self_attn.o_proj
    got = {}
    h1 = proj.register_forward_pre_hook(lambda m, a: got.setdefault("z", a[0]))
    h2 = proj.register_forward_hook(lambda m, a, o: got.setdefault("out", o))
    with torch.no_grad():
        model(x)
    h1.remove(), h2.remove()
    _, _, _, o = _hand_weights(family, model)
    stack = mi.attention_head_contributions(trace, ATTN[family].format(0))
    z = got["z"].reshape(2, 6, H, D)
    for h in range(H):
        assert torch.allclose(stack[f"{ATTN[family].format(0)}.h{h}"].value, z[:, :, h] @ o[h], atol=1e-6)
    if family == "gpt2":
        assert stack.grade == "closed_constant" and torch.equal(stack.rows[-1].value, proj.bias)
    else:
        assert stack.grade == "complete" and len(stack) == H
    assert torch.allclose(sum(r.value for r in stack), got["out"], atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_neuron_rows_equal_hidden_times_w_out(family):
    model, x = BUILDERS[family](1), ids(5)
    trace = tl.trace(model, x)
    proj = model.transformer.h[0].mlp.c_proj if family == "gpt2" else model.model.layers[0].mlp.down_proj
    got = {}
    h1 = proj.register_forward_pre_hook(lambda m, a: got.setdefault("hidden", a[0]))
    h2 = proj.register_forward_hook(lambda m, a, o: got.setdefault("out", o))
    with torch.no_grad():
        model(x)
    h1.remove(), h2.remove()
    W = proj.weight.detach() if family == "gpt2" else proj.weight.detach().t()  # [N, E]
    mlp = "transformer.h.0.mlp" if family == "gpt2" else "model.layers.0.mlp"
    stack = mi.mlp_neuron_contributions(trace, mlp)
    N = W.shape[0]
    assert len([r for r in stack if r.kind == "writer"]) == N
    for n in (0, 7, N - 1):
        assert torch.allclose(stack[f"neuron[{n}]"].value, (got["hidden"][..., n:n + 1] * W[n]).double(), atol=1e-7)
    assert torch.allclose(sum(r.value for r in stack).float(), got["out"], atol=1e-5)
    assert stack.grade == ("closed_constant" if family == "gpt2" else "complete")
    part = mi.mlp_neuron_contributions(trace, mlp, neurons=[3, 9])
    assert part.names[:3] == ["neuron[3]", "neuron[9]", "other_neurons"]
    others = [n for n in range(N) if n not in (3, 9)]
    assert torch.allclose(part["other_neurons"].value, (got["hidden"][..., others] @ W[others]).double(), atol=1e-6)


@pytest.mark.parametrize("call, code", [
    (lambda t: mi.head_weight_views(t, "transformer.h.0.mlp"), "mi_not_attention"),
    (lambda t: mi.qk_circuit(t, "nope"), "mi_not_attention"),
    (lambda t: mi.attention_head_contributions(t, "transformer.h.0"), "mi_not_attention"),
    (lambda t: mi.mlp_neuron_contributions(t, "nope"), "mi_not_mlp"),
    (lambda t: mi.mlp_neuron_contributions(t, "transformer.h.0.attn"), "mi_not_mlp"),
    (lambda t: mi.mlp_neuron_contributions(t, "transformer.h.0.mlp", neurons=[500]), "mi_neuron_index_invalid"),
    (lambda t: mi.mlp_neuron_contributions(t, "transformer.h.0.mlp", neurons=[1, 1]), "mi_neuron_index_invalid"),
])
def test_refusals_leave_the_trace_unchanged(call, code):
    trace = tl.trace(BUILDERS["gpt2"](1), ids(5))
    snap = snapshot(trace)
    with pytest.raises(MechInterpError) as exc:
        call(trace)
    assert exc.value.code == code and exc.value.remedy
    assert_unchanged(trace, snap)


def test_unknown_projection_class_refuses(monkeypatch):
    trace = tl.trace(BUILDERS["gpt2"](1), ids(5))
    snap = snapshot(trace)
    monkeypatch.setattr(heads_module, "ORIENTATION", {})  # no class has a known weight layout
    with pytest.raises(MechInterpError) as exc:
        mi.head_weight_views(trace, "transformer.h.0.attn")
    assert exc.value.code == "mi_head_weights_unresolved" and "Conv1D" in str(exc.value)
    assert_unchanged(trace, snap)


def test_unproven_head_rows_refuse(monkeypatch):
    trace = tl.trace(BUILDERS["gpt2"](1), ids(5))
    snap = snapshot(trace)
    monkeypatch.setattr(heads_module, "RESULT_HEADROOM", 1e-12)  # a budget no float32 sum meets
    with pytest.raises(MechInterpError) as exc:
        mi.attention_head_contributions(trace, "transformer.h.0.attn")
    assert exc.value.code == "mi_head_result_unverified" and exc.value.fields["max_budget_fraction"] > 1
    assert_unchanged(trace, snap)


def test_unproven_neuron_rows_refuse(monkeypatch):
    import torchlens_mechinterp.neurons as neurons_module

    trace = tl.trace(BUILDERS["gpt2"](1), ids(5))
    snap = snapshot(trace)
    monkeypatch.setattr(neurons_module, "HEADROOM", 1e-12)
    with pytest.raises(MechInterpError) as exc:
        mi.mlp_neuron_contributions(trace, "transformer.h.0.mlp")
    assert exc.value.code == "mi_neuron_identity_failed"
    assert_unchanged(trace, snap)


def test_weight_views_on_a_bare_trace_disclose_the_skipped_check():
    model, x = BUILDERS["llama"](1), ids(5)
    bare = tl.trace(model, x, save="none")
    views = mi.head_weight_views(bare, "model.layers.0.self_attn")
    assert views.receipt["verified"] == {} and sorted(views.receipt["verified_skipped"]) == ["k", "o", "q", "v"]
    full = mi.qk_circuit(tl.trace(model, x), "model.layers.0.self_attn")
    assert torch.equal(mi.qk_circuit(bare, "model.layers.0.self_attn").AB, full.AB)
