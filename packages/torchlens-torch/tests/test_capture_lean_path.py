"""Issue 26: the lean per-op path records exactly what the general path records, the cyclic
GC is paused only while capturing, and labels use PyPI torchlens's type token with the
underscored spelling accepted on lookup."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchlens as tl
from torchlens.errors import LookupMissError


class Mixed(nn.Module):
    """Parameters, buffers, a constant, kwargs, list arguments, a multi-output op, a
    no-op call returning its input, a property read and a loop over one site."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.ln = nn.LayerNorm(6)
        self.register_buffer("scale", torch.full((6,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc(x)) * self.scale
        h = h.float()  # no-op: returns its input
        a, b = torch.chunk(h, 2, dim=1)
        h = torch.cat([b, a], dim=1) + torch.ones(6)
        for _ in range(2):
            h = F.layer_norm(h, (6,), weight=self.ln.weight, bias=self.ln.bias)
        q = h[None]
        att = F.scaled_dot_product_attention(q, q, q)
        return 1 - att[0].T.T + F.max_pool1d(h[None], 2).sum()


def _record_view(trace):
    rows = []
    for op in trace.ops:
        meta = {k: v for k, v in op.meta.items() if k != "duration_s"}
        rows.append((op.label, op.func_name, op.kind, op.parent_slots, op.parents, op.params, op.shapes, op.dtypes,
                     op.module_calls, op.args_template, op.kwargs_template, op.is_inplace, op.multi_output,
                     sorted(meta.items(), key=lambda kv: kv[0])))
    return rows


def test_lean_path_records_what_the_general_path_records():
    torch.manual_seed(0)
    model, x = Mixed().eval(), torch.randn(4, 6)
    lean = tl.trace(model, x)
    # a save budget sends every op through the general `Recorder.record` (CaptureMode.lean is False)
    general = tl.trace(model, x, capture=tl.CaptureOptions(save_budget=10**9))
    assert _record_view(lean) == _record_view(general)
    for a, b in zip(lean.ops, general.ops):
        assert a.saved == b.saved
        for p, q in zip(a._outputs, b._outputs):
            assert (p is None and q is None) or torch.equal(p, q)
    # and both agree with the model's own forward at the output
    assert torch.equal(lean.output, model(x))


class Writes(nn.Module):
    """In-place writes of every kind the in-place fast path (`CaptureMode._write_lean`) takes or
    must leave to the general path: `inplace=True` functionals and modules, `+=`, a method
    `add_`, `inplace=False`, a write to a buffer, a write to a parameter, a write through a view."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.act = nn.ReLU(inplace=True)
        self.register_buffer("acc", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn(self.fc(x)))
        g = F.relu(h - 0.1, inplace=False)
        h += g
        h.add_(1.0)
        F.hardtanh(h, 0.0, 2.0, inplace=True)
        self.acc.add_(h.sum(0))
        with torch.no_grad():
            self.fc.bias.add_(0.5)
        h[:, :2].mul_(3.0)  # through a view: the general path, which also records the base's new version
        return h * self.acc


def test_in_place_fast_path_records_what_the_general_path_records():
    torch.manual_seed(0)
    model, x = Writes().eval(), torch.randn(4, 6)
    with torch.no_grad():
        bn_ref = model.bn(model.fc(x))  # the value the in-place ReLU overwrites, computed independently
    lean = tl.trace(model, x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    general = tl.trace(model, x, capture=tl.CaptureOptions(save_budget=10**9))
    assert _record_view(lean) == _record_view(general)
    for a, b in zip(lean.ops, general.ops):
        for p, q in zip(a._outputs, b._outputs):
            assert (p is None and q is None) or torch.equal(p, q)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # buffer and bias restored
    # the batch norm's payload is its value before the in-place ReLU wrote it (a forward hook's copy)
    bn_op = next(op for op in lean.ops if op.func_name == "batch_norm")
    assert torch.equal(bn_op.out, bn_ref) and (bn_ref < 0).any()
    writes = [op for op in lean.ops if op.is_inplace]
    assert [op.func_name for op in writes] == ["relu", "add_", "add_", "hardtanh", "add_", "add_", "mul_"]
    assert any(op.func_name == "as_strided_scatter" and op.meta.get("view_write") for op in lean.ops)
    assert any(op.meta.get("buffer_write") == ("acc",) for op in writes)
    assert torch.equal(lean.output, model(x))


def test_gc_paused_during_the_capture_only():
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(gc.isenabled())
            return x + 1

    assert gc.isenabled()
    tl.trace(Probe(), torch.randn(2))
    assert seen == [False] and gc.isenabled()

    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    with pytest.raises(Exception):
        tl.trace(Boom(), torch.randn(2))
    assert gc.isenabled()  # set back when the forward raises

    gc.disable()
    try:
        tl.trace(Probe(), torch.randn(2))
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()


def test_type_token_is_the_name_lowercased_without_underscores():
    torch.manual_seed(0)
    trace = tl.trace(Mixed().eval(), torch.randn(4, 6), save="none")
    for layer in trace.layers:
        if layer.kind == "op":
            token = layer.label.rsplit("_", 2)[0]
            assert token == layer.func_name.rsplit(".", 1)[-1].lower().replace("_", ""), layer.label
    types = {layer.label.rsplit("_", 2)[0] for layer in trace.layers}
    assert {"batchnorm", "layernorm", "scaleddotproductattention", "maxpool1d", "rsub", "t"} <= types
    assert not any("_" in t for t in types)


def test_underscored_spelling_is_an_alias_on_lookup():
    torch.manual_seed(0)
    trace = tl.trace(Mixed().eval(), torch.randn(4, 6))
    bn = next(layer.label for layer in trace.layers if layer.func_name == "batch_norm")
    ln = next(layer.label for layer in trace.layers if layer.func_name == "layer_norm")
    old_bn = bn.replace("batchnorm", "batch_norm")
    old_ln = ln.replace("layernorm", "layer_norm")
    assert trace.ops[old_bn] is trace.ops[bn]
    assert trace.layers[old_ln] is trace.layers[ln]
    assert trace.ops[f"{old_ln}:2"] is trace.ops[f"{ln}:2"]
    assert trace[tl.label(f"{old_ln}:all")].labels == trace[tl.label(f"{ln}:all")].labels
    assert old_bn not in trace.ops.labels  # listings give the canonical spelling only
    with pytest.raises(LookupMissError) as exc:
        trace.ops["batch_norm_9_99"]
    assert exc.value.code == "label_unknown" and "batch_norm_9_99" in str(exc.value)
