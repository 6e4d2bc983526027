"""save=<selection> captures copy the payloads the returned output shares only for the ops the
selection keeps (the others are never copied), and what they keep still holds the forward-time
values after the caller writes the returned tensors in place."""

from __future__ import annotations

import torch
from torch import nn

import torchlens as tl
import torchlens_torch.interceptor as interceptor


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return {"hidden": h, "logits": self.head(h)}


def _copies(monkeypatch) -> list:
    """Every payload copy-on-write made (Recorder._materialize calls, by op event)."""
    calls: list = []
    real = interceptor.Recorder._materialize

    def spy(self, ev, slot, t, version):
        calls.append(ev.id)
        return real(self, ev, slot, t, version)

    monkeypatch.setattr(interceptor.Recorder, "_materialize", spy)
    return calls


def test_selected_payloads_keep_forward_values_after_the_output_is_written(monkeypatch):
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 4)
    with torch.no_grad():
        want = net(x)  # an independent forward
    t = tl.trace(net, x, save=["head"])
    label = t.ops["head"].label
    out = t.output
    out["logits"].mul_(0).add_(7)  # the caller writes the returned tensors in place
    out["hidden"].zero_()
    assert torch.equal(t[label].out, want["logits"])  # the kept payload: forward-time values
    assert not t[t.ops["fc"].label].saved  # not selected: released


def test_unselected_payloads_the_output_shares_are_not_copied(monkeypatch):
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 4)
    calls = _copies(monkeypatch)
    t = tl.trace(net, x, save=["fc"])
    kept = {op.event_id for op in t._ops.values() if op.saved}
    assert kept and set(calls) <= kept  # the relu and head outputs the dict returns were not copied
    calls.clear()
    tl.trace(net, x, save="all")
    assert len(calls) >= 2  # save="all" copies both returned tensors' payloads


def test_a_selected_output_op_owns_its_payload():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 4)
    with torch.no_grad():
        want = net(x)
    t = tl.trace(net, x, save="all")
    outputs = [op.label for op in t._ops.values() if op.kind == "output"]
    t2 = tl.trace(net, x, save=outputs)
    kept = [op.label for op in t2._ops.values() if op.saved]
    assert sorted(kept) == sorted(outputs)
    t2.output["logits"].add_(100)  # the caller writes the returned tensors in place
    t2.output["hidden"].zero_()
    got = sorted((t2._ops[lbl].out for lbl in outputs), key=lambda v: v.shape[-1])
    assert torch.equal(got[0], want["logits"]) and torch.equal(got[1], want["hidden"])
