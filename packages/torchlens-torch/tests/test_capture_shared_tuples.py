"""The recorder shares the tuples that repeat from event to event (`interceptor._UNSAVED`, the
per-shape and per-dtype tuples of `_shape1` / `_dtype1`, keyed by value for the process). Each
op's shapes, dtypes and payloads must still be its own: compared here with shapes, dtypes and
values computed by hand, across captures of other shapes and dtypes in one process (the caches
live for the process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl


class Mixed(nn.Module):
    """tanh, add, a dtype change, a reduction and a reshape: outputs of four shapes and two dtypes."""

    def forward(self, x):
        a = torch.tanh(x)
        b = a + 1
        c = b.double()
        d = c.sum(dim=-1)
        return d.reshape(-1, 1)


def _expected(x: torch.Tensor) -> list[tuple[tuple, str, torch.Tensor]]:
    """(shape, dtype name, value) of each op's output, computed without the library."""
    a = torch.tanh(x)
    b = a + 1
    c = b.double()
    d = c.sum(dim=-1)
    e = d.reshape(-1, 1)
    return [(tuple(t.shape), str(t.dtype).removeprefix("torch."), t) for t in (a, b, c, d, e)]


def _ops(trace) -> list:
    return [op for op in trace.ops if op.kind == "op"]


@pytest.mark.parametrize("save", ["all", "none"])
def test_shapes_dtypes_and_payloads_are_each_ops_own(save):
    torch.manual_seed(0)
    model = Mixed()
    inputs = [torch.randn(3, 5), torch.randn(2, 7), torch.randn(3, 5, dtype=torch.float64), torch.randn(4, 1)]
    for x in inputs:  # several shapes and dtypes through the same process-wide caches
        trace = tl.trace(model, x, save=save)
        ops = _ops(trace)
        expected = _expected(x)
        assert [op.func_name for op in ops] == ["tanh", "add", "double", "sum", "reshape"]
        assert [op.shapes for op in ops] == [(shape,) for shape, _, _ in expected]
        assert [op.dtypes for op in ops] == [(dtype,) for _, dtype, _ in expected]
        assert all(type(op.shapes[0]) is tuple for op in ops)  # plain tuples, not torch.Size
        for op, (_, _, value) in zip(ops, expected):
            if save == "all":
                assert torch.equal(op.out, value)
            else:
                assert not op.saved and op._outputs == (None,)


OFFSET = torch.arange(3, dtype=torch.int32)  # read by the forward without an op: a constant source


class Sources(nn.Module):
    """An input, a float64 buffer, an int32 constant and the output: the events that are not ops
    take their shape and dtype tuples from the same shared caches."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((1, 3), 2.0, dtype=torch.float64))

    def forward(self, x):
        return (x * self.scale).float() + OFFSET


@pytest.mark.parametrize("save", ["all", "none"])
def test_inputs_sources_and_outputs_keep_their_own_shapes_and_dtypes(save):
    torch.manual_seed(0)
    x = torch.randn(2, 3)
    trace = tl.trace(Sources(), x, save=save)
    rows = {op.kind: op for op in trace.ops if op.kind != "op"}
    out = (x * torch.full((1, 3), 2.0, dtype=torch.float64)).float() + OFFSET
    expected = {"input": ((2, 3), "float32", x), "buffer": ((1, 3), "float64", torch.full((1, 3), 2.0, dtype=torch.float64)),
                "constant": ((3,), "int32", OFFSET), "output": ((2, 3), "float32", out)}
    assert sorted(rows) == sorted(expected)
    for kind, (shape, dtype, value) in expected.items():
        op = rows[kind]
        assert op.shapes == (shape,) and type(op.shapes[0]) is tuple, kind
        assert op.dtypes == (dtype,), kind
        if save == "all":
            assert torch.equal(op.out, value), kind
        else:
            assert not op.saved and op._outputs == (None,), kind
