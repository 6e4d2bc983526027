"""Pure observer capture (state unchanged on success and on failure), carry_state, and
the typed errors for bad models, bad inputs, unavailable devices and reentrancy."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import BackendUnsupportedError, InvalidArgumentError, ReentrantTraceError, TraceCaptureError
from torchlens_torch.testing import assert_same_state, state_fingerprint


class Stateful(nn.Module):
    """Writes everything a forward can write: buffers, attributes, modes, RNG streams."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))
        self.history = [1, 2]
        self.held = torch.zeros(4)
        self.fail = fail

    def forward(self, x):
        self.steps += 1
        self.held.add_(1)
        self.history.append(3)
        self.new_attr = x.sum()
        self.label = "changed"
        self.fc.eval()
        y = self.bn(self.fc(x)) + torch.rand(4) + random.random() + float(np.random.rand())
        if self.fail:
            raise ValueError("boom")
        return y


def _model(fail=False):
    torch.manual_seed(0)
    m = Stateful(fail).train()
    m.label = "original"
    return m


@pytest.mark.parametrize("fail", [False, True])
def test_model_and_rng_state_is_unchanged_after_trace(fail):
    m = _model(fail)
    x = torch.randn(3, 4)
    before = state_fingerprint(m)
    if fail:
        with pytest.raises(TraceCaptureError) as info:
            tl.trace(m, x)
        assert info.value.code == "forward_failed"
        partial = info.value.partial_trace
        assert partial is not None and partial[tl.func("batch_norm")]
        with pytest.raises(tl.errors.PayloadUnavailableError):
            partial.output
    else:
        tl.trace(m, x)
    after = state_fingerprint(m)
    assert_same_state(before, after)
    assert m.history == [1, 2] and m.label == "original" and not hasattr(m, "new_attr")
    assert m.fc.training and torch.equal(m.held, torch.zeros(4))


def test_train_mode_batchnorm_statistics_do_not_move(build_zoo):
    model, args, kwargs = build_zoo("cnn")
    before = state_fingerprint(model)
    t = tl.trace(model, *args)
    assert_same_state(before, state_fingerprint(model))
    assert t.modules["bn"].training


def test_every_zoo_model_is_left_unchanged(zoo_case):
    model, args, kwargs = zoo_case
    before = state_fingerprint(model)
    tl.trace(model, *args, input_kwargs=kwargs, save="none")
    assert_same_state(before, state_fingerprint(model))


def test_carry_state_advances_like_a_plain_forward():
    a, b = _model(), _model()
    x = torch.randn(3, 4)
    rng = torch.get_rng_state()
    tl.trace(a, x, capture=tl.CaptureOptions(carry_state=True))
    assert torch.equal(torch.get_rng_state(), rng)  # random streams never advance
    b(x)
    assert torch.equal(a.bn.running_mean, b.bn.running_mean)
    assert a.steps.item() == 1 and a.history == [1, 2, 3] and a.label == "changed" and not a.fc.training


def test_buffer_payloads_keep_forward_time_values():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(2))

        def forward(self, x):
            self.count.add_(5)
            return x + self.count

    m = M()
    t = tl.trace(m, torch.ones(2))
    assert torch.equal(m.count, torch.zeros(2))
    assert torch.equal(t[tl.func("add_")].first().out, torch.full((2,), 5.0))
    assert torch.equal(t.ops["buffer_1"].out, torch.zeros(2))
    assert torch.equal(t.output, torch.full((2,), 6.0))


def test_a_non_module_is_refused():
    with pytest.raises(InvalidArgumentError) as info:
        tl.trace(lambda x: x * 2, torch.ones(2))
    assert info.value.code == "model_type_unsupported"
    with pytest.raises(InvalidArgumentError) as info:
        tl.trace(lambda x: x * 2, torch.ones(2), backend="torch")
    assert info.value.code == "model_type_unsupported"


def test_a_numpy_input_is_refused():
    with pytest.raises(InvalidArgumentError) as info:
        tl.trace(nn.Linear(2, 2), np.ones((1, 2), dtype=np.float32))
    assert info.value.code == "input_type_unsupported"


def test_a_cuda_op_on_a_cpu_machine_is_device_unavailable():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")

    class M(nn.Module):
        def forward(self, x):
            return x + torch.ones(2, device="cuda")

    m = M()
    with pytest.raises(InvalidArgumentError) as info:
        tl.trace(m, torch.ones(2))
    assert info.value.code == "device_unavailable"
    assert info.value.partial_trace is not None


def test_reentrant_trace_is_refused():
    class M(nn.Module):
        def forward(self, x):
            tl.trace(nn.Identity(), x)
            return x

    with pytest.raises(ReentrantTraceError) as info:
        tl.trace(M(), torch.ones(2))
    assert info.value.code == "reentrant_trace"
    assert info.value.partial_trace is not None


def test_unknown_trace_option_is_refused():
    from torchlens.backends.registry import get_protocol

    with pytest.raises(BackendUnsupportedError) as info:
        get_protocol("torch").capture(nn.Identity(), (torch.ones(1),), {}, bogus=1)
    assert info.value.code == "trace_option_unsupported"
    assert info.value.code in get_protocol("torch").refusal_codes()


def test_nonfinite_tracking_and_raise():
    class M(nn.Module):
        def forward(self, x):
            return torch.log(x) * 0

    x = torch.tensor([0.0, 1.0])
    t = tl.trace(M(), x, capture=tl.CaptureOptions(on_nonfinite="track"))
    assert t[tl.func("log")].first().meta["has_nonfinite"]
    with pytest.raises(TraceCaptureError) as info:
        tl.trace(M(), x, capture=tl.CaptureOptions(on_nonfinite="raise"))
    assert info.value.code == "nonfinite_value" and info.value.partial_trace is not None


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchscript_modules_are_refused_before_the_forward():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.jit.script(nn.Linear(2, 2))

        def forward(self, x):
            return self.inner(x)

    with pytest.raises(BackendUnsupportedError) as info:
        tl.trace(M(), torch.ones(1, 2))
    assert info.value.code == "torchscript_boundary"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_submodule_scripted_after_a_capture_is_refused_at_the_next():
    # the "no TorchScript module" answer is kept with the cached description: a module
    # replaced since must be seen (the description is walked afresh)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    x = torch.ones(1, 2)
    tl.trace(model, x)
    tl.trace(model, x)  # (the cached description)
    model[0] = torch.jit.script(nn.Linear(2, 2))
    with pytest.raises(BackendUnsupportedError) as info:
        tl.trace(model, x)
    assert info.value.code == "torchscript_boundary" and info.value.fields.get("modules") == ["0"]
