"""direct_logit_contributions: the identity gate, and the rows against a hand computation
from forward hooks and the model's own weights."""

from __future__ import annotations

import re

import pytest
import torch

import torchlens as tl
import torchlens_mechinterp as mi
import torchlens_mechinterp.dla as dla_module
from mi_models import BUILDERS, EXTRA_BUILDERS, assert_unchanged, ids, snapshot
from torchlens.errors import MechInterpError

ANSWER, VS = [3, 5], [7, 11]


def _hand_layer_rows(family, model, x, answer, vs, position=-1):
    """Per-writer DLA by hand: hooks read each writer and the final norm's input; the frozen
    scale, the centring and W_U come from the model's own modules."""
    if family == "gpt2":
        blocks, norm, W_U = model.transformer.h, model.transformer.ln_f, model.lm_head.weight
        parts = [("attn", "attn"), ("mlp", "mlp")]
    else:
        blocks, norm, W_U = model.model.layers, model.model.norm, model.lm_head.weight
        parts = [("self_attn", "attn"), ("mlp", "mlp")]
    seen, hs = [], []
    if family == "gpt2":
        hs.append(model.transformer.wte.register_forward_hook(lambda m, a, o: seen.append(o)))
        hs.append(model.transformer.wpe.register_forward_hook(lambda m, a, o: seen.append(o)))
    else:
        hs.append(model.model.embed_tokens.register_forward_hook(lambda m, a, o: seen.append(o)))
    for blk in blocks:
        for attr, _ in parts:
            hs.append(getattr(blk, attr).register_forward_hook(
                lambda m, a, o: seen.append(o[0] if isinstance(o, tuple) else o)))
    norm_in = []
    hs.append(norm.register_forward_pre_hook(lambda m, a: norm_in.append(a[0])))
    with torch.no_grad():
        logits = model(x).logits
    for h in hs:
        h.remove()
    xin = norm_in[0][:, position].double()
    U = (W_U[answer] - W_U[vs]).double()
    rows = []
    for r in seen:
        r = r.expand(norm_in[0].shape)[:, position].double()
        if family == "gpt2":
            r = r - r.mean(-1, keepdim=True)
            scale = ((xin - xin.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + norm.eps).rsqrt()
        else:
            scale = (xin.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).rsqrt()
        rows.append((r * scale * norm.weight.double()) @ U.t())
    const = (norm.bias.double() @ U.t()).expand(rows[0].shape) if family == "gpt2" else torch.zeros_like(rows[0])
    native = (logits[:, position, answer] - logits[:, position, vs]).double()
    return torch.stack(rows), const, native


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_layer_rows_equal_the_hand_computation_and_the_identity_holds(family):
    model, x = BUILDERS[family](2), ids(6, batch=2)
    trace = tl.trace(model, x)
    res = mi.direct_logit_contributions(trace, answer=ANSWER, vs=VS)
    rows, const, native = _hand_layer_rows(family, model, x, ANSWER, VS)
    assert res.values.shape == rows.shape
    assert torch.allclose(res.values, rows, atol=1e-6, rtol=1e-6)
    assert torch.allclose(res.constant, const, atol=1e-6)
    assert torch.allclose(res.native, native, atol=1e-6)
    r = res.identity_receipt
    assert r["budget_model"] == "per_element_cancellation_aware_v2" and r["verified"]
    assert 0 <= r["max_budget_fraction"] <= 1
    assert {"max_abs_residual", "tolerance", "budget_eps", "n_addends", "worst_element"} <= set(r)
    assert r["n_addends"] == len(res.names) + 2 and r["budget_eps"] == torch.finfo(torch.float32).eps
    assert torch.allclose(res.total(), native, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("grain", ["layer", "head"])
def test_identity_full_and_partial_stacks(family, grain):
    model, x = BUILDERS[family](2), ids(6, batch=2)
    trace = tl.trace(model, x)
    full = mi.direct_logit_contributions(trace, answer=ANSWER, vs=VS, grain=grain, position=None)
    assert full.identity_receipt["max_budget_fraction"] <= 1
    if grain == "head":
        n_heads = 4
        heads = [n for n in full.names if re.search(r"\.h\d+$", n)]
        assert len(heads) == 2 * n_heads
    keep = full.names[1:3]
    part = mi.direct_logit_contributions(trace, answer=ANSWER, vs=VS, grain=grain, position=None, rows=keep)
    assert part.names == keep + ["other_components"]
    assert part.identity_receipt["max_budget_fraction"] <= 1
    for name in keep:
        assert torch.equal(part[name], full[name])
    rest = [i for i, n in enumerate(full.names) if n not in keep]
    assert torch.allclose(part["other_components"], full.values[rest].sum(0), atol=1e-9)


def test_head_rows_sum_to_the_layer_row():
    model, x = BUILDERS["gpt2"](2), ids(6, batch=2)
    trace = tl.trace(model, x)
    layer = mi.direct_logit_contributions(trace, answer=ANSWER, vs=VS)
    head = mi.direct_logit_contributions(trace, answer=ANSWER, vs=VS, grain="head")
    a = "transformer.h.1.attn"
    parts = [head[f"{a}.h{h}"] for h in range(4)] + [head[f"{a}.output_bias"]]
    assert torch.allclose(sum(parts), layer[a], atol=1e-6)


def test_wrong_norm_scale_trips_the_identity(monkeypatch):
    model, x = BUILDERS["gpt2"](2), ids(6)
    trace = tl.trace(model, x)
    snap = snapshot(trace)
    real = dla_module._norm_scale
    monkeypatch.setattr(dla_module, "_norm_scale", lambda x, kind, eps: real(x, kind, eps) * 1.001)
    with pytest.raises(MechInterpError) as exc:
        mi.direct_logit_contributions(trace, answer=ANSWER, vs=VS)
    assert exc.value.code == "mi_dla_identity_failed"
    worst = exc.value.fields["worst_element"]
    assert worst["answer"] in ANSWER and worst["residual"] > worst["budget"]
    assert exc.value.fields["max_budget_fraction"] > 1
    assert_unchanged(trace, snap)


@pytest.mark.parametrize("kwargs, code", [
    ({"answer": 64}, "mi_dla_token_invalid"),
    ({"answer": [1, -1]}, "mi_dla_token_invalid"),
    ({"answer": "cat"}, "mi_dla_token_invalid"),
    ({"answer": [1, 2], "vs": [1, 2, 3]}, "mi_dla_token_invalid"),
    ({"answer": 1, "grain": "neuron"}, "mi_dla_grain_invalid"),
    ({"answer": 1, "position": 6}, "mi_position_invalid"),
    ({"answer": 1, "rows": ["nope"]}, "mi_dla_rows_invalid"),
])
def test_bad_arguments_refuse_and_leave_the_trace_unchanged(kwargs, code):
    trace = tl.trace(BUILDERS["gpt2"](1), ids(6))
    snap = snapshot(trace)
    with pytest.raises(MechInterpError) as exc:
        mi.direct_logit_contributions(trace, **kwargs)
    assert exc.value.code == code and exc.value.remedy
    assert_unchanged(trace, snap)


def test_one_plus_weight_rms_norm_reads_its_offset_from_the_graph():
    model, x = EXTRA_BUILDERS["gemma"](2), ids(6)
    trace = tl.trace(model, x)
    res = mi.direct_logit_contributions(trace, answer=ANSWER, vs=VS)
    assert res.identity_receipt["norm"]["gamma_offset"] == 1.0 and res.identity_receipt["verified"]
    norm_in = []
    hook = model.model.norm.register_forward_pre_hook(lambda m, a: norm_in.append(a[0]))
    with torch.no_grad():
        logits = model(x).logits[0, -1]
    hook.remove()
    xin = norm_in[0][0, -1].double()
    scale = (xin.pow(2).mean() + model.model.norm.eps).rsqrt()
    U = (model.lm_head.weight[ANSWER] - model.lm_head.weight[VS]).double()
    mlp_row = trace.modules["model.layers.1.mlp"].out[0, -1].double()
    hand = (mlp_row * scale * (1 + model.model.norm.weight.double())) @ U.t()
    assert torch.allclose(res["model.layers.1.mlp"][0], hand, atol=1e-6)
    assert torch.allclose(res.total()[0].float(), logits[ANSWER] - logits[VS], atol=1e-5)


def test_per_row_answers_match_the_shared_table_row_by_row():
    model, x = BUILDERS["llama"](2), ids(6, batch=2)
    trace = tl.trace(model, x)
    per_row = mi.direct_logit_contributions(trace, answer=[[3], [5]], vs=[[7], [11]], grain="head")
    shared = mi.direct_logit_contributions(trace, answer=[3, 5], vs=[7, 11], grain="head")
    assert per_row.answer == ((3,), (5,)) and per_row.values.shape == (len(shared.names), 2, 1)
    assert torch.allclose(per_row.values[:, 0, 0], shared.values[:, 0, 0], atol=1e-12)
    assert torch.allclose(per_row.values[:, 1, 0], shared.values[:, 1, 1], atol=1e-12)
    with torch.no_grad():
        logits = model(x).logits[:, -1]
    assert torch.allclose(per_row.native[:, 0].float(), torch.stack([logits[0, 3] - logits[0, 7],
                                                                     logits[1, 5] - logits[1, 11]]), atol=1e-6)
    snap = snapshot(trace)
    with pytest.raises(MechInterpError) as exc:  # three rows for a batch of two
        mi.direct_logit_contributions(trace, answer=[[3], [5], [6]])
    assert exc.value.code == "mi_dla_token_invalid"
    assert_unchanged(trace, snap)


def test_bfloat16_model_discloses_the_degrade_and_budgets_at_its_epsilon():
    model, x = BUILDERS["llama"](2).to(torch.bfloat16), ids(6)
    trace = tl.trace(model, x)
    stack = mi.residual_decomposition(trace)
    assert stack.receipt["dtype"] == "torch.bfloat16" and stack.receipt["degrade"]
    res = mi.direct_logit_contributions(trace, answer=ANSWER, vs=VS)
    r = res.identity_receipt
    assert r["budget_eps"] == torch.finfo(torch.bfloat16).eps and r["max_budget_fraction"] <= 1
    with torch.no_grad():
        logits = model(x).logits[0, -1].double()
    assert torch.allclose(res.native[0], logits[ANSWER] - logits[VS])


def test_a_stack_from_another_trace_refuses():
    model = BUILDERS["gpt2"](2)
    trace, other = tl.trace(model, ids(6, seed=1)), tl.trace(model, ids(6, seed=2))
    own = mi.residual_decomposition(trace)
    assert mi.direct_logit_contributions(trace, answer=3, stack=own).identity_receipt["verified"]
    snap = snapshot(trace)
    with pytest.raises(MechInterpError) as exc:
        mi.direct_logit_contributions(trace, answer=3, stack=mi.residual_decomposition(other))
    assert exc.value.code == "mi_stack_mismatch"
    assert_unchanged(trace, snap)
