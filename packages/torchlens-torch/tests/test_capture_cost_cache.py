"""Issue 26 (session 6): a repeated capture of the same model object reuses its description
(`describe_model`'s per-root cache) only while the model is unchanged. After each change
(a replaced submodule, a dtype change through `.to`, a train/eval switch, a rebound buffer, a
parameter frozen, a tensor attribute added) the records must describe the model as it is
now: checked against the live model's own `named_parameters()` / `named_buffers()` /
`named_modules()` and against a capture of a fresh deep copy (described without the cache).
Also: batch norm in eval mode (which writes nothing) takes the lean per-op path and records
what the general path records, while training-mode batch norm still has its running
statistics put back."""

from __future__ import annotations

import copy
import gc

import torch
from torch import nn

import torchlens as tl
from torchlens_torch import describe as _describe


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn(self.conv(x)))
        h = h.mean(dim=(2, 3))
        if hasattr(self, "shift"):
            h = h + self.shift
        return self.fc(h)


def _view(trace) -> tuple:
    ops = [(op.label, op.func_name, op.shapes, op.dtypes, op.params, op.parents, op.module) for op in trace.ops]
    params = [(a, p.shape, p.dtype, p.trainable) for a, p in trace._params.items()]
    buffers = [(a, b.shape, b.dtype) for a, b in trace._buffers.items()]
    modules = [(a, m.class_name, m.training) for a, m in trace._modules.items()]
    return ops, params, buffers, modules


def _check_against_model(trace, model: nn.Module) -> None:
    """The records list what the live model holds now (independent of the capture)."""
    want_params = {a: (tuple(p.shape), str(p.dtype).rpartition(".")[2], p.requires_grad)
                   for a, p in model.named_parameters()}
    got_params = {a: (tuple(p.shape), p.dtype, p.trainable) for a, p in trace._params.items()}
    assert got_params == want_params
    want_buffers = {a: (tuple(b.shape), str(b.dtype).rpartition(".")[2]) for a, b in model.named_buffers()}
    got_buffers = {a: (tuple(b.shape), b.dtype) for a, b in trace._buffers.items() if a in want_buffers}
    assert got_buffers == want_buffers
    for addr, m in model.named_modules():
        rec = trace._modules.get(addr or "self")
        if rec is not None:
            assert rec.class_name == type(m).__name__ and rec.training == m.training, addr


def _capture_both(model: nn.Module, x: torch.Tensor):
    """A capture of `model` (its cached description, when valid) and of a deep copy (a new
    object: described afresh)."""
    cached = tl.trace(model, x)
    fresh = tl.trace(copy.deepcopy(model), x)
    return cached, fresh


def test_repeated_captures_follow_every_model_change() -> None:
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 3, 6, 6)
    first = tl.trace(model, x)
    assert id(model) in _describe._CACHE  # the second capture below reads the cached walk
    again = tl.trace(model, x)
    assert _view(again) == _view(first)
    _check_against_model(again, model)

    changes = [
        ("replace a submodule", lambda m: setattr(m, "fc", nn.Linear(4, 7))),
        ("train mode", lambda m: m.train()),
        ("eval mode", lambda m: m.eval()),
        ("dtype change through .to", lambda m: m.to(torch.float64)),
        ("freeze a parameter", lambda m: m.conv.weight.requires_grad_(False)),
        ("rebind a buffer", lambda m: setattr(m.bn, "running_mean", torch.ones(4, dtype=torch.float64))),
        ("add a tensor attribute", lambda m: setattr(m, "shift", torch.full((5 if m.fc.out_features == 5 else 4,), 0.5,
                                                                            dtype=torch.float64))),
        ("resize the attribute", lambda m: setattr(m, "shift", torch.zeros(1, dtype=torch.float64))),
    ]
    for what, change in changes:
        change(model)
        xin = x.to(next(model.parameters()).dtype)
        cached, fresh = _capture_both(model, xin)
        assert _view(cached) == _view(fresh), what
        _check_against_model(cached, model)
        out = model(xin)
        assert torch.equal(cached.output, out), what  # and the capture left the model as it was
    assert cached._params["fc.weight"].shape == (7, 4) and cached._params["fc.weight"].dtype == "float64"
    assert cached._params["conv.weight"].trainable is False
    held = [b for a, b in cached._buffers.items() if a == "shift"]
    assert len(held) == 1 and held[0].shape == (1,)


