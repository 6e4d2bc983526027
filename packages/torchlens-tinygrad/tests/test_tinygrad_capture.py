"""Capture of tinygrad models and functions: restore, records against independent numpy
evaluations, module paths, validation, persistence, randomness, edits, gradients, refusals."""

from __future__ import annotations

import inspect
import math
import subprocess
import sys

import numpy as np
import pytest

tinygrad = pytest.importorskip("tinygrad")

from tinygrad import Tensor, nn  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.errors import BackendUnsupportedError, InvalidArgumentError, TraceCaptureError  # noqa: E402
from torchlens_tinygrad import patch  # noqa: E402
from torchlens_tinygrad import zoo as Z  # noqa: E402

X = Tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)).realize()


def _proto():
    return tl.backends.get_protocol("tinygrad")


def _framework_objects() -> dict:
    """Every object a capture may replace, read from the framework itself."""
    from tinygrad.engine.jit import _TinyJit

    objs = {("Tensor.__dict__", k): v for k, v in vars(Tensor).items()}
    for cls in (nn.Linear, nn.Conv2d, nn.BatchNorm, nn.LayerNorm, Z.MLP, Z.Attention, _TinyJit):
        objs[(cls.__name__, "__call__")] = cls.__dict__.get("__call__")
    return objs


def test_capture_restores_every_wrapped_object_on_exit_and_on_error():
    before = _framework_objects()
    tl.trace(Z.MLP(), X, backend="tinygrad")
    after = _framework_objects()
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)

    class Boom:
        def __init__(self):
            self.fc = nn.Linear(4, 4)

        def __call__(self, x):
            h = self.fc(x) * 2
            assert "relu" in vars(Tensor) and vars(Tensor)["relu"] is not before.get(("Tensor.__dict__", "relu"))
            raise RuntimeError("boom")

    with pytest.raises(TraceCaptureError) as info:
        tl.trace(Boom(), X, backend="tinygrad")
    assert info.value.code == "forward_failed"
    assert [o.func_name for o in info.value.partial_trace.ops if o.kind == "op"] == ["transpose", "linear", "mul"]
    after = _framework_objects()
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert patch.ACTIVE.recorder is None and patch.ACTIVE.depth == 0


# independent numpy evaluation of every recorded op ---------------------------------------

def _softmax(a, axis=-1):
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _conv2d(x, w, b, groups=1, stride=1, dilation=1, padding=0, dtype=None):
    assert groups == 1 and stride == 1 and dilation == 1
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    n, _c, h, wd = x.shape
    k = w.shape[-1]
    out = np.zeros((n, w.shape[0], h + 2 * padding - k + 1, wd + 2 * padding - k + 1), np.float64)
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            out[:, :, i, j] = np.einsum("ncij,ocij->no", xp[:, :, i:i + k, j:j + k], w)
    return out + b.reshape(1, -1, 1, 1)


def _batchnorm(x, weight, bias, mean, invstd, axis=1):
    shape = [1] * x.ndim
    shape[axis] = -1
    return (x - mean.reshape(shape)) * weight.reshape(shape) * invstd.reshape(shape) + bias.reshape(shape)


def _layernorm(x, axis=-1, eps=1e-5):
    mu = x.mean(axis=axis, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(axis=axis, keepdims=True) + eps)


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False):
    assert attn_mask is None and not is_causal
    return _softmax(q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])) @ v


def _shape(*s):
    return s[0] if len(s) == 1 and isinstance(s[0], (tuple, list)) else s


#: numpy re-implementations, by the wrapped Tensor member, with the member's own signature
NUMPY = {
    "transpose": lambda self, dim0=1, dim1=0: np.swapaxes(self, dim0, dim1),
    "linear": lambda self, weight, bias=None, dtype=None: self @ weight + (0 if bias is None else bias),
    "relu": lambda self: np.maximum(self, 0),
    "tanh": lambda self: np.tanh(self),
    "rsqrt": lambda self: 1 / np.sqrt(self),
    "add": lambda self, x, reverse=False: self + x,
    "__add__": lambda self, x: self + x,
    "__mul__": lambda self, x: self * x,
    "mul": lambda self, x, reverse=False: self * x,
    "__lt__": lambda self, x: self < x,
    "reshape": lambda self, shape=None, *args: self.reshape(_shape(shape, *args)),
    "mean": lambda self, axis=None, keepdim=False: self.mean(axis=axis, keepdims=keepdim),
    "conv2d": _conv2d,
    "batchnorm": _batchnorm,
    "layernorm": _layernorm,
    "chunk": lambda self, chunks, dim=0: tuple(np.split(self, chunks, axis=dim)),
    "scaled_dot_product_attention": _sdpa,
}


