"""component_graph against forward hooks on the pre-norms' inputs and on the writers' outputs."""

from __future__ import annotations

import pytest
import torch
from mi_models import assert_unchanged, gpt2, ids, llama, neox, snapshot

import torchlens as tl
import torchlens_mechinterp as mi
import torchlens_mechinterp.graph as graph_module
from torchlens.errors import MechInterpError

H = 4


def _norm_inputs(model, x, norms):
    """address -> the tensor entering that norm module, from forward pre-hooks."""
    got, hs = {}, []
    for a in norms:
        hs.append(model.get_submodule(a).register_forward_pre_hook(
            lambda m, args, a=a: got.__setitem__(a, args[0].detach().clone())))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hs:
            h.remove()
    return got


@pytest.mark.parametrize("layers", [2, 4])
def test_gpt2_receivers_equal_their_senders_sum_and_a_hook_on_the_norm_input(layers):
    model = gpt2(layers).double()
    x = ids(5, batch=2)
    trace = tl.trace(model, x, save="all")
    g = mi.component_graph(trace)
    norms = [f"transformer.h.{i}.ln_{j}" for i in range(layers) for j in (1, 2)] + ["transformer.ln_f"]
    hooked = _norm_inputs(model, x, norms)
    assert len(g.receivers) == layers * (3 * H + 1) + 1
    for r in g.receivers.values():
        address = ("transformer.ln_f" if r.kind == "logits" else
                   f"transformer.h.{r.layer}.ln_{1 if r.kind in 'qkv' else 2}")
        assert r.norm == address
        assert torch.equal(r.value, hooked[address]), r.name
        total = torch.stack([s.value for s in r.senders]).sum(0)
        assert (total - r.value).abs().max() <= 1e-12, r.name
    # the senders of layer 1's query receivers: everything written before layer 1
    assert [n.name for n in g.receivers["a1.h1<q>"].senders] == \
        ["input"] + [f"a0.h{h}" for h in range(H)] + ["b0", "m0"]
    assert g.edges["m0->a1.h1<q>"].contribution is g.nodes["m0"].value
    assert g.identity_receipt["max_budget_fraction"] < 1
    # vocabulary count: edges from non-bias senders; every (sender before receiver) pair appears once
    assert g.vocabulary_edge_count == sum(1 for e in g.edges.values() if e.sender.kind != "bias")
    assert not g.parallel


def test_gpt2_writer_nodes_equal_hooks_on_the_model():
    model = gpt2(2).double()
    x = ids(5, batch=2)
    trace = tl.trace(model, x, save="all")
    g = mi.component_graph(trace)
    got = {}
    hs = [model.transformer.h[1].mlp.register_forward_hook(lambda m, a, o: got.__setitem__("m1", o.detach())),
          model.transformer.h[0].attn.c_proj.register_forward_pre_hook(
              lambda m, a: got.__setitem__("z0", a[0].detach()))]
    with torch.no_grad():
        model(x)
    for h in hs:
        h.remove()
    assert torch.equal(g.nodes["m1"].value, got["m1"])
    w = model.transformer.h[0].attn.c_proj.weight.detach()
    D = 32 // H
    for h in range(H):
        ref = got["z0"][..., h * D:(h + 1) * D] @ w[h * D:(h + 1) * D]
        assert (g.nodes[f"a0.h{h}"].value - ref).abs().max() <= 1e-12


def test_parallel_block_mlp_receives_no_edge_from_its_own_layers_heads():
    model = neox(2).double()
    x = ids(5, batch=2)
    trace = tl.trace(model, x, save="all")
    g = mi.component_graph(trace)
    assert g.parallel
    assert not any(n.layer == 1 and n.kind in ("head", "bias") for n in g.receivers["m1"].senders)
    assert {n.name for n in g.receivers["m1"].senders} == {n.name for n in g.receivers["a1.h0<q>"].senders}
    hooked = _norm_inputs(model, x, ["gpt_neox.layers.1.post_attention_layernorm"])
    assert torch.equal(g.receivers["m1"].value, hooked["gpt_neox.layers.1.post_attention_layernorm"])
    for r in g.receivers.values():
        total = torch.stack([s.value for s in r.senders]).sum(0)
        assert (total - r.value).abs().max() <= 1e-12, r.name


def test_grouped_query_attention_refuses_and_leaves_the_trace_unchanged():
    trace = tl.trace(llama(2), ids(5), save="all")
    snap = snapshot(trace)
    with pytest.raises(MechInterpError) as exc:
        mi.component_graph(trace)
    assert exc.value.code == "mi_edge_graph_gqa_unsupported"
    assert_unchanged(trace, snap)


def test_a_receiver_that_is_not_its_senders_sum_refuses_nonadditive(monkeypatch):
    trace = tl.trace(gpt2(2), ids(5), save="all")
    snap = snapshot(trace)
    monkeypatch.setattr(graph_module, "IDENTITY_HEADROOM", 0.0)  # no float budget: the receipt must fail
    with pytest.raises(MechInterpError) as exc:
        mi.component_graph(trace)
    assert exc.value.code == "mi_edge_graph_nonadditive"
    assert_unchanged(trace, snap)


def test_a_rescaled_stream_refuses_nonadditive():
    class Rescaled(torch.nn.Module):  # x = 2 * (x + f(x)): the stream is rescaled
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.ln = torch.nn.LayerNorm(8)
            self.f = torch.nn.Linear(8, 8)
            self.ln_f = torch.nn.LayerNorm(8)
            self.lm_head = torch.nn.Linear(8, 16, bias=False)

        def forward(self, x):
            h = self.emb(x)
            h = (h + self.f(self.ln(h))) * 2
            return self.lm_head(self.ln_f(h))

    torch.manual_seed(0)
    trace = tl.trace(Rescaled(), torch.randint(0, 16, (1, 4)), save="all")
    snap = snapshot(trace)
    with pytest.raises(MechInterpError) as exc:
        mi.component_graph(trace)
    assert exc.value.code == "mi_edge_graph_nonadditive"
    assert_unchanged(trace, snap)


def test_a_partial_capture_refuses_with_the_complete_missing_set_and_retention_plan_prices_it():
    model = gpt2(2)
    full = tl.trace(model, ids(5), save="all")
    plan = mi.retention_plan(full, "component_graph")
    sites = set(graph_module.graph_sites(full))
    assert set(plan.sites) == sites and plan.total_bytes > 0
    partial = tl.trace(model, ids(5), save=plan.save)
    assert mi.component_graph(partial).identity_receipt["max_budget_fraction"] < 1
    bare = tl.trace(model, ids(5), save="none")
    snap = snapshot(bare)
    with pytest.raises(MechInterpError) as exc:
        mi.component_graph(bare)
    assert exc.value.code == "mi_payloads_missing"
    assert set(exc.value.fields["missing"]) == set(graph_module.graph_sites(bare))
    assert_unchanged(bare, snap)
    assert set(mi.retention_plan(full, "head_scores").functions) == {"head_scores"}
