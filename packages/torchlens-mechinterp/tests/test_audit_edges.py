"""causal_audit of an EDGE table (glossary: causal_audit) and the replayability check patch_edges
needs, checked against an independent forward-hook patch of each edge alone (helper A, issue 17)."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
import torchlens.mechinterp as mi
from mi_models import gpt2, ids


def _metric(logits):
    return logits[:, -1, 3] - logits[:, -1, 4]


@pytest.fixture(scope="module")
def setup():
    model = gpt2(layers=2, d_model=16, heads=2).double()
    clean, corrupt = ids(6, batch=2, seed=1), ids(6, batch=2, seed=2)
    table = mi.edge_scores(model, clean, corrupted_input=corrupt, metric=_metric, method="eap")
    return model, clean, corrupt, table


def _senders(model, x):
    """Every sender's value on input x, read by forward hooks (input, a{L}.h{H}, b{L}, m{L})."""
    tr = model.transformer
    n_head = model.config.n_head
    dh = model.config.n_embd // n_head
    vals, hs = {}, []
    hs.append(tr.drop.register_forward_hook(lambda m, a, o: vals.__setitem__("input", o.detach().clone())))
    for layer, blk in enumerate(tr.h):
        def pre(m, args, layer=layer):
            z = args[0].detach()
            for h in range(n_head):
                vals[f"a{layer}.h{h}"] = z[..., h * dh:(h + 1) * dh] @ m.weight[h * dh:(h + 1) * dh, :].detach()
            vals[f"b{layer}"] = m.bias.detach().expand_as(vals[f"a{layer}.h0"]).clone()
        hs.append(blk.attn.c_proj.register_forward_pre_hook(pre))
        hs.append(blk.mlp.register_forward_hook(
            lambda m, a, o, layer=layer: vals.__setitem__(f"m{layer}", o.detach().clone())))
    try:
        with torch.no_grad():
            logits = model(x).logits
    finally:
        for h in hs:
            h.remove()
    return vals, logits


def _hook_patch_one(model, x, sender_delta, receiver):
    """Logits of a forward on x in which only `receiver` reads its input plus sender_delta
    (s_corrupt - s_clean): the single-receiver convention, with plain torch hooks."""
    tr = model.transformer
    n_head, d = model.config.n_head, model.config.n_embd
    dh = d // n_head
    hs = []
    if receiver == "logits" or receiver.startswith("m"):
        norm = tr.ln_f if receiver == "logits" else tr.h[int(receiver[1:])].ln_2
        hs.append(norm.register_forward_pre_hook(lambda m, args: (args[0] + sender_delta,) + tuple(args[1:])))
    else:
        layer = int(receiver[1:receiver.index(".")])
        head = int(receiver[receiver.index(".h") + 2:receiver.index("<")])
        role = "qkv".index(receiver[receiver.index("<") + 1])
        blk = tr.h[layer]
        seen = {}
        hs.append(blk.ln_1.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0])))

        def swap(m, args, out):
            y = torch.nn.functional.layer_norm(seen["x"] + sender_delta, (d,), blk.ln_1.weight, blk.ln_1.bias,
                                               blk.ln_1.eps)
            new = y @ m.weight + m.bias
            cols = slice(role * d + head * dh, role * d + (head + 1) * dh)
            out = out.clone()
            out[..., cols] = new[..., cols]
            return out
        hs.append(blk.attn.c_attn.register_forward_hook(swap))
    try:
        with torch.no_grad():
            return model(x).logits
    finally:
        for h in hs:
            h.remove()


