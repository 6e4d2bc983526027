"""Collection filters of spec/glossary.md l. 26-32, checked against what the model does."""

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.options import CaptureOptions

class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        bias = torch.zeros(3)            # made inside the forward: an internal source
        unused = torch.tanh(x) * 2       # computed, never read: an internal sink
        y = self.lin(x) + bias
        return torch.log(y - 100.0)      # log of a negative: NaN

def test_nonfinite_ops_lists_exactly_the_ops_that_held_nan():
    torch.manual_seed(0)
    model, x = Odd(), torch.randn(2, 3)
    t = tl.trace(model, x, capture=CaptureOptions(on_nonfinite="track"))
    expected = [op.label for op in t.ops if op.saved and op.kind == "op"
                and any(isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all()
                        for v in op.outs)]
    assert expected and [o.label for o in t.nonfinite_ops] == expected
    assert t.ops.nonfinite.labels == tuple(expected)
    assert t.saved_ops.nonfinite.labels == tuple(expected)
    assert all(o.func_name == "log" for o in t.nonfinite_ops)

def test_internal_source_and_sink_layers():
    torch.manual_seed(0)
    t = tl.trace(Odd(), torch.randn(2, 3))
    sources = t.layers.internal_source
    assert [t.layers[l].func_name for l in sources.labels] == ["zeros"]
    sinks = t.layers.internal_sink
    assert [t.layers[l].func_name for l in sinks.labels] == ["mul"]
    assert len(t.layers.compute.internal_sink) == 1  # the filter composes on any Layer collection

def test_saved_grad_layers_are_the_ones_holding_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    x = torch.randn(4, 3, requires_grad=True)
    t = tl.trace(model, x, capture=CaptureOptions(backward_ready=True, save_grads=True))
    assert len(t.layers.saved_grad) == 0
    t.backward(t.output.sum())
    with_grad = {op.layer_label for op in t.ops if op.grads is not None and any(g is not None for g in op.grads)}
    assert with_grad and set(t.layers.saved_grad.labels) == with_grad
