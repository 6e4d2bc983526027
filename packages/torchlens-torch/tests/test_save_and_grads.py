"""save= selection, structure-only captures, save_mode, and gradients through trace.backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import InvalidArgumentError, PayloadUnavailableError


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(3, 4)


def test_save_all_keeps_every_payload():
    m, x = _mlp()
    t = tl.trace(m, x)
    assert all(o.saved for o in t.ops)
    assert torch.equal(t["0"].out, m[0](x))


def test_save_none_keeps_structure_only():
    m, x = _mlp()
    t = tl.trace(m, x, save="none")
    assert not any(o.saved for o in t.ops)
    relu = t[tl.func("relu")].first()
    assert relu.shape == (3, 8) and relu.dtype == "float32"
    with pytest.raises(PayloadUnavailableError) as info:
        relu.out
    assert info.value.code == "activation_not_saved"
    assert torch.equal(t.output, m(x))  # the model's output is still returned
    assert t.options.structure_only


def test_save_selector_and_list():
    m, x = _mlp()
    t = tl.trace(m, x, save=tl.func("relu"))
    saved = [o.label for o in t.ops if o.saved]
    assert saved == [t[tl.func("relu")].first().label]
    t2 = tl.trace(m, x, save=["2", "input_1"])
    assert {o.label for o in t2.ops if o.saved} == {"input_1", t2["2"].calls[0].output_labels[0]}
    with pytest.raises(PayloadUnavailableError):
        t2[tl.func("relu")].first().out


def test_bad_save_spec_is_refused_before_the_forward():
    m, x = _mlp()
    with pytest.raises(InvalidArgumentError) as info:
        tl.trace(m, x, save=3.5)
    assert info.value.code == "save_spec_invalid"


@pytest.mark.parametrize("mode", ["copy", "reference", "view"])
def test_save_modes(mode):
    m, x = _mlp()
    t = tl.trace(m, x, capture=tl.CaptureOptions(save_mode=mode))
    assert torch.equal(t[tl.func("relu")].first().out, torch.relu(m[0](x)))


def test_copy_mode_payloads_are_isolated_from_the_returned_output():
    class M(nn.Module):
        def forward(self, x):
            return x * 2

    t = tl.trace(M(), torch.ones(2))
    t.output.add_(100)
    assert torch.equal(t[tl.func("mul")].first().out, torch.full((2,), 2.0))
    assert torch.equal(t.output_ops[0].out, torch.full((2,), 2.0))


def test_detach_saved_activations():
    m, x = _mlp()
    attached = tl.trace(m, x)
    detached = tl.trace(m, x, capture=tl.CaptureOptions(detach_saved_activations=True))
    assert attached["0"].out.grad_fn is not None
    assert detached["0"].out.grad_fn is None


def test_inference_only_runs_without_a_graph():
    m, x = _mlp()
    t = tl.trace(m, x, capture=tl.CaptureOptions(inference_only=True))
    assert t.output.grad_fn is None and t.options.inference_only
    with torch.no_grad():
        implied = tl.trace(m, x)
    assert implied.options.inference_only


def test_backward_fills_grads_of_saved_ops():
    m, x = _mlp()
    x = x.requires_grad_()
    t = tl.trace(m, x, capture=tl.CaptureOptions(backward_ready=True, save_grads=True))
    loss = t.output.square().sum()
    t.backward(loss)
    relu = t[tl.func("relu")].first()
    h = m[0](x).relu()
    h.retain_grad()
    m.zero_grad()
    m[2](h).square().sum().backward()
    assert torch.allclose(relu.grad, h.grad)
    assert isinstance(relu.grads, tuple) and len(relu.grads) == 1
    assert t[tl.func("linear")].first().has_grad


def test_backward_grads_of_a_multi_output_op():
    lstm = nn.LSTM(3, 4, batch_first=True)
    t = tl.trace(lstm, torch.randn(1, 2, 3), capture=tl.CaptureOptions(backward_ready=True, save_grads=True))
    t.backward(t.output[0].sum())
    op = t[tl.func("lstm")].first()
    assert len(op.grads) == 3 and op.grads[0].shape == (1, 2, 4)


def test_backward_without_backward_ready_is_refused():
    m, x = _mlp()
    t = tl.trace(m, x)
    with pytest.raises(InvalidArgumentError) as info:
        t.backward(t.output.sum())
    assert info.value.code == "backward_not_requested"
    with pytest.raises(PayloadUnavailableError) as info:
        t[tl.func("relu")].first().grad
    assert info.value.code == "grad_not_saved"


def test_grad_selector():
    m, x = _mlp()
    t = tl.trace(m, x)
    relu = t[tl.func("relu")].first().label
    sel = tl.grad(relu)
    assert repr(sel) == f"tl.grad({relu!r})"
    assert t[sel].labels == (relu,)
    assert t[tl.grad(tl.func("linear"))].labels == t[tl.func("linear")].labels
    with pytest.raises(tl.errors.SelectorCompositionError) as info:
        tl.grad(tl.grad(relu))
    assert info.value.code == "grad_selector_nested"
    for bad in ([relu], {relu: 1}):
        with pytest.raises(tl.errors.SelectorCompositionError) as info:
            tl.grad(bad)
        assert info.value.code == "grad_selector_inner_invalid"