def test_a_list_attribute_is_walked_every_time() -> None:
    """A module holding a container (which can change in place) is cached, and its container is
    walked again at every capture (session 8: the fingerprint reads the tensors the
    description's walk finds in it): a tensor appended to it between captures is listed as a
    module-held buffer, and so is one set on a plain object the module holds."""

    class Config:
        def __init__(self) -> None:
            self.width = 4

    model = Net().eval()
    model.extra = []
    model.config = Config()
    x = torch.randn(1, 3, 4, 4)
    tl.trace(model, x)
    assert _describe._CACHE[id(model)].fingerprint is not None
    model.extra.append(torch.ones(2))
    trace = tl.trace(model, x)
    assert [a for a in trace._buffers if a.startswith("extra")] == ["extra.0"]
    trace = tl.trace(model, x)  # (the cached walk now)
    assert [a for a in trace._buffers if a.startswith("extra")] == ["extra.0"]
    model.extra[0] = torch.zeros(3)
    model.config.table = torch.ones(5)
    trace = tl.trace(model, x)
    assert [(a, b.shape) for a, b in trace._buffers.items() if a.startswith(("extra", "config"))] == [
        ("extra.0", (3,)), ("config[table]", (5,))]
    model.extra.clear()
    trace = tl.trace(model, x)
    assert [a for a in trace._buffers if a.startswith(("extra", "config"))] == ["config[table]"]


def test_cache_holds_no_strong_reference_to_the_model() -> None:
    model = Net().eval()
    tl.trace(model, torch.randn(1, 3, 4, 4))
    key = id(model)
    assert key in _describe._CACHE
    del model
    gc.collect()
    assert key not in _describe._CACHE


def test_eval_batchnorm_takes_the_lean_path_with_the_general_path_records() -> None:
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 3, 6, 6)
    lean = tl.trace(model, x)
    general = tl.trace(model, x, capture=tl.CaptureOptions(save_budget=10**9))  # every op on the general path
    assert _view(lean) == _view(general)
    for a, b in zip(lean.ops, general.ops):
        assert a.meta.keys() == b.meta.keys()
        for p, q in zip(a._outputs, b._outputs):
            assert (p is None and q is None) or torch.equal(p, q)
    bn = [op for op in lean.ops if op.func_name == "batch_norm"]
    assert len(bn) == 1 and [lean.ops[p].kind for p in bn[0].parents] == ["op", "buffer", "buffer"]
    # against an independent computation from the module's own tensors
    conv = model.conv(x)
    want = (conv - model.bn.running_mean[None, :, None, None]) / torch.sqrt(
        model.bn.running_var[None, :, None, None] + model.bn.eps)
    want = want * model.bn.weight[None, :, None, None] + model.bn.bias[None, :, None, None]
    assert torch.allclose(bn[0].out, want, atol=1e-6)


def test_training_batchnorm_updates_are_recorded_then_restored() -> None:
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(2, 3, 6, 6)
    before = {k: v.clone() for k, v in model.bn.state_dict().items()}
    trace = tl.trace(model, x)
    after = model.bn.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the capture put them back
    # the running statistics batch norm read are recorded as they were before its write
    sources = {op.path: op.out for op in trace.ops if op.kind == "buffer"}
    assert torch.equal(sources["bn.running_mean"], before["running_mean"])
    assert torch.equal(sources["bn.running_var"], before["running_var"])
    # the recorded output is the training-mode forward (batch statistics), computed independently
    ref = copy.deepcopy(model)
    assert torch.allclose(trace.output, ref(x), atol=1e-6)
    assert not torch.equal(ref.bn.running_mean, before["running_mean"])  # a plain forward does move them


def test_custom_attributes_follow_attribute_changes_between_captures() -> None:
    """`module.custom_attributes` of a repeated capture (served from the per-module record when
    the module holds the same values) reads the values the module holds at each capture."""
    model, x = Net().eval(), torch.randn(1, 3, 4, 4)
    model.fc.scale = 2
    for value in (2, 3, 3.5, "three", (1, 2), 3):
        model.fc.scale = value
        model.act.inplace = not model.act.inplace
        trace = tl.trace(model, x)
        for addr in ("fc", "act", "conv"):
            want = {k: v for k, v in vars(model.get_submodule(addr)).items()
                    if not k.startswith("_") and isinstance(v, (bool, int, float, str, tuple))}
            assert dict(trace._modules[addr].custom_attributes) == want, (addr, value)
    del model.fc.scale
    trace = tl.trace(model, x)
    assert "scale" not in trace._modules["fc"].custom_attributes


# session 7 (helper F): per-capture reuse through the cached description's scratch ----------

