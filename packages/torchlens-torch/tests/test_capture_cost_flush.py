"""Issue 26 (session 5): payloads kept by reference (copy-on-write) are copied before the
capture returns when a tensor that outlives the forward shares their storage: a module's
parameter or buffer (a view of it was an op's output) or a tensor the forward left on a
plain object a module holds. A write made after the capture must not reach the saved values.
Expected values are cloned independently, before the capture, from the live tensors."""

from __future__ import annotations

import torch
from torch import nn

import torchlens as tl


class Box:
    """A plain object a module holds (tracked by identity: not restored after the capture)."""

    def __init__(self) -> None:
        self.kept = None


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("state", torch.arange(3.0))
        self.box = Box()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wt = self.lin.weight.t()  # an op output that is a view of a parameter
        s = self.state.view(1, 3)  # an op output that is a view of a buffer
        h = torch.tanh(x @ wt + s)
        self.box.kept = h  # outlives the forward
        return h.sum()


def _payload(trace, func_name: str) -> torch.Tensor:
    ops = [op for op in trace.ops if op.kind == "op" and op.func_name == func_name]
    assert len(ops) == 1, [op.func_name for op in trace.ops]
    return ops[0].out


def test_payloads_sharing_module_state_are_copied_before_the_capture_returns() -> None:
    torch.manual_seed(0)
    m = Holder()
    x = torch.randn(2, 3)
    want_t = m.lin.weight.detach().t().clone()
    want_view = m.state.detach().view(1, 3).clone()
    want_tanh = torch.tanh(x @ m.lin.weight.detach().t() + m.state.view(1, 3))

    trace = tl.trace(m, x, save="all")
    assert m.box.kept is not None and torch.equal(m.box.kept.detach(), want_tanh.detach())
    with torch.no_grad():  # writes after the capture, to everything that outlived it
        m.lin.weight.add_(1.0)
        m.state.add_(5.0)
        m.box.kept.mul_(3.0)

    assert torch.equal(_payload(trace, "t").detach(), want_t)
    assert torch.equal(_payload(trace, "view").detach(), want_view)
    assert torch.allclose(_payload(trace, "tanh").detach(), want_tanh.detach())


def test_save_none_keeps_no_payload_and_leaves_state_alone() -> None:
    torch.manual_seed(0)
    m = Holder()
    x = torch.randn(2, 3)
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    trace = tl.trace(m, x, save="none")
    assert all(not op.saved for op in trace.ops if op.kind == "op")
    after = m.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
