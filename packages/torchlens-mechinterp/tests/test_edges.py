"""edge_scores (EAP, EAP-IG) and patch_edges against independent plain-PyTorch implementations
written here: forward hooks on a GPT-2 model, per-receiver forwards and full autograd (no local
pull-back), the MIB convention applied inside one hooked forward."""

from __future__ import annotations

import pytest
import torch
from mi_models import assert_unchanged, gpt2, ids, snapshot

import torchlens as tl
import torchlens_mechinterp as mi
from torchlens.errors import MechInterpError

L, H, E = 2, 4, 32
D = E // H


def metric(logits):
    return logits[:, -1, 3] - logits[:, -1, 4]


@pytest.fixture(scope="module")
def model():
    return gpt2(L).double()


@pytest.fixture(scope="module")
def xs():
    return ids(5, batch=2, seed=1), ids(5, batch=2, seed=2)


# ----------------------------------------------------------------------------------------------
# the independent reference: senders and receiver-local gradients with hooks + autograd

def _senders(model, x, embeds=None):
    """name -> value [B, P, E] of every residual writer, from hooks on the live model."""
    out, hs = {}, []
    tr = model.transformer
    hs.append(tr.drop.register_forward_hook(lambda m, a, o: out.__setitem__("input", o.detach())))
    for layer, blk in enumerate(tr.h):
        def pre(m, a, layer=layer):
            z = a[0].detach()  # merged heads [B, P, H*D]
            w = m.weight.detach()  # Conv1D [in, out]
            for h in range(H):
                out[f"a{layer}.h{h}"] = z[..., h * D:(h + 1) * D] @ w[h * D:(h + 1) * D]
            out[f"b{layer}"] = m.bias.detach().expand(z.shape[:-1] + (E,))
        hs.append(blk.attn.c_proj.register_forward_pre_hook(pre))
        hs.append(blk.mlp.register_forward_hook(lambda m, a, o, layer=layer: out.__setitem__(f"m{layer}", o.detach())))
    try:
        with torch.no_grad():
            model(x) if embeds is None else model(inputs_embeds=embeds)
    finally:
        for h in hs:
            h.remove()
    return out


def _local_grad(model, x, receiver, embeds=None):
    """dM/d(input of receiver) through that receiver's read only: a leaf copy of its input is
    fed to that read alone; everything else runs as usual; full autograd."""
    tr = model.transformer
    leaf = {}
    hs = []
    if receiver == "logits" or receiver.startswith("m"):
        norm = tr.ln_f if receiver == "logits" else tr.h[int(receiver[1:])].ln_2

        def swap(m, a):
            leaf["x"] = a[0].detach().clone().requires_grad_(True)
            return (leaf["x"],)
        hs.append(norm.register_forward_pre_hook(swap))
    else:
        layer, rest = receiver[1:].split(".h")
        layer, h, role = int(layer), int(rest[0]), rest[2]
        blk = tr.h[layer]
        off = "qkv".index(role) * E + h * D

        def keep(m, a):
            if not leaf.get("busy"):
                leaf["x"] = a[0].detach().clone().requires_grad_(True)
        hs.append(blk.ln_1.register_forward_pre_hook(keep))

        def patch(m, a, o):
            own = m(blk.ln_1(leaf["x"]))
            return torch.cat([o[..., :off], own[..., off:off + D], o[..., off + D:]], -1)

        def guarded(m, a, o):
            if leaf.get("busy"):
                return o
            leaf["busy"] = True
            try:
                return patch(m, a, o)
            finally:
                leaf["busy"] = False
        hs.append(blk.attn.c_attn.register_forward_hook(guarded))
    try:
        with torch.enable_grad():
            y = model(x) if embeds is None else model(inputs_embeds=embeds)
            (g,) = torch.autograd.grad(metric(y.logits).sum(), leaf["x"])
    finally:
        for hk in hs:
            hk.remove()
    return g