def _numpy_eval(trace, op):
    """The op computed in numpy from its recorded inputs (parents' payloads, parameters)."""
    params = {p.address: p.value.numpy() for p in trace.params}
    parents = [trace.ops[p] for p in op.parents]
    vals = [par.outs[slot].numpy() if par.multi_output else par.out.numpy()
            for par, (_pid, slot) in zip(parents, op.parent_slots)]

    def fill(t):
        if isinstance(t, tl.backends.sdk.ArgRef):
            return params[t.address] if t.address is not None else vals[t.index]
        if isinstance(t, tuple):
            return tuple(fill(v) for v in t)
        if isinstance(t, list):
            return [fill(v) for v in t]
        if isinstance(t, dict):
            return {k: fill(v) for k, v in t.items()}
        return t

    args, kwargs = fill(op.args_template), fill(op.kwargs_template)
    member = op.meta["qualname"].rpartition(".")[2]
    sig = inspect.signature(patch.replay_table()[op.meta["qualname"]])
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return NUMPY[member](*bound.args, **bound.kwargs)


@pytest.mark.parametrize("name", ["mlp", "conv", "attention", "loop", "constant", "random"])
def test_every_op_equals_an_independent_numpy_evaluation(name):
    entry = Z.zoo()[name]
    if "reseed" in entry:
        entry["reseed"]()
    t = tl.trace(entry["model"], *entry["args"], backend="tinygrad")
    checked = 0
    for op in t.ops:
        if op.kind != "op":
            continue
        if op.func_name == "rand":  # a draw: the framework's own draw from the same seed, outside any capture
            entry["reseed"]()
            want = [Tensor.rand(*op.shapes[0]).numpy()]
        else:
            got = _numpy_eval(t, op)
            want = list(got) if op.multi_output else [got]
        have = [o.numpy() for o in op.outs]
        assert len(have) == len(want), op.label
        for h, w in zip(have, want):
            np.testing.assert_allclose(h, np.asarray(w, dtype=h.dtype), rtol=1e-5, atol=1e-6, err_msg=op.label)
        checked += 1
    assert checked == sum(o.kind == "op" for o in t.ops) >= 4
    if name != "random":  # a plain (fused) forward, at float32 tolerance (zoo.FUSED says why)
        np.testing.assert_allclose(t.output_ops[0].out.numpy(), entry["model"](*entry["args"]).numpy(),
                                   rtol=1e-6, atol=1e-6)
    assert _proto().validate(t).ok


def test_module_paths_follow_the_model_tree():
    e = Z.zoo()["attention"]
    t = tl.trace(e["model"], *e["args"], backend="tinygrad")
    mods = {o.label: o.module for o in t.ops if o.kind == "op"}
    assert mods["layernorm_1_1"] == "norm" and mods["linear_1_5"] == "qkv" and mods["linear_2_13"] == "out"
    assert mods["scaleddotproductattention_1_9"] == "self" and mods["add_2_14"] == "self"
    assert {m.address for m in t.modules} == {"self", "norm", "qkv", "out"}
    stack = tl.trace(Z.AttentionStack(depth=2), e["args"][0], backend="tinygrad")
    assert {m.address for m in stack.modules} >= {"blocks.0", "blocks.0.qkv", "blocks.1.out"}
    assert {p.address for p in stack.params} >= {"blocks.0.qkv.weight", "blocks.1.norm.bias"}
    loop = tl.trace(Z.LoopNet(), X, backend="tinygrad")
    assert [o.label for o in loop.ops if o.func_name == "tanh"] == ["tanh_1_5:1", "tanh_1_5:2", "tanh_1_5:3"]
    assert [c.label for c in loop.module_calls if c.address == "cell"] == ["cell:1", "cell:2", "cell:3"]


def test_no_silent_gap_counter_equals_recorded_ops_and_catches_an_unwrapped_method(monkeypatch):
    """The conformance counter (`zoo.count_framework_calls`, wrapping every Tensor member
    itself) sees as many calls as the capture records ops, for every zoo entry and for
    operators, creation class-methods, the T property and item assignment; with `tanh` left
    out of the capture's wrappers the calls inside its body are recorded instead (three
    tanh calls become twelve ops), the counts differ and the conformance cell fails."""
    from torchlens_conformance import cells
    from torchlens_conformance.zoo import load_zoo

    def recorded(model, *args):
        return sum(o.kind == "op" for o in tl.trace(model, *args, backend="tinygrad").ops)

    for name, e in Z.zoo().items():
        assert Z.count_framework_calls(e["model"], *e["args"]) == recorded(e["model"], *e["args"]), name

    def odd(x):
        y = x.T @ Tensor.ones(3, 2)
        z = x * 1.0
        z[0] = 5.0
        return y.sum() + z.sum(axis=0).max()

    assert Z.count_framework_calls(odd, X) == recorded(odd, X) == 9

    spec = tl.backends.get_spec("tinygrad")
    ctx = cells.Context(spec, _proto(), load_zoo(spec))
    assert cells.c1_no_silent_gap(ctx).outcome == "passed"
    monkeypatch.setattr(patch, "_PLAN", [p for p in patch.framework_plan() if p[0] != "tanh"])
    with pytest.raises(cells.CellFailure, match="loop: 20 ops recorded, the independent counter saw 11"):
        cells.c1_no_silent_gap(ctx)


