"""retention_plan and the complete-missing-set rule."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
import torchlens_mechinterp as mi
from mi_models import BUILDERS, assert_unchanged, ids, snapshot
from torchlens.errors import MechInterpError


@pytest.mark.parametrize("call, function", [
    (lambda t: mi.residual_decomposition(t), "residual_decomposition"),
    (lambda t: mi.direct_logit_contributions(t, answer=3), "direct_logit_contributions"),
    (lambda t: mi.attention_head_contributions(t, "transformer.h.0.attn"), "attention_head_contributions"),
    (lambda t: mi.mlp_neuron_contributions(t, "transformer.h.0.mlp"), "mlp_neuron_contributions"),
])
def test_refusal_lists_the_complete_missing_set(call, function):
    model, x = BUILDERS["gpt2"](2), ids(6)
    bare = tl.trace(model, x, save="none")
    snap = snapshot(bare)
    with pytest.raises(MechInterpError) as exc:
        call(bare)
    assert exc.value.code == "mi_payloads_missing" and exc.value.fields["function"] == function
    assert_unchanged(bare, snap)
    kw = {"attention": "transformer.h.0.attn"} if function == "attention_head_contributions" else \
        {"mlp": "transformer.h.0.mlp"} if function == "mlp_neuron_contributions" else {}
    plan = mi.retention_plan(bare, function, **kw)
    # complete: every site the plan names is reported missing (a save="none" trace keeps none)
    assert set(exc.value.fields["missing"]) == set(plan.save)
    # and sufficient: a trace saving exactly those runs, and agrees with a save="all" trace
    kept = tl.trace(model, x, save=plan.save)
    full = tl.trace(model, x)
    a, b = call(kept), call(full)
    if function == "direct_logit_contributions":
        assert torch.equal(a.values, b.values) and a.names == b.names
    else:
        assert a.names == b.names and all(torch.equal(r.value, s.value) for r, s in zip(a, b))


def test_plan_is_priced_printable_and_composable():
    model, x = BUILDERS["llama"](2), ids(6, batch=2)
    bare = tl.trace(model, x, save="none")
    full = tl.trace(model, x)
    res = mi.retention_plan(bare, "residual_decomposition")
    heads = mi.retention_plan(bare, "direct_logit_contributions", grain="head")
    both = res | heads
    assert set(both.save) == set(res.save) | set(heads.save)
    for label, n in both.sites.items():  # priced from shapes and dtypes = the saved payloads' bytes
        v = full._ops[label].out
        assert n == v.numel() * v.element_size(), label
    assert both.total_bytes == sum(both.sites.values())
    text = str(both)
    assert f"{both.total_bytes:,} bytes" in text and all(label in text for label in both.save)
    assert set(both.functions) == {"residual_decomposition", "direct_logit_contributions"}
    head_run = mi.direct_logit_contributions(tl.trace(model, x, save=heads.save), answer=[1, 2], grain="head")
    assert head_run.identity_receipt["max_budget_fraction"] <= 1


def test_unknown_function_refuses():
    bare = tl.trace(BUILDERS["gpt2"](1), ids(5), save="none")
    snap = snapshot(bare)
    with pytest.raises(MechInterpError) as exc:
        mi.retention_plan(bare, "logit_lens")
    assert exc.value.code == "mi_retention_function_unknown"
    with pytest.raises(MechInterpError) as exc:  # the function's own arguments are required and checked
        mi.retention_plan(bare, "attention_head_contributions")
    assert exc.value.code == "mi_not_attention" and "transformer.h.0.attn" in exc.value.remedy
    assert_unchanged(bare, snap)


def test_default_plan_covers_residual_and_dla():
    model, x = BUILDERS["gpt2"](1), ids(5)
    bare = tl.trace(model, x, save="none")
    plan = mi.retention_plan(bare)
    res = mi.direct_logit_contributions(tl.trace(model, x, save=plan.save), answer=4, vs=9)
    assert res.identity_receipt["verified"]