def _reference_scores(model, clean, corrupt, steps, method):
    s_c, s_k = _senders(model, clean), _senders(model, corrupt)
    wte = model.transformer.wte.weight.detach()
    e_c, e_k = wte[clean], wte[corrupt]  # the model adds the same position table to both
    receivers = [f"a{layer}.h{h}<{r}>" for layer in range(L) for h in range(H) for r in "qkv"] \
        + [f"m{layer}" for layer in range(L)] + ["logits"]
    grads = {}
    for r in receivers:
        acc = 0
        for k in range(steps):
            emb = None if method == "eap" else e_k + (k / steps) * (e_c - e_k)
            acc = acc + _local_grad(model, clean, r, emb)
        grads[r] = acc / steps
    return s_c, s_k, grads


def test_eap_equals_an_independent_autograd_computation_on_every_edge(model, xs):
    clean, corrupt = xs
    table = mi.edge_scores(model, clean, corrupted_input=corrupt, metric=metric, method="eap")
    s_c, s_k, grads = _reference_scores(model, clean, corrupt, 1, "eap")
    assert len(table) == 127
    worst = 0.0
    for (_t, kind, (name,)), row in table.items():
        assert kind == "EDGE"
        snd, rcv = name.split("->")
        ref = float(((s_k[snd] - s_c[snd]) * grads[rcv]).sum((1, 2)).mean())
        if snd.startswith("b"):
            assert row.score == 0.0
            continue
        worst = max(worst, abs(row.score - ref) / max(abs(ref), 1e-12))
        assert row.score == pytest.approx(ref, rel=1e-8, abs=1e-13), name
    assert worst <= 1e-8


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_eap_ig_equals_an_independent_left_riemann_sum(model, xs, steps):
    clean, corrupt = xs
    table = mi.edge_scores(model, clean, corrupted_input=corrupt, metric=metric, steps=steps,
                           example_reduction="sum")
    s_c, s_k, grads = _reference_scores(model, clean, corrupt, steps, "eap_ig")
    for name in table:
        snd, rcv = name.split("->")
        ref = float(((s_k[snd] - s_c[snd]) * grads[rcv]).sum((1, 2)).sum())
        assert table[name].score == pytest.approx(ref, rel=1e-8, abs=1e-13), name


