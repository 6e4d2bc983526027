"""tl.validate on the torch backend: every zoo model validates, and a corrupted trace fails
with the right reason at the right op."""

import random
import time

import numpy as np
import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens_torch import zoo


def test_every_zoo_model_validates_within_a_minute():
    start = time.perf_counter()
    failures = {}
    for name in zoo.names(available_only=True):
        model, args, kwargs = zoo.build(name)
        seen = []
        ok = tl.validate(model, *args, input_kwargs=kwargs, trace_observer=lambda t: seen.append(t.validation_replay_status))
        if not ok:
            s = seen[0]
            failures[name] = (s.first_failure, s.reason, s.detail)
        assert len(seen) == 1
    assert failures == {}
    assert time.perf_counter() - start < 60


class Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.a(x) - self.b(x))


def _trace():
    torch.manual_seed(0)
    return tl.trace(Sub(), torch.randn(3, 4))


def test_pristine_trace_validates():
    t = _trace()
    assert t.validate_forward_pass() is True
    decisions = {d["op"]: d for d in t.validation_replay_status.decisions}
    assert decisions["sub_1_3"]["perturbed"] == ["linear_1_1", "linear_2_2"]


def test_changed_payload_fails_at_that_op():
    t = _trace()
    op = t.ops["sub_1_3"]
    op._outputs = (op.out + 1,)
    assert t.validate_forward_pass() is False
    s = t.validation_replay_status
    assert (s.first_failure, s.reason) == ("sub_1_3", "replay_mismatch")


def test_swapped_parents_fail_with_replay_mismatch():
    t = _trace()
    op = t.ops["sub_1_3"]
    op.parent_slots = (op.parent_slots[1], op.parent_slots[0])
    assert t.validate_forward_pass() is False
    assert (t.validation_replay_status.first_failure, t.validation_replay_status.reason) == ("sub_1_3", "replay_mismatch")


def test_removed_edge_fails_with_arg_logging_mismatch():
    t = _trace()
    op = t.ops["sub_1_3"]
    op.parent_slots = op.parent_slots[:1]
    assert t.validate_forward_pass() is False
    s = t.validation_replay_status
    assert (s.first_failure, s.reason) == ("sub_1_3", "arg_logging_mismatch")
    assert s.reason in tl.backends.VALIDATION_REASONS


def test_dropped_dependence_fails_perturbation():
    """An op whose recorded callable ignores a recorded parent is caught by perturbation."""
    t = _trace()
    op = t.ops["sub_1_3"]
    real = op.func
    op.func = lambda a, b: real(a, b.detach() * 0 + t.ops["linear_2_2"].out)
    assert t.validate_forward_pass() is False
    assert (t.validation_replay_status.first_failure, t.validation_replay_status.reason) == ("sub_1_3", "perturbation_insensitive")


def test_validate_restores_rng_and_threads():
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(), torch.get_num_threads())
    model, args, kwargs = zoo.build("random_draw")
    assert tl.validate(model, *args, input_kwargs=kwargs, num_threads=1)
    after = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(), torch.get_num_threads())
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and np.array_equal(before[2], after[2])
    assert before[3] == after[3]


def test_validate_bad_scope_is_typed():
    with pytest.raises(tl.errors.InvalidArgumentError):
        tl.validate(Sub(), torch.randn(3, 4), scope="everything")


def test_count_by_kind_normalises_dunder_names():
    class M(nn.Module):
        def forward(self, x):
            return (x + 1) * (x == 0)

    t = tl.trace(M(), torch.randn(3))
    assert t.ops.count_by("kind") == {"input": 1, "add": 1, "eq": 1, "mul": 1, "output": 1}


class _Writer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.hist = []
        self.scale = 1.0
        self.gone = 5

    def forward(self, x):
        y = self.fc(x)
        self.last = y
        self.hist.append(len(self.hist))
        self.scale = 2.0
        del self.gone
        return y


def test_attribute_writes_are_recorded_and_undone():
    m = _Writer()
    t = tl.trace(m, torch.randn(2, 3))
    w = t.modules["self"].attribute_writes
    assert {k: v.kind for k, v in w.items()} == {"last": "added", "hist": "replaced", "scale": "replaced", "gone": "removed"}
    assert torch.equal(w["last"].value, t["linear_1_1"].out) and w["hist"].value == [0] and w["scale"].value == 2.0
    assert t.modules["fc"].attribute_writes == {}
    assert m.hist == [] and m.scale == 1.0 and m.gone == 5 and not hasattr(m, "last")  # pure observer


def test_attribute_writes_under_carry_state():
    m = _Writer()
    t = tl.trace(m, torch.randn(2, 3), capture=tl.CaptureOptions(carry_state=True))
    assert {k: v.kind for k, v in t.modules["self"].attribute_writes.items()} == {
        "last": "added", "hist": "replaced", "scale": "replaced", "gone": "removed"}
    assert m.hist == [0] and m.scale == 2.0 and not hasattr(m, "gone")  # advanced like model(x)


def test_save_budget_refuses_an_oversized_capture():
    m = Sub()
    x = torch.randn(3, 4)
    with pytest.raises(tl.errors.SaveBudgetExceededError) as info:
        tl.trace(m, x, capture=tl.CaptureOptions(save_budget=64))
    assert info.value.code == "save_budget_exceeded" and info.value.fields["kept_bytes"] > 64
    assert len(tl.trace(m, x, save="none", capture=tl.CaptureOptions(save_budget=0)).ops) > 0
    with pytest.raises(tl.errors.SaveBudgetExceededError):
        tl.validate(m, x, save_budget=64)
    assert tl.validate(m, x, save_budget=10**6)
    with pytest.raises(tl.errors.InvalidArgumentError):
        tl.CaptureOptions(save_budget=-1)


def test_keyword_inputs_of_a_module_call_are_its_inputs():
    class Inner(nn.Module):
        def forward(self, x, *, mask=None):
            return x * mask

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            m = x > 0
            return self.inner(x + 1, mask=m)

    t = tl.trace(Outer(), torch.randn(3))
    assert t["inner:1"].input_labels == ["add_1_2", "gt_1_1"]