def _phq(trace) -> str:
    return trace.provenance.extra["param_hash_quick"]


def test_param_hash_reuse_follows_parameter_changes() -> None:
    """The parameter hash of a repeated capture (returned again while every parameter's version
    counter and data pointer are unchanged) equals the hash of a capture of a deep copy (a new
    object, hashed from its elements) after each kind of change."""
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(1, 3, 4, 4)
    first = _phq(tl.trace(model, x))
    assert _phq(tl.trace(model, x)) == first  # unchanged: the same hash
    assert _describe._CACHE[id(model)].scratch.get("param_hash_quick") is not None  # (the reuse path ran)
    with torch.no_grad():
        model.fc.weight.mul_(2)  # in place: bumps the version counter
    cached, fresh = _capture_both(model, x)
    assert _phq(cached) == _phq(fresh) != first
    second = _phq(cached)
    model.fc.bias.data = model.fc.bias.data + 1  # a new storage, same shape: no version bump
    cached, fresh = _capture_both(model, x)
    assert _phq(cached) == _phq(fresh) != second
    third = _phq(cached)
    model.fc.weight.requires_grad_(False)  # checked by the fingerprint: described afresh
    cached, fresh = _capture_both(model, x)
    assert _phq(cached) == _phq(fresh) != third


class Counter(nn.Module):
    """A buffer the forward writes in place, or (with `rebind`) rebinds to another shape."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.arange(3.0))
        self.rebind = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rebind:
            self.count.data = torch.zeros(5)
        else:
            self.count.add_(1)
        return x + self.count.sum()


def test_buffer_copies_reused_across_captures_still_restore() -> None:
    """A repeated capture copies the buffers into the previous capture's copies; every capture
    still puts the buffers back, also after a forward that rebinds a buffer's `.data` (whose
    restore makes the copy back the buffer: that copy must not be reused)."""
    model, x = Counter(), torch.randn(2)
    want = torch.arange(3.0)
    for _ in range(3):
        trace = tl.trace(model, x)
        assert torch.equal(model.count, want)
        assert torch.allclose(trace.output, x + (want + 1).sum())  # the forward's own write, recorded
    assert "buffer_copies" in _describe._CACHE[id(model)].scratch  # (the reuse path ran)
    model.rebind = True
    tl.trace(model, x)
    assert torch.equal(model.count, want) and model.count.shape == (3,)
    model.rebind = False
    for _ in range(2):
        trace = tl.trace(model, x)
        assert torch.equal(model.count, want)
        assert torch.allclose(trace.output, x + (want + 1).sum())


def test_training_batchnorm_restored_on_every_repeated_capture() -> None:
    """Training-mode batch norm writes its running statistics without a version bump: each of
    several captures (the later ones copying into reused buffer copies) puts them back."""
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(2, 3, 6, 6)
    for step in range(4):
        with torch.no_grad():  # the statistics move between captures (the copies must follow)
            model.bn.running_mean.add_(0.5)
        before = {k: v.clone() for k, v in model.bn.state_dict().items()}
        ref = copy.deepcopy(model)
        trace = tl.trace(model, x)
        assert all(torch.equal(before[k], v) for k, v in model.bn.state_dict().items()), step
        assert torch.allclose(trace.output, ref(x), atol=1e-6)


class NumpyDraw(nn.Module):
    """A forward that draws from NumPy's global stream (`how`: nothing, a uniform, a normal)."""

    def __init__(self) -> None:
        super().__init__()
        self.how = "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        if self.how == "uniform":
            x = x + float(np.random.rand())
        elif self.how == "normal":
            x = x + float(np.random.standard_normal())
        return x * 2


def test_numpy_stream_put_back_only_when_moved_yet_always_exact() -> None:
    """The capture compares NumPy's raw stream bytes to skip an unneeded `set_state`; the stream
    after each capture equals the stream before it, also when the forward consumed the legacy
    stream's cached normal (which leaves the raw bytes as they were)."""
    import numpy as np

    model, x = NumpyDraw(), torch.randn(3)
    for how in ("none", "uniform", "normal"):
        for cached_normal in (False, True):
            np.random.seed(7)
            if cached_normal:
                np.random.standard_normal()  # the next normal is served from the cache
            assert np.random.get_state()[3] == int(cached_normal)
            want = np.random.get_state()
            model.how = how
            tl.trace(model, x)
            got = np.random.get_state()
            assert got[0] == want[0] and np.array_equal(got[1], want[1]) and got[2:] == want[2:], (how, cached_normal)