def test_in_place_write_into_an_intermediate_is_recorded_and_its_payload_kept():
    def f(x):
        y = x * 2.0
        y[0] = 7.0
        y += 1.0
        return y

    t = tl.trace(f, X, backend="tinygrad")
    names = [o.func_name for o in t.ops if o.kind == "op"]
    assert names == ["mul", "__setitem__", "add"]
    np.testing.assert_array_equal(t["mul_1_1"].out.numpy(), X.numpy() * 2.0)  # the write did not reach the payload
    want = X.numpy() * 2.0
    want[0] = 7.0
    np.testing.assert_array_equal(t["setitem_1_2"].out.numpy(), want)
    np.testing.assert_array_equal(t.output_ops[0].out.numpy(), want + 1.0)
    assert _proto().validate(t).ok


def test_draws_replay_exactly_and_consume_the_stream_once(tmp_path):
    """A draw from tinygrad's global stream, traced from a seed, equals a plain forward from
    that seed, leaves the stream where the plain forward leaves it, and validates (re-drawn
    under its recorded state) before and after save/load; a wrong recorded state fails at
    that draw."""
    class Noisy:
        def __init__(self):
            self.fc = nn.Linear(4, 4)

        def __call__(self, x):
            return self.fc(x) + Tensor.randn(*x.shape) + Tensor.rand(3, 4)

    m = Noisy()
    Tensor.realize(m.fc.weight, m.fc.bias)
    proto = _proto()
    assert proto.capabilities().rng_replay and "replay_rng" in proto.trace_options()
    Tensor.manual_seed(5)
    ref = m(X).numpy()
    next_ref = Tensor.rand(2).numpy()
    Tensor.manual_seed(5)
    t = tl.trace(m, X, backend="tinygrad")
    np.testing.assert_allclose(t.output_ops[0].out.numpy(), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(Tensor.rand(2).numpy(), next_ref)
    assert proto.validate(t).ok
    t.save(tmp_path / "noisy.tlspec")
    back = tl.load(tmp_path / "noisy.tlspec")
    assert proto.validate(back).ok
    draw = t["randn_1_3"]
    draw.meta["rng_state"] = {**draw.meta["rng_state"], "seed": 6}
    status = proto.validate(t)
    assert not status.ok and status.first_failure == "randn_1_3"
    with pytest.raises(InvalidArgumentError) as info:
        tl.trace(m, X, backend="tinygrad", replay_rng="yes")
    assert info.value.code == "invalid_argument"


def test_save_load_validates_and_keeps_views(tmp_path):
    e = Z.zoo()["attention"]
    t = tl.trace(e["model"], *e["args"], backend="tinygrad")
    t.save(tmp_path / "a.tlspec")
    back = tl.load(tmp_path / "a.tlspec")
    for a, b in zip(t.ops, back.ops):
        for x, y in zip(a.outs, b.outs):
            assert isinstance(y, Tensor) and y.dtype == x.dtype
            np.testing.assert_array_equal(x.numpy(), y.numpy())
    assert _proto().validate(back).ok


def test_host_copy_is_numpy():
    t = tl.trace(nn.Linear(4, 2), X, backend="tinygrad")
    h = _proto().host_copy(t.output_ops[0].out)
    assert type(h) is np.ndarray and h.shape == (3, 2)


def test_bad_inputs_refuse_typed_before_anything_is_patched():
    torch = pytest.importorskip("torch")

    proto = _proto()
    before = _framework_objects()
    with pytest.raises(BackendUnsupportedError) as info:
        proto.capture(nn.Linear(4, 2), (np.ones((3, 4), np.float32),), {})
    assert info.value.code == "foreign_tensor_input" and info.value.remedy
    with pytest.raises(BackendUnsupportedError) as info:
        proto.capture(nn.Linear(4, 2), (torch.ones(3, 4),), {})
    assert info.value.code == "foreign_tensor_input"
    with pytest.raises(BackendUnsupportedError) as info:
        proto.capture(nn.Linear(4, 2), ([1.0, 2.0],), {})
    assert info.value.code == "tinygrad_input_required"
    with pytest.raises(InvalidArgumentError) as info:
        proto.capture(42, (X,), {})
    assert info.value.code == "model_type_unsupported"
    with pytest.raises(BackendUnsupportedError) as info:  # a model of another framework
        proto.capture(torch.nn.Linear(4, 2), (X,), {})
    assert info.value.code == "foreign_tensor_input" and "weight" in str(info.value)

    class Mixed:  # a model holding an array of another framework
        def __init__(self):
            self.fc = nn.Linear(4, 4)
            self.scale = torch.ones(4)

        def __call__(self, x):
            return self.fc(x) * Tensor(self.scale.numpy())

    with pytest.raises(BackendUnsupportedError) as info:
        tl.trace(Mixed(), X, backend="tinygrad")
    assert info.value.code == "foreign_tensor_input" and "scale" in str(info.value)
    after = _framework_objects()
    assert all(after[k] is before[k] for k in before)


def test_forward_refusals_restore_the_framework():
    """Writing into an input, calling a TinyJit function, returning no tensor: typed refusals
    raised as themselves (not as forward_failed), and nothing stays patched."""
    from tinygrad import TinyJit

    before = _framework_objects()

    def writes_input(x):
        x += 1.0
        return x

    def no_tensor(x):
        return (x * 2).sum().item()

    jitted = TinyJit(lambda x: (x * 2).realize())

    def uses_jit(x):
        return jitted(x + 1)

    for f, code in ((writes_input, "input_mutation_unsupported"), (no_tensor, "tensor_output_required"),
                    (uses_jit, "mid_capture_execution_unsupported")):
        x = Tensor(X.numpy())
        with pytest.raises(BackendUnsupportedError) as info:
            tl.trace(f, x, backend="tinygrad")
        assert info.value.code == code, f.__name__
        assert info.value.remedy
        after = _framework_objects()
        assert all(after[k] is before[k] for k in before), f.__name__
    assert patch.ACTIVE.recorder is None


def test_import_torchlens_imports_no_framework():
    code = "import sys, torchlens; print(sorted(m for m in ('tinygrad', 'torch', 'jax', 'mlx') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_namespace_exports_spec_names():
    assert tl.backends.tinygrad.TinygradBackend().name == "tinygrad"
    assert tl.backends.tinygrad.GradOptions().wrt == "inputs"
    with pytest.raises(BackendUnsupportedError) as info:
        tl.trace(Z.MLP(), X, backend="tinygrad", grad_options=tl.backends.tinygrad.GradOptions())
    assert info.value.code in ("intermediate_derived_grads_unsupported", "trace_option_unsupported")


def test_shipped_scorecard_is_current():
    out = subprocess.run([sys.executable, "-m", "torchlens_conformance.scorecard", "--backend", "tinygrad", "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_gradients_equal_tinygrad_autodiff_of_the_hand_forward():
    e = Z.zoo()["attention"]
    t = tl.trace(e["model"], *e["args"], backend="tinygrad",
                 capture=tl.CaptureOptions(backward_ready=True, save_grads=True))
    t.backward(lambda out: (out ** 2).sum())
    want = e["c3"]["grads"](lambda out: (out ** 2).sum(), *e["args"])
    assert len(want) == 5
    for label, g in want.items():
        np.testing.assert_allclose(t[label].grad.numpy(), g.numpy(), rtol=1e-5, atol=1e-6, err_msg=label)
    # by hand: d/d out of sum(out^2) is 2 * out
    np.testing.assert_allclose(t["add_2_14"].grad.numpy(), 2 * t["add_2_14"].out.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidArgumentError) as info:
        t.fork().backward(lambda out: out.sum())
    assert info.value.code == "backward_not_requested"


def test_bound_module_edit_and_live_trace_edit():
    m = Z.MLP()
    l1, l2 = m.l1, m.l2

    def by_hand(pre):
        return (pre(X.numpy() @ l1.weight.numpy().T + l1.bias.numpy())).clip(0, None) @ l2.weight.numpy().T + l2.bias.numpy()

    bound = tl.when(tl.module("l1"), tl.scale(2.0)).bind(m)
    np.testing.assert_allclose(bound(X).numpy(), by_hand(lambda h: 2.0 * h), rtol=1e-5, atol=1e-6)
    assert bound.last_report["fire_counts"] == {0: 1}
    np.testing.assert_allclose(m(X).numpy(), by_hand(lambda h: h), rtol=1e-5, atol=1e-6)  # unpatched again
    t = tl.trace(m, X, backend="tinygrad")
    f = t.fork().do("linear_1_2", tl.zero_ablate())
    np.testing.assert_allclose(f.output_ops[0].out.numpy(), by_hand(lambda h: 0 * h), atol=1e-6)
    np.testing.assert_allclose(t.output_ops[0].out.numpy(), by_hand(lambda h: h), rtol=1e-5, atol=1e-6)