@pytest.mark.parametrize("method,steps,chunk", [("eap", 1, None), ("eap_ig", 3, None), ("eap_ig", 2, 3)])
def test_edge_scores_with_random_norm_scales_shifts_and_biases_equal_the_reference(xs, method, steps, chunk,
                                                                                   monkeypatch):
    """GPT-2's init leaves every LayerNorm at scale 1 / shift 0 and every bias at 0; here all of
    them are random, so the pull-back's folded scale and its shift / bias terms are exercised.
    chunk=3: the score contraction runs over 4 chunks of the 10 (row, position) pairs, the last
    one short."""
    import torchlens_mechinterp.edges as edges_module

    if chunk is not None:
        monkeypatch.setattr(edges_module._ScorePlan, "_CHUNK", chunk)
    model = gpt2(L).double()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name and name.endswith("weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    clean, corrupt = xs
    table = mi.edge_scores(model, clean, corrupted_input=corrupt, metric=metric, method=method, steps=steps)
    s_c, s_k, grads = _reference_scores(model, clean, corrupt, steps, method)
    for name in table:
        snd, rcv = name.split("->")
        ref = float(((s_k[snd] - s_c[snd]) * grads[rcv]).sum((1, 2)).mean())
        if snd.startswith("b"):
            assert table[name].score == 0.0
            continue
        assert table[name].score == pytest.approx(ref, rel=1e-8, abs=1e-13), name


def test_edge_scores_into_mlps_and_logits_of_a_parallel_block_model_equal_the_reference():
    """GPT-NeoX (parallel attention + MLP): a layer's heads and its MLP read the same residual
    through two different norms (random scales / shifts here), so the MLP's gradient must be
    pulled back through its own norm. Reference: hooks for the senders, a leaf swapped into the
    MLP's / final norm's input and full autograd, at every EAP-IG point."""
    from mi_models import neox

    model = neox(L).double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name or name.endswith("bias"):
                base = 1.0 if (name.endswith("weight")) else 0.0
                p.copy_(base + 0.4 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    clean, corrupt = ids(5, batch=2, seed=1), ids(5, batch=2, seed=2)
    steps = 2
    nx = model.gpt_neox

    def senders(x, embeds=None):
        out, hs = {}, []
        hs.append(nx.emb_dropout.register_forward_hook(lambda m, a, o: out.__setitem__("input", o.detach())))
        for layer, blk in enumerate(nx.layers):
            def pre(m, a, layer=layer):
                z = a[0].detach()
                for h in range(H):
                    out[f"a{layer}.h{h}"] = z[..., h * D:(h + 1) * D] @ m.weight[:, h * D:(h + 1) * D].detach().t()
                out[f"b{layer}"] = m.bias.detach().expand(z.shape[:-1] + (E,))
            hs.append(blk.attention.dense.register_forward_pre_hook(pre))
            hs.append(blk.mlp.register_forward_hook(lambda m, a, o, layer=layer: out.__setitem__(f"m{layer}",
                                                                                                  o.detach())))
        try:
            with torch.no_grad():
                model(x) if embeds is None else model(inputs_embeds=embeds)
        finally:
            for hk in hs:
                hk.remove()
        return out

    def local_grad(receiver, embeds):
        norm = nx.final_layer_norm if receiver == "logits" else nx.layers[int(receiver[1:])].post_attention_layernorm
        leaf = {}

        def swap(m, a):
            leaf["x"] = a[0].detach().clone().requires_grad_(True)
            return (leaf["x"],)
        hk = norm.register_forward_pre_hook(swap)
        try:
            with torch.enable_grad():
                (gr,) = torch.autograd.grad(metric(model(inputs_embeds=embeds).logits).sum(), leaf["x"])
        finally:
            hk.remove()
        return gr

    table = mi.edge_scores(model, clean, corrupted_input=corrupt, metric=metric, steps=steps)
    s_c, s_k = senders(clean), senders(corrupt)
    e_c, e_k = nx.embed_in.weight.detach()[clean], nx.embed_in.weight.detach()[corrupt]
    checked = 0
    for receiver in [f"m{layer}" for layer in range(L)] + ["logits"]:
        grad = sum(local_grad(receiver, e_k + (k / steps) * (e_c - e_k)) for k in range(steps)) / steps
        for name in table:
            snd, rcv = name.split("->")
            if rcv != receiver:
                continue
            ref = float(((s_k[snd] - s_c[snd]) * grad).sum((1, 2)).mean())
            if snd.startswith("b"):
                assert table[name].score == 0.0
                continue
            assert table[name].score == pytest.approx(ref, rel=1e-8, abs=1e-13), name
            checked += 1
    assert checked == (1 + 0) + (1 + H + 1) + (1 + 2 * H + 2)  # m0: input; m1: + layer 0; logits: all


def test_edge_score_table_saves_and_loads(model, xs, tmp_path):
    from torchlens_mechinterp.edges import EdgeScoreTable

    table = mi.edge_scores(model, xs[0], corrupted_input=xs[1], metric=metric, method="eap")
    back = EdgeScoreTable.load(table.save(tmp_path / "scores.json"))
    assert back.scores() == table.scores()


@pytest.mark.parametrize("kwargs,code", [
    ({"method": "acdc"}, "mi_edge_scores_setting_invalid"),
    ({"method": "eap", "steps": 3}, "mi_edge_scores_setting_invalid"),
    ({"steps": 0}, "mi_edge_scores_setting_invalid"),
    ({"example_reduction": "max"}, "mi_edge_scores_setting_invalid"),
    ({"metric": lambda logits: logits[:, -1]}, "mi_edge_scores_metric_invalid"),
    ({"metric": lambda logits: logits.sum()}, "mi_edge_scores_metric_invalid"),
    ({"corrupted_input": ids(6, batch=2, seed=3)}, "mi_edge_scores_inputs_mismatched"),
])
def test_edge_scores_refusals(model, xs, kwargs, code):
    args = {"corrupted_input": xs[1], "metric": metric, **kwargs}
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(MechInterpError) as exc:
        mi.edge_scores(model, xs[0], **args)
    assert exc.value.code == code
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------------------------
# patch_edges against an independent hook implementation of the MIB convention

def _hook_patch(model, clean, corrupt, edges):
    """One forward of `clean` where each receiver reads input - sum(s) + sum(s_corrupt) over its
    patched senders, s being the values of this (patched) forward."""
    corr = _senders(model, corrupt)
    by = {}
    for e in edges:
        s, r = e.split("->")
        by.setdefault(r, []).append(s)
    cur, hs = {}, []
    tr = model.transformer
    hs.append(tr.drop.register_forward_hook(lambda m, a, o: cur.__setitem__("input", o)))

    def patched(x, r):
        for s in by.get(r, []):
            x = x - cur[s] + corr[s]
        return x
    for layer, blk in enumerate(tr.h):
        def pre(m, a, layer=layer):
            z = a[0]
            for h in range(H):
                cur[f"a{layer}.h{h}"] = z[..., h * D:(h + 1) * D] @ m.weight[h * D:(h + 1) * D]
            cur[f"b{layer}"] = m.bias.expand(z.shape[:-1] + (E,))
        hs.append(blk.attn.c_proj.register_forward_pre_hook(pre))
        hs.append(blk.mlp.register_forward_hook(lambda m, a, o, layer=layer: cur.__setitem__(f"m{layer}", o)))
        seen = {}
        hs.append(blk.ln_1.register_forward_pre_hook(lambda m, a, seen=seen: seen.__setitem__("x", a[0])))

        def qkv(m, a, o, layer=layer, seen=seen, blk=blk):
            o = o.clone()
            for h in range(H):
                for i, role in enumerate("qkv"):
                    r = f"a{layer}.h{h}<{role}>"
                    if r in by:
                        own = torch.nn.functional.layer_norm(patched(seen["x"], r), (E,), blk.ln_1.weight,
                                                             blk.ln_1.bias, blk.ln_1.eps) @ m.weight + m.bias
                        o[..., i * E + h * D:i * E + (h + 1) * D] = own[..., i * E + h * D:i * E + (h + 1) * D]
            return o
        hs.append(blk.attn.c_attn.register_forward_hook(qkv))
        hs.append(blk.ln_2.register_forward_pre_hook(lambda m, a, layer=layer: (patched(a[0], f"m{layer}"),)))
    hs.append(tr.ln_f.register_forward_pre_hook(lambda m, a: (patched(a[0], "logits"),)))
    try:
        with torch.no_grad():
            return model(clean).logits
    finally:
        for h in hs:
            h.remove()


def test_patch_edges_equals_a_forward_hook_implementation_of_the_mib_convention(model, xs):
    clean_ids, corrupt_ids = xs
    clean = tl.trace(model, clean_ids, save="all", capture=tl.options.CaptureOptions(replayable=True))
    corrupt = tl.trace(model, corrupt_ids, save="all", capture=tl.options.CaptureOptions(replayable=True))
    graph, cgraph = mi.component_graph(clean), mi.component_graph(corrupt)
    g = torch.Generator().manual_seed(0)
    names = list(graph.edges)
    kept = {n for n in names if torch.rand((), generator=g) < 0.3}
    outside = [graph.edges[n] for n in names if n not in kept]
    snap = snapshot(clean)
    fork = mi.patch_edges(clean, outside, corrupted_graph=cgraph)
    assert_unchanged(clean, snap)
    ref = _hook_patch(model, clean_ids, corrupt_ids, [e.name for e in outside])
    got = fork._ops[graph.receivers["logits"].norm_output]  # sanity: a patched site exists
    assert got is not None
    out = fork.modules["lm_head"].out
    assert (out - ref).abs().max() <= 1e-10
    assert (clean.modules["lm_head"].out - ref).abs().max() > 1e-6  # the patch moved the logits


def test_patch_edges_full_circuit_equals_hooks_and_reuses_the_passed_graph(model, xs):
    """Every edge into every receiver (the benchmark's call): all q/k/v receivers of a layer share
    one patched input (one group), and the stage refresh must re-read the senders earlier stages
    changed. The Edge objects carry the graph built on this trace, so patch_edges reuses it."""
    clean_ids, corrupt_ids = xs
    clean = tl.trace(model, clean_ids, save="all", capture=tl.options.CaptureOptions(replayable=True))
    corrupt = tl.trace(model, corrupt_ids, save="all", capture=tl.options.CaptureOptions(replayable=True))
    graph, cgraph = mi.component_graph(clean), mi.component_graph(corrupt)
    import torchlens_mechinterp.edges as edges_module

    calls = []
    real = edges_module.component_graph
    edges_module.component_graph = lambda t, **kw: calls.append(t) or real(t, **kw)
    try:
        fork = mi.patch_edges(clean, list(graph.edges.values()), corrupted_graph=cgraph)
        assert calls == []  # the passed graph was reused
        fork2 = mi.patch_edges(clean, list(graph.edges), corrupted_graph=cgraph)  # names: a fresh build
        assert calls == [clean]
    finally:
        edges_module.component_graph = real
    ref = _hook_patch(model, clean_ids, corrupt_ids, list(graph.edges))
    assert (fork.modules["lm_head"].out - ref).abs().max() <= 1e-10
    assert (fork2.modules["lm_head"].out - ref).abs().max() <= 1e-10
    assert (clean.modules["lm_head"].out - ref).abs().max() > 1e-6


def test_patch_edges_single_receiver_and_empty(model, xs):
    clean = tl.trace(model, xs[0], save="all", capture=tl.options.CaptureOptions(replayable=True))
    corrupt = tl.trace(model, xs[1], save="all", capture=tl.options.CaptureOptions(replayable=True))
    cgraph = mi.component_graph(corrupt)
    edges = ["a0.h1->a1.h2<k>", "m0->a1.h2<k>"]
    fork = mi.patch_edges(clean, edges, corrupted_graph=cgraph)
    ref = _hook_patch(model, xs[0], xs[1], edges)
    assert (fork.modules["lm_head"].out - ref).abs().max() <= 1e-10
    empty = mi.patch_edges(clean, [], corrupted_graph=cgraph)
    assert torch.equal(empty.modules["lm_head"].out, clean.modules["lm_head"].out)


def test_patch_edges_refusals_leave_the_trace_unchanged(model, xs):
    clean = tl.trace(model, xs[0], save="all", capture=tl.options.CaptureOptions(replayable=True))
    corrupt = tl.trace(model, xs[1], save="all", capture=tl.options.CaptureOptions(replayable=True))
    cgraph = mi.component_graph(corrupt)
    snap = snapshot(clean)
    for edges, kw, code in [
        (["m0->logits", "m0->logits"], {"corrupted_graph": cgraph}, "mi_edge_patch_edge_repeated"),
        (["m1->a0.h0<q>"], {"corrupted_graph": cgraph}, "mi_edge_unknown"),
        (["m0->logits"], {"corrupted_graph": corrupt}, "mi_edge_corrupted_graph_invalid"),
    ]:
        with pytest.raises(MechInterpError) as exc:
            mi.patch_edges(clean, edges, **kw)
        assert exc.value.code == code
        assert_unchanged(clean, snap)
    other = tl.trace(model, ids(6, batch=2, seed=3), save="all", capture=tl.options.CaptureOptions(replayable=True))
    with pytest.raises(MechInterpError) as exc:
        mi.patch_edges(clean, ["m0->logits"], corrupted_graph=mi.component_graph(other))
    assert exc.value.code == "mi_edge_scores_inputs_mismatched"
    assert_unchanged(clean, snap)
    plain = tl.trace(model, xs[0], save="all")  # a default capture: patching needs replayable=True
    plain_snap = snapshot(plain)
    with pytest.raises(MechInterpError) as exc:
        mi.patch_edges(plain, ["m0->logits"], corrupted_graph=cgraph)
    assert exc.value.code == "mi_edge_patch_not_replayable" and "replayable=True" in exc.value.remedy
    assert_unchanged(plain, plain_snap)


def test_a_shared_attention_mlp_norm_refuses_scores_and_mlp_patches():
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    gptj = GPTJForCausalLM(GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, vocab_size=64,
                                      n_positions=64, attn_implementation="eager")).eval()
    x, xc = ids(5, batch=2, seed=1), ids(5, batch=2, seed=2)
    with pytest.raises(MechInterpError) as exc:
        mi.edge_scores(gptj, x, corrupted_input=xc, metric=metric)
    assert exc.value.code == "mi_edge_scores_shared_norm"
    clean, corrupt = tl.trace(gptj, x, save="all", capture=tl.options.CaptureOptions(replayable=True)), tl.trace(gptj, xc, save="all", capture=tl.options.CaptureOptions(replayable=True))
    snap = snapshot(clean)
    with pytest.raises(MechInterpError) as exc:
        mi.patch_edges(clean, ["input->m0"], corrupted_graph=mi.component_graph(corrupt))
    assert exc.value.code == "mi_edge_scores_shared_norm"
    assert_unchanged(clean, snap)


def _neox_hook_patch(model, clean, corrupt, edges):
    """The MIB convention on GPT-NeoX (parallel blocks, per-head interleaved fused q|k|v rows)."""
    base = model.gpt_neox

    def run(x, by, corr):
        cur, hs = {}, []
        hs.append(base.emb_dropout.register_forward_hook(lambda m, a, o: cur.__setitem__("input", o)))

        def patched(v, r):
            for s in by.get(r, []):
                v = v - cur[s] + corr[s]
            return v
        for layer, blk in enumerate(base.layers):
            def pre(m, a, layer=layer):
                z = a[0]
                for h in range(H):
                    cur[f"a{layer}.h{h}"] = z[..., h * D:(h + 1) * D] @ m.weight.t()[h * D:(h + 1) * D]
                cur[f"b{layer}"] = m.bias.expand(z.shape[:-1] + (E,))
            hs.append(blk.attention.dense.register_forward_pre_hook(pre))
            hs.append(blk.mlp.register_forward_hook(lambda m, a, o, layer=layer: cur.__setitem__(f"m{layer}", o)))
            seen = {}
            hs.append(blk.input_layernorm.register_forward_pre_hook(
                lambda m, a, seen=seen: seen.__setitem__("x", a[0])))

            def qkv(m, a, o, layer=layer, seen=seen, blk=blk):
                o = o.clone()
                for h in range(H):
                    for i, role in enumerate("qkv"):
                        r = f"a{layer}.h{h}<{role}>"
                        if r in by:
                            ln = blk.input_layernorm
                            own = torch.nn.functional.linear(torch.nn.functional.layer_norm(
                                patched(seen["x"], r), (E,), ln.weight, ln.bias, ln.eps), m.weight, m.bias)
                            c = h * 3 * D + i * D
                            o[..., c:c + D] = own[..., c:c + D]
                return o
            hs.append(blk.attention.query_key_value.register_forward_hook(qkv))
            hs.append(blk.post_attention_layernorm.register_forward_pre_hook(
                lambda m, a, layer=layer: (patched(a[0], f"m{layer}"),)))
        hs.append(base.final_layer_norm.register_forward_pre_hook(lambda m, a: (patched(a[0], "logits"),)))
        try:
            with torch.no_grad():
                out = model(x).logits
        finally:
            for hk in hs:
                hk.remove()
        return out, {k: v.detach() for k, v in cur.items()}

    _, corr = run(corrupt, {}, {})
    by = {}
    for e in edges:
        s, r = e.split("->")
        by.setdefault(r, []).append(s)
    return run(clean, by, corr)[0]


def test_patch_edges_on_a_parallel_block_model_equals_hooks():
    from mi_models import neox

    model = neox(2).double()
    x, xc = ids(5, batch=2, seed=1), ids(5, batch=2, seed=2)
    clean, corrupt = tl.trace(model, x, save="all", capture=tl.options.CaptureOptions(replayable=True)), tl.trace(model, xc, save="all", capture=tl.options.CaptureOptions(replayable=True))
    graph, cgraph = mi.component_graph(clean), mi.component_graph(corrupt)
    g = torch.Generator().manual_seed(1)
    outside = [n for n in graph.edges if not torch.rand((), generator=g) < 0.3]
    fork = mi.patch_edges(clean, outside, corrupted_graph=cgraph)
    ref = _neox_hook_patch(model, x, xc, outside)
    head = graph.receivers["logits"]
    from torchlens_mechinterp._common import head_facts

    logits = head_facts(clean, "test").logits_label
    out = fork._ops[logits].out
    assert (out - ref).abs().max() <= 1e-10
    assert (clean._ops[logits].out - ref).abs().max() > 1e-6
    assert head.kind == "logits"


def test_edges_are_intervention_sites_for_trace_do(model, xs):
    clean = tl.trace(model, xs[0], save="all", capture=tl.options.CaptureOptions(replayable=True))
    corrupt = tl.trace(model, xs[1], save="all", capture=tl.options.CaptureOptions(replayable=True))
    graph, cgraph = mi.component_graph(clean), mi.component_graph(corrupt)
    for name, kind in [("m0->logits", "EDGE"), ("a0.h3->m1", "EDGE"), ("a0.h1->a1.h2<v>", "ACT")]:
        edge = graph.edges[name]
        assert edge.selection_kind == kind
        fork = clean.fork()
        fork.do(edge, edge.patch_value(cgraph))
        ref = _hook_patch(model, xs[0], xs[1], [name])
        assert (fork.modules["lm_head"].out - ref).abs().max() <= 1e-10, name
        assert (clean.modules["lm_head"].out - ref).abs().max() > 1e-9, name


def test_edge_scores_reuses_the_structure_until_the_model_changes(xs, monkeypatch):
    """The structure capture (one row) is kept per model; an in-place weight edit invalidates it
    and the scores then equal a cold computation."""
    import torchlens_mechinterp.edges as edges_module

    model = gpt2(L).double()
    calls = []
    real = tl.trace
    monkeypatch.setattr(tl, "trace", lambda *a, **k: calls.append(1) or real(*a, **k))
    clean, corrupt = xs
    t1 = mi.edge_scores(model, clean, corrupted_input=corrupt, metric=metric, steps=2)
    t2 = mi.edge_scores(model, clean, corrupted_input=corrupt, metric=metric, steps=2)
    assert len(calls) == 1
    assert t2.scores() == pytest.approx(t1.scores(), rel=1e-12, abs=1e-15)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight.mul_(1.5)
        model.transformer.h[1].ln_1.weight.add_(0.25)
    t3 = mi.edge_scores(model, clean, corrupted_input=corrupt, metric=metric, steps=2)
    assert len(calls) == 2
    edges_module._PLANS.clear()
    t4 = mi.edge_scores(model, clean, corrupted_input=corrupt, metric=metric, steps=2)
    assert t3.scores() == pytest.approx(t4.scores(), rel=1e-12, abs=1e-15)
    assert t3.scores() != pytest.approx(t1.scores(), rel=1e-6)