def test_audit_equals_independent_hook_patch_of_each_edge(setup):
    model, clean, corrupt, table = setup
    names = list(table.scores())
    pick = [n for n in names if n.endswith("logits")][:3] + [n for n in names if n.endswith(">")][::7][:5] \
        + [n for n in names if n.split("->")[1].startswith("m")][:3] + [n for n in names if n.startswith("b")][:2]
    assert {"logits", "m", "q", "b"} <= {("b" if n.startswith("b") else "logits" if n.endswith("logits") else
                                          "q" if n.endswith(">") else "m") for n in pick}
    audit = mi.causal_audit(table, model, clean, corrupted_input=corrupt, metric=_metric, edges=pick)
    assert [r.edge for r in audit.rows] == pick and audit.sets_not_measured == ()
    vc, logits_c = _senders(model, clean)
    vk, _ = _senders(model, corrupt)
    base = _metric(logits_c).mean().item()
    assert audit.metric_clean == pytest.approx(base, abs=1e-12)
    for row in audit.rows:
        sender, receiver = row.edge.split("->")
        assert (row.component, row.site) == (sender, receiver)
        assert row.claimed == table[row.edge].score
        hooked = _metric(_hook_patch_one(model, clean, vk[sender] - vc[sender], receiver)).mean().item() - base
        assert abs(row.measured - hooked) <= 1e-10, (row.edge, row.measured, hooked)
        if sender.startswith("b"):
            assert abs(row.measured) <= 1e-12 and row.claimed == 0.0
    # the summary is the plain Pearson correlation of the two columns
    xs = torch.tensor([r.claimed for r in audit.rows], dtype=torch.float64)
    ys = torch.tensor([r.measured for r in audit.rows], dtype=torch.float64)
    assert audit.pearson == pytest.approx(torch.corrcoef(torch.stack([xs, ys]))[0, 1].item(), abs=1e-12)
    assert audit.max_abs_error == pytest.approx((ys - xs).abs().max().item())


def test_audit_of_every_edge_tracks_eap_first_order_claim():
    """On the spec's tiny GPT-2, every edge is audited (none left unmeasured); with small random
    weights the metric is nearly linear, so EAP's claim and the patched effect agree closely."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=8, vocab_size=32, n_positions=16,
                                       attn_implementation="eager", bos_token_id=0, eos_token_id=0)).eval().double()
    clean, corrupt = torch.randint(0, 32, (2, 5)), torch.randint(0, 32, (2, 5))
    table = mi.edge_scores(model, clean, corrupted_input=corrupt, metric=_metric, method="eap")
    audit = mi.causal_audit(table, model, clean, corrupted_input=corrupt, metric=_metric)
    assert len(audit) == len(table) == 57 and audit.sets_not_measured == ()
    assert audit.pearson > 0.9
    assert audit.meta["n_patch_calls"] == 57


def test_audit_refusals_come_before_any_patch(setup):
    model, clean, corrupt, table = setup
    with pytest.raises(tl.errors.TorchLensError) as exc:
        mi.causal_audit({"a": 1}, model, clean, corrupted_input=corrupt, metric=_metric)
    assert exc.value.code == "mi_audit_table_invalid"
    with pytest.raises(tl.errors.TorchLensError) as exc:
        mi.causal_audit(table, model, clean, corrupted_input=corrupt, metric=_metric, edges=["m9->logits"])
    assert exc.value.code == "mi_audit_table_invalid" and exc.value.fields["unknown"] == ["m9->logits"]
    with pytest.raises(tl.errors.TorchLensError) as exc:
        mi.causal_audit(table, model, clean, corrupted_input=corrupt, metric=_metric, edges="m0->logits")
    assert exc.value.code == "mi_audit_table_invalid"
    with pytest.raises(tl.errors.TorchLensError) as exc:
        mi.causal_audit(table, model, clean, corrupted_input=corrupt[:, :4], metric=_metric)
    assert exc.value.code == "mi_edge_scores_inputs_mismatched"
    with pytest.raises(tl.errors.TorchLensError) as exc:
        mi.causal_audit(table, model, clean, corrupted_input=corrupt, metric=lambda lg: lg[:, -1, :3],
                        edges=["m0->logits"])
    assert exc.value.code == "mi_edge_scores_metric_invalid"


def test_require_replayable_reads_trace_options_and_forks():
    model = gpt2(layers=1, d_model=16, heads=2)
    x = ids(5)
    plain = tl.trace(model, x, save="all")
    ready = tl.trace(model, x, capture=tl.options.CaptureOptions(replayable=True), save="all")
    with pytest.raises(tl.errors.TorchLensError) as exc:
        mi.require_replayable(plain, "patch_edges")
    assert exc.value.code == "mi_edge_patch_not_replayable" and "replayable=True" in exc.value.remedy
    mi.require_replayable(ready)
    mi.require_replayable(ready.fork())
    with pytest.raises(tl.errors.TorchLensError):
        mi.require_replayable(plain.fork())
