"""Issue 27 on the torch backend: the two tl.trace mistakes a new user makes first."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, input_ids, attention_mask=None):
        h = self.fc(input_ids)
        return h if attention_mask is None else h * attention_mask


def test_model_inputs_given_as_trace_keywords_point_to_input_kwargs():
    torch.manual_seed(0)
    model, x, mask = Masked(), torch.randn(2, 4), torch.tensor([[1.0, 1.0, 0.0, 0.0]] * 2)
    with pytest.raises(tl.errors.BackendUnsupportedError) as info:
        tl.trace(model, input_ids=x, attention_mask=mask)
    err = info.value
    assert err.code == "trace_option_unsupported" and err.fields["model_input"] is True
    assert "Masked.forward()" in err.message
    assert "input_kwargs={'attention_mask': ..., 'input_ids': ...}" in err.remedy
    # Following the remedy traces the masked forward.
    trace = tl.trace(model, input_kwargs={"input_ids": x, "attention_mask": mask})
    assert torch.equal(trace.output, model(x, attention_mask=mask))


def test_an_nn_module_class_says_instantiate_it():
    with pytest.raises(tl.errors.InvalidArgumentError) as info:
        tl.trace(nn.Linear, torch.randn(2, 4))
    assert info.value.code == "model_type_unsupported" and "instantiate it" in str(info.value)
    assert info.value.fields["model_type"] == "torch.nn.modules.linear.Linear"
