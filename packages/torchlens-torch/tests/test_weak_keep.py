"""save="none" keeps no recorded output alive (`torchlens_torch.weak_keep`), and the records
are still the ones a capture that keeps every output (save="all") makes, even where a freed
intermediate's id is reused by a tensor the capture never saw being made."""

from __future__ import annotations

import weakref

import torch
from torch import nn

import torchlens as tl


class Chain(nn.Module):
    """Intermediates that die as the forward goes on. At the end of the forward it reports
    which are still alive through `report` (a function: a capture puts module attributes
    back as they were, so the answer cannot be left on the module)."""

    def __init__(self, steps: int = 6, report=None) -> None:
        super().__init__()
        self.steps = steps
        self.report = report

    def forward(self, x):
        refs = []
        for _ in range(self.steps):
            y = torch.tanh(x)
            refs.append(weakref.ref(y))
            x = y * 2
        if self.report is not None:
            self.report([r() is not None for r in refs])
        return x


class Untracked(nn.Module):
    """Each step frees an intermediate, then makes a tensor the capture does not see being
    made (under `DisableTorchFunction`): CPython's allocator tends to hand it the freed
    intermediate's address, hence its id. The capture must record it as a constant the next
    op reads, not as the freed op's output."""

    def forward(self, x):
        for _ in range(8):
            y = torch.sin(x)  # recorded, then freed below
            x = y.cos()
            del y
            with torch._C.DisableTorchFunction():
                z = torch.full((4,), 0.5)  # not recorded as an op
            x = x + z
        return x


def _graph(trace):
    return [(op.label, op.kind, tuple(op.parents)) for op in trace.ops]


def test_save_none_frees_intermediates_during_the_forward():
    seen: list = []
    m = Chain(report=seen.append)
    x = torch.randn(4)
    with torch.no_grad():
        m(x)
        tl.trace(m, x, save="none")
        tl.trace(m, x, save="all", capture=tl.CaptureOptions(detach_saved_activations=False))
    plain, none, every = seen
    assert plain == [False] * 5 + [True]  # only the last `y` is still bound
    assert none == plain  # nothing else held them
    assert every == [True] * 6  # save="all" keeps them as its (copy-on-write) payloads


def test_reused_ids_are_not_mistaken_for_freed_outputs():
    m = Untracked()
    x = torch.randn(4)
    with torch.no_grad():
        none = tl.trace(m, x, save="none")
        every = tl.trace(m, x, save="all")
    assert _graph(none) == _graph(every)
    adds = [op for op in every.ops if op.func_name == "add"]
    assert len(adds) == 8
    for op in adds:  # each add reads the cos before it and a constant, never a sin
        kinds = sorted(every[p].func_name for p in op.parents)
        assert kinds == ["constant", "cos"], (op.label, kinds)
    # the hand computation agrees with the output the capture returned
    ref = x.clone()
    for _ in range(8):
        ref = torch.cos(torch.sin(ref)) + 0.5
    assert torch.equal(none.output, ref)


def test_grad_fn_records_of_freed_outputs_match_save_all():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    chain = Chain(4)
    model = nn.Sequential(m, chain)
    x = torch.randn(2, 4)
    none = tl.trace(model, x, save="none")
    every = tl.trace(model, x, save="all")
    none.provenance.settle_extra()  # (save="all" defers the walk to the first read)
    every.provenance.settle_extra()
    rows_none = none.provenance.extra["grad_fns"]["rows"]
    rows_all = every.provenance.extra["grad_fns"]["rows"]
    assert rows_none == rows_all
    linked = {lbl for row in rows_none for lbl in row[3]}
    # every recorded op on the way to the output has its grad_fn linked, freed ones included
    assert {op.label for op in every.ops if op.kind == "op"} <= linked
