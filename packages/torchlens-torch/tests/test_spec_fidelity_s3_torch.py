"""Helper S3 (issue 13 / 26): autograd-saved bytes, lazy identity facts, cached quick hash."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import torchlens as tl

GRADS = tl.CaptureOptions(backward_ready=True)


class Net(nn.Module):
    """linear -> tanh (saves its output) -> mul by a view of a buffer-free constant -> sum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return self.fc2(h * h)


def _eager_saved(model, x):
    """Independent count: a hand-written saved_tensors_hooks run over Net's forward written
    out op by op; each op's packs grouped, each storage once within the op. Returns
    (sum over ops, bytes over every op each storage once excluding Parameters' storages,
    per-op bytes)."""
    pstor = {p.untyped_storage().data_ptr() for p in model.parameters()}
    groups: list[dict] = []

    def pack(t):
        groups[-1].setdefault(t.untyped_storage().data_ptr(), t.numel() * t.element_size())
        return t

    def step(fn, *a):
        groups.append({})
        return fn(*a)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = step(torch.nn.functional.linear, x, model.fc.weight, model.fc.bias)
        h = step(torch.tanh, h)
        h2 = step(torch.mul, h, h)
        step(torch.nn.functional.linear, h2, model.fc2.weight, model.fc2.bias)
    per_op = [sum(g.values()) for g in groups]
    union = {}
    for g in groups:
        for key, n in g.items():
            if key not in pstor:
                union.setdefault(key, n)
    return sum(per_op), sum(union.values()), per_op


def test_autograd_memory_matches_a_hand_written_saved_tensor_count():
    m, x = Net(), torch.randn(5, 4, requires_grad=False)
    total, nonparam, per_op = _eager_saved(m, x)
    assert total > 0 and nonparam > 0
    t = tl.trace(m, x, capture=GRADS)
    assert t.cost.total_autograd_memory == total
    # every payload is attached (reference mode) and the output op is saved: every op is pinned
    assert t.cost.pinned_autograd_memory == nonparam
    assert [op.meta["autograd_memory"] for op in t.ops if op.kind == "op"] == per_op
    # h * h saves h twice: one storage, counted once within the op (one tensor)
    assert t.ops["mul_1_3"].meta["autograd_memory"] == 5 * 6 * 4 and t.ops["mul_1_3"].meta["num_autograd_tensors"] == 1


def test_autograd_memory_is_zero_without_grad_and_unknown_when_not_recorded():
    m, x = Net(), torch.randn(5, 4)
    with torch.no_grad():
        t = tl.trace(m, x)
    assert t.cost.total_autograd_memory == 0 and t.cost.pinned_autograd_memory == 0
    plain = tl.trace(m, x)  # grad on but gradients not recorded: not counted (no hook cost)
    assert plain.cost.total_autograd_memory is None and plain.cost.pinned_autograd_memory is None
    assert "total_autograd_memory" in plain.cost.unavailable and "pinned_autograd_memory" in plain.cost.unavailable


def test_detached_payloads_pin_nothing_and_a_copy_does_not_claim_pins():
    m, x = Net(), torch.randn(5, 4)
    t = tl.trace(m, x, capture=tl.CaptureOptions(backward_ready=True, detach_saved_activations=True))
    assert t.cost.pinned_autograd_memory == 0 and t.cost.total_autograd_memory > 0
    t2 = tl.trace(m, x, capture=GRADS)
    copy = pickle.loads(pickle.dumps(t2))
    assert copy.cost.pinned_autograd_memory is None and "pinned_autograd_memory" in copy.cost.unavailable
    assert copy.cost.total_autograd_memory == t2.cost.total_autograd_memory  # per-op bands travel


def test_fingerprint_is_lazy_and_settled_before_pickle():
    m, x = Net(), torch.randn(5, 4)
    t = tl.trace(m, x)
    assert "fingerprint" not in t.provenance.extra  # not computed by the capture
    copy = pickle.loads(pickle.dumps(t))  # pickling settles it, so the copy keeps it
    assert len(copy.provenance.extra["fingerprint"]) == 64
    assert copy.provenance.fingerprint == t.provenance.fingerprint == tl.trace(Net(), x * 2).provenance.fingerprint


def test_quick_hash_is_cached_per_parameter_and_sees_in_place_updates():
    import importlib

    B = importlib.import_module("torchlens_torch.backend")  # the module (the package may export a function of that name)

    m = Net()
    first = B._param_hash_quick(m)
    calls = []
    real = B.sample_positions
    B.sample_positions = lambda n, k: calls.append(n) or real(n, k)
    try:
        assert B._param_hash_quick(m) == first and calls == []  # unchanged model: no element read
        with torch.no_grad():
            m.fc.weight.mul_(0.5)  # an in-place update (an optimizer step) bumps the version
        changed = B._param_hash_quick(m)
        assert changed != first and calls == [m.fc.weight.numel()]  # only that parameter re-read
        twin = Net()
        twin.load_state_dict(m.state_dict())
        assert B._param_hash_quick(twin) == changed  # equal values: equal hash, cached or not
    finally:
        B.sample_positions = real


def test_a_saved_file_keeps_the_lazy_fingerprint_and_the_autograd_bands(tmp_path):
    m, x = Net(), torch.randn(5, 4)
    t = tl.trace(m, x, capture=GRADS)
    assert "fingerprint" not in t.provenance.extra
    t.save(tmp_path / "t.tl")  # before anything read the fingerprint
    loaded = tl.load(tmp_path / "t.tl")
    assert loaded.provenance.extra.get("fingerprint") == tl.trace(Net(), x).provenance.fingerprint
    assert loaded.cost.total_autograd_memory == t.cost.total_autograd_memory > 0
    assert loaded.cost.pinned_autograd_memory is None and t.cost.pinned_autograd_memory > 0


def test_sweep_loss_needs_a_gradient_site_and_scales_what_flows_back():
    """glossary l. 794: loss= on tl.sweep (as on Trace.do): a plan with no gradient site raises
    do_loss_without_gradient_site, before any capture runs."""
    m = Net()
    x = torch.randn(5, 4)
    calls = []
    m.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(tl.errors.InterventionError) as exc:
        tl.sweep(m, x, "tanh_1_2", [0.5], edit=tl.scale, loss=lambda t: t.output.sum())
    assert exc.value.code == "do_loss_without_gradient_site" and calls == []
    # the spec's form: a gradient site; scaling the gradient at fc's output (every path back to x) by s
    h = m.fc(x.detach())
    h.retain_grad()
    m.fc2(torch.tanh(h) * torch.tanh(h)).pow(2).sum().backward()
    plain = h.grad.clone()
    traces = tl.sweep(m, x, tl.grad("linear_1_1"), [0.5, 3.0], edit=tl.scale,
                      capture=tl.CaptureOptions(backward_ready=True, save_grads=True),
                      loss=lambda t: t.output.pow(2).sum())
    for s, t in zip((0.5, 3.0), traces):
        torch.testing.assert_close(t.ops["linear_1_1"].grad, s * plain)  # the edited gradient the op holds
