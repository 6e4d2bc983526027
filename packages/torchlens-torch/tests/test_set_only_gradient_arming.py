"""engine="set_only" gradient rules armed by trace.backward on a backward-ready capture (issue 13/14)."""

import warnings

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import InterventionError

SET_ONLY = tl.InterventionOptions(engine="set_only")
GRADS = tl.CaptureOptions(backward_ready=True, save_grads=True)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)), torch.randn(2, 5)


def _hand(model, x, edit):
    """torch.autograd with a tensor hook doing the same edit at the relu output."""
    h = model[0](x)
    h.retain_grad()
    r = model[1](h)
    r.retain_grad()
    r.register_hook(edit)
    out = model[2](r)
    out.sum().backward()
    return h.grad, r.grad


@pytest.mark.parametrize("save_mode", ["copy", "reference"])
def test_set_only_gradient_rule_is_applied_by_backward(save_mode):
    model, x = _mlp()
    t = tl.trace(model, x, capture=tl.CaptureOptions(backward_ready=True, save_grads=True, save_mode=save_mode))
    t.do(tl.grad("relu_1_2"), tl.scale(0.5), intervention=SET_ONLY)
    assert t.intervention_audit[-1]["armed_for"] == "trace_backward_pending"
    t.backward(t.output.sum())
    assert t.intervention_audit[-1]["armed_for"] == "trace_backward"
    h_grad, r_grad = _hand(model, x, lambda g: g * 0.5)
    torch.testing.assert_close(t.ops["linear_1_1"].grad, h_grad)  # upstream of the edit: edited flow
    torch.testing.assert_close(t.ops["relu_1_2"].grad, r_grad)  # the site holds the edited gradient (retain_grad sees it)
    clean_h, _ = _hand(model, x, lambda g: g)
    assert not torch.allclose(t.ops["linear_1_1"].grad, clean_h)  # the edit did change something


def test_zero_ablated_gradient_and_clear_edits_disarms():
    model, x = _mlp()
    t = tl.trace(model, x, capture=GRADS)
    t.do(tl.grad("relu_1_2"), tl.zero_ablate(), intervention=SET_ONLY)
    t.backward(t.output.sum())
    assert torch.equal(t.ops["linear_1_1"].grad, torch.zeros(2, 4))
    # a second capture, rule cleared after arming: the hook passes the gradient through
    t2 = tl.trace(model, x, capture=GRADS)
    t2.do(tl.grad("relu_1_2"), tl.zero_ablate(), intervention=SET_ONLY)
    out = t2.output.sum()
    t2.backward(out, retain_graph=True)
    t2.clear_edits()
    t2.backward(out)
    # second backward: unedited gradient added on top of the first (zero) one would be the clean value;
    # op.grads holds the last pass's gradient
    clean_h, _ = _hand(model, x, lambda g: g)
    torch.testing.assert_close(t2.ops["linear_1_1"].grad, clean_h)


def test_refuses_without_a_live_graph():
    model, x = _mlp()
    t = tl.trace(model, x, capture=tl.CaptureOptions(backward_ready=True, save_grads=True,
                                                      detach_saved_activations=True))
    t.do(tl.grad("relu_1_2"), tl.zero_ablate(), intervention=SET_ONLY)
    with pytest.raises(InterventionError) as info:
        t.backward(t.output.sum())
    assert info.value.code == "backward_armed_edit_unapplied"
    assert t.ops["linear_1_1"].grads is None  # nothing ran
    plain = tl.trace(model, x)
    plain.do(tl.grad("relu_1_2"), tl.zero_ablate(), intervention=SET_ONLY)
    assert plain.intervention_audit[-1]["armed_for"] == "next_rerun"
