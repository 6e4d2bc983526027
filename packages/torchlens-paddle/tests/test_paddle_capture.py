"""Capture of paddle.nn layers and functions: restore, records against independent
evaluations, validation, persistence, gradients, edits, refusals."""

from __future__ import annotations

import subprocess
import sys
import types
import warnings

import numpy as np
import pytest

pytest.importorskip("paddle")

from torchlens_paddle.plugin import load_paddle  # noqa: E402

paddle = load_paddle()
import paddle.nn as nn  # noqa: E402
import paddle.nn.functional as F  # noqa: E402
from paddle import _C_ops  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.errors import BackendUnsupportedError, InvalidArgumentError, TraceCaptureError  # noqa: E402
from torchlens_paddle import patch  # noqa: E402
from torchlens_paddle import zoo as Z  # noqa: E402

X = paddle.to_tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))


def _proto():
    return tl.backends.get_protocol("paddle")


def _mlp():
    paddle.seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _framework_objects(layers=()) -> dict:
    """Every object a capture may replace, read from the framework itself: each module
    attribute bound to a `_C_ops` function (found by identity here, not by the backend's
    scan), every member of `paddle.Tensor`, and the hook tables of `layers`."""
    kernels = {id(v) for k, v in vars(_C_ops).items() if callable(v) and not k.startswith("__")}
    objs = {}
    for name, mod in list(sys.modules.items()):
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for attr, obj in items:
            # the marker read without running any attribute hook (some module attributes, such as
            # torch.backends.cuda's, initialise a device on attribute access)
            marked = isinstance(obj, types.FunctionType) and "__torchlens_original__" in obj.__dict__
            if id(obj) in kernels or marked:
                objs[(name, attr)] = obj
    for name, obj in vars(paddle.Tensor).items():
        objs[("Tensor", name)] = obj
    for i, layer in enumerate(layers):
        objs[("hooks", i)] = (dict(layer._forward_pre_hooks), dict(layer._forward_post_hooks))
    return objs


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (a[k] == b[k]) if k[0] == "hooks" else (a[k] is b[k]) for k in a)


def test_capture_restores_every_wrapped_object_on_exit_and_on_error():
    model = _mlp()
    layers = [model, *model.sublayers()]
    before = _framework_objects(layers)
    assert len(before) > 1000  # the bound copies are many
    t = tl.trace(model, X, backend="paddle")
    assert [o.func_name for o in t.ops if o.kind == "op"] == ["linear", "relu", "linear"]
    assert _same(before, _framework_objects(layers))
    assert len({k[0] for k in before if k[0].startswith("paddle.")}) > 5  # kernels bound by name in many modules

    class Boom(nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x) * 2
            assert _C_ops.linear is not before[("paddle._C_ops", "linear")]  # patched while the forward runs
            raise RuntimeError("boom")

    boom = Boom()
    layers = [boom, boom.fc]
    before = _framework_objects(layers)
    with pytest.raises(TraceCaptureError) as info:
        tl.trace(boom, X, backend="paddle")
    assert info.value.code == "forward_failed"
    assert [o.func_name for o in info.value.partial_trace.ops if o.kind == "op"] == ["linear", "multiply"]
    assert _same(before, _framework_objects(layers))
    assert patch.ACTIVE.recorder is None


def _tapped(entry) -> dict:
    vals = {}

    def tap(label, v):
        vals[label] = v
        return v

    if "reseed" in entry:
        entry["reseed"]()
    entry["c3"]["forward"](tap, *entry["args"])
    return vals


@pytest.mark.parametrize("name", ["mlp", "conv", "attention", "loop", "constant", "random"])
def test_zoo_ops_equal_an_independent_hand_evaluation(name):
    entry = Z.zoo()[name]
    if "reseed" in entry:
        entry["reseed"]()
    t = tl.trace(entry["model"], *entry["args"], backend="paddle")
    want = _tapped(entry)
    assert len(want) >= 2
    for label, v in want.items():
        np.testing.assert_allclose(t.ops[label].out.numpy(), v.numpy(), rtol=1e-6, atol=1e-6, err_msg=label)
    if "reseed" in entry:
        entry["reseed"]()
    np.testing.assert_array_equal(t.output_ops[0].out.numpy(), entry["model"](*entry["args"]).numpy())
    assert _proto().validate(t).ok


def test_module_paths_follow_the_model_tree():
    e = Z.zoo()["attention"]
    t = tl.trace(e["model"], *e["args"], backend="paddle")
    mods = {o.label: o.module for o in t.ops if o.kind == "op"}
    assert mods["layernorm_1_1"] == "norm"
    assert mods["linear_1_2"] == "attn.q_proj" and mods["linear_4_17"] == "attn.out_proj"
    assert mods["softmax_1_13"] == "attn"
    assert mods["add_1_18"] == "self"
    assert {m.address for m in t.modules} >= {"self", "norm", "attn", "attn.q_proj", "attn.out_proj"}
    conv = tl.trace(Z.zoo()["conv"]["model"], *Z.zoo()["conv"]["args"], backend="paddle")
    assert {o.label: o.module for o in conv.ops if o.kind == "op"}["batchnorm_1_4"] == "bn"
    loop = tl.trace(Z.LoopNet(), X, backend="paddle")
    assert [o.label for o in loop.ops if o.func_name == "tanh"] == ["tanh_1_3:1", "tanh_1_3:2", "tanh_1_3:3"]
    assert [o.module for o in loop.ops if o.func_name == "linear"] == ["inp", "cell", "cell", "cell"]


def test_no_silent_gap_counter_equals_recorded_ops_and_catches_an_unwrapped_kernel(monkeypatch):
    """The conformance counter (`zoo.count_framework_calls`, wrapping every `_C_ops` function
    and Tensor C method itself) sees as many calls as the capture records ops, for every zoo
    entry and for indexing and operators; with `tanh` left out of the capture's wrappers the
    counts differ and the conformance cell fails."""
    from torchlens_conformance import cells
    from torchlens_conformance.zoo import load_zoo

    def recorded(model, *args):
        return sum(o.kind == "op" for o in tl.trace(model, *args, backend="paddle").ops)

    for name, e in Z.zoo().items():
        if "reseed" in e:
            e["reseed"]()
        assert Z.count_framework_calls(e["model"], *e["args"]) == recorded(e["model"], *e["args"]), name

    def odd(x):
        return (x[0] * 2 + x[1:].sum(axis=0)) @ x.T - paddle.exp(x).mean()

    assert Z.count_framework_calls(odd, X) == recorded(odd, X) == 10

    spec = tl.backends.get_spec("paddle")
    ctx = cells.Context(spec, _proto(), load_zoo(spec))
    assert cells.c1_no_silent_gap(ctx).outcome == "passed"
    monkeypatch.setattr(patch, "_PLAN", [p for p in patch.framework_plan() if p[1] != "tanh"])
    monkeypatch.setattr(patch, "_SCANNED", [len(sys.modules)])
    with pytest.raises(cells.CellFailure, match="loop: 4 ops recorded, the independent counter saw 7"):
        cells.c1_no_silent_gap(ctx)


def test_indexing_and_operators_are_ops_that_replay(tmp_path):
    """Indexing, C-level operators and Python tensor methods are ops; a 0-d result (`mean()`)
    keeps its shape through save/load, and the loaded trace validates."""
    def f(x):
        return (x[0] * 2 + x[1:].sum(axis=0)) @ x.T - paddle.exp(x).mean()

    t = tl.trace(f, X, backend="paddle")
    t.save(tmp_path / "f.tlens")
    back = tl.load(tmp_path / "f.tlens")
    assert tuple(back.ops["mean_1_9"].out.shape) == () and _proto().validate(back).ok
    ops = [o for o in t.ops if o.kind == "op"]
    assert [o.func_name for o in ops] == ["getitem", "multiply", "getitem", "sum", "add", "transpose", "matmul",
                                          "exp", "mean", "subtract"]
    assert ops[6].parents == ("add_1_5", "transpose_1_6")
    h = X.numpy()
    want = (h[0] * 2 + h[1:].sum(axis=0)) @ h.T - np.exp(h).mean()
    np.testing.assert_allclose(t.output_ops[0].out.numpy(), want, rtol=1e-6, atol=1e-6)
    assert _proto().validate(t).ok


def test_random_draws_replay_from_their_recorded_generator_state(tmp_path):
    """A draw from paddle's global generator records the state it drew from: the traced
    forward equals a plain forward from the same seed and leaves the generator where the
    plain forward leaves it; validation re-draws from the recorded state, also after
    save/load; a wrong recorded state makes validation fail at that draw."""
    class Noisy(nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return F.dropout(self.fc(x), 0.5) + paddle.rand(x.shape) + paddle.randn(x.shape)

    m = Noisy()
    proto = _proto()
    paddle.seed(5)
    ref, next_ref = m(X).numpy(), paddle.rand([2]).numpy()
    paddle.seed(5)
    t = tl.trace(m, X, backend="paddle")
    np.testing.assert_array_equal(t.output_ops[0].out.numpy(), ref)
    np.testing.assert_array_equal(paddle.rand([2]).numpy(), next_ref)
    draws = [o for o in t.ops if o.kind == "op" and "rng_state" in o.meta]
    assert [o.func_name for o in draws] == ["dropout", "uniform", "gaussian"]
    assert proto.validate(t).ok
    t.save(tmp_path / "noisy.tlens")
    back = tl.load(tmp_path / "noisy.tlens")
    assert proto.validate(back).ok
    draw = t.ops[draws[2].label]
    draw.meta["rng_state"] = draws[1].meta["rng_state"]  # the state before another draw
    status = proto.validate(t)
    assert not status.ok and status.first_failure == draws[2].label


def test_save_load_validates_and_keeps_values(tmp_path):
    for name in ("attention", "conv"):
        e = Z.zoo()[name]
        t = tl.trace(e["model"], *e["args"], backend="paddle")
        t.save(tmp_path / f"{name}.tlens")
        back = tl.load(tmp_path / f"{name}.tlens")
        for a, b in zip(t.ops, back.ops):
            for x, y in zip(a.outs, b.outs):
                if x is not None and a.saved:
                    assert isinstance(y, paddle.Tensor)
                    np.testing.assert_array_equal(x.numpy(), y.numpy())
        assert _proto().validate(back).ok


def test_host_copy_is_numpy():
    t = tl.trace(nn.Linear(4, 2), X, backend="paddle")
    h = _proto().host_copy(t.output_ops[0].out)
    assert type(h) is np.ndarray and h.shape == (3, 2)


def test_bad_inputs_refuse_typed_before_anything_is_patched():
    proto = _proto()
    with pytest.raises(BackendUnsupportedError) as info:
        proto.capture(nn.Linear(4, 2), (np.ones((3, 4), np.float32),), {})
    assert info.value.code == "foreign_tensor_input" and info.value.remedy
    with pytest.raises(InvalidArgumentError) as info:
        proto.capture(42, (X,), {})
    assert info.value.code == "model_type_unsupported"
    for wrong in ([1.0, 2.0, 3.0, 4.0], {"x": 3}):  # a layer given no paddle.Tensor at all
        before = _framework_objects()
        with pytest.raises(InvalidArgumentError) as info:
            tl.trace(nn.Linear(4, 2), wrong, backend="paddle")
        assert info.value.code == "invalid_argument" and "paddle.to_tensor" in info.value.remedy
        assert _same(before, _framework_objects())

    class Mixed(nn.Layer):  # a layer holding an array of another framework
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = np.ones(4, np.float32)

        def forward(self, x):
            return self.fc(x) * paddle.to_tensor(self.scale)

    before = _framework_objects()
    with pytest.raises(BackendUnsupportedError) as info:
        tl.trace(Mixed(), X, backend="paddle")
    assert info.value.code == "foreign_tensor_input" and "scale" in str(info.value)
    assert _same(before, _framework_objects())

    class InPlace(nn.Layer):
        def forward(self, x):
            h = x * 1.0
            h[0] = 0.0
            return h

    with pytest.raises(BackendUnsupportedError) as info:
        tl.trace(InPlace(), X, backend="paddle")
    assert info.value.code == "inplace_op_unsupported"
    assert _same(before, _framework_objects())

    bn = nn.BatchNorm1D(4)  # training mode: running statistics updated in place
    with pytest.raises(BackendUnsupportedError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paddle's notice that training BatchNorm tracks statistics
        tl.trace(bn, X, backend="paddle")
    assert info.value.code == "inplace_op_unsupported" and "eval" in info.value.remedy

    paddle.enable_static()
    try:
        with pytest.raises(BackendUnsupportedError) as info:
            proto.capture(_mlp(), (X,), {})
        assert info.value.code == "runtime_mode_unsupported"
    finally:
        paddle.disable_static()
    assert {"runtime_mode_unsupported", "inplace_op_unsupported", "foreign_tensor_input"} <= proto.refusal_codes()


def test_paddle_after_tensorflow_refuses_instead_of_crashing():
    """With tensorflow loaded and paddle's native core not, the backend refuses typed
    (`runtime_conflict`) and does not load paddle (loading it would crash the process).
    A stand-in `tensorflow` module keeps the subprocess fast."""
    code = ("import sys, types; sys.modules['tensorflow'] = types.ModuleType('tensorflow')\n"
            "import torchlens as tl\n"
            "try:\n    tl.backends.get_protocol('paddle')\nexcept tl.errors.BackendUnsupportedError as e:\n"
            "    print(e.code, bool(e.remedy), 'paddle' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "runtime_conflict True False", out.stdout + out.stderr


def test_import_torchlens_imports_no_framework_and_paddle_loads_without_the_ccache_warning():
    code = ("import sys, warnings; warnings.simplefilter('error'); import torchlens, torchlens_paddle\n"
            "print(sorted(m for m in ('paddle', 'torch', 'jax', 'tensorflow') if m in sys.modules))\n"
            "from torchlens_paddle.plugin import load_paddle; load_paddle(); print('paddle' in sys.modules)")
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["[]", "True"], out.stdout + out.stderr
    assert "ccache" not in out.stderr


def test_shipped_scorecard_is_current():
    out = subprocess.run([sys.executable, "-m", "torchlens_conformance.scorecard", "--backend", "paddle", "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_gradients_equal_paddle_autodiff_of_the_hand_forward():
    e = Z.zoo()["attention"]
    t = tl.trace(e["model"], *e["args"], backend="paddle",
                 capture=tl.CaptureOptions(backward_ready=True, save_grads=True))
    t.backward(lambda out: (out ** 2).sum())
    want = e["c3"]["grads"](lambda out: (out ** 2).sum(), *e["args"])
    assert len(want) == 19  # every op of the block and its input
    for label, g in want.items():
        np.testing.assert_allclose(t.ops[label].grad.numpy(), g.numpy(), rtol=1e-5, atol=1e-6, err_msg=label)
    # an independent check of one: d/d(out) of sum(out**2) is 2*out
    np.testing.assert_allclose(t.ops["add_1_18"].grad.numpy(), 2 * t.ops["add_1_18"].out.numpy(), rtol=1e-6)
    with pytest.raises(InvalidArgumentError) as info:
        t.fork().backward(lambda out: out.sum())
    assert info.value.code == "backward_not_requested"


def test_bound_module_edit_and_live_trace_edit():
    m = _mlp()
    l0, l2 = m[0], m[2]

    def by_hand(pre):
        return F.linear(F.relu(pre(F.linear(X, l0.weight, l0.bias))), l2.weight, l2.bias)

    bound = tl.when(tl.module("0"), tl.scale(2.0)).bind(m)
    np.testing.assert_allclose(bound(X).numpy(), by_hand(lambda h: 2.0 * h).numpy(), rtol=1e-6, atol=1e-6)
    assert bound.last_report["fire_counts"] == {0: 1}
    np.testing.assert_array_equal(m(X).numpy(), by_hand(lambda h: h).numpy())  # unpatched again
    t = tl.trace(m, X, backend="paddle")
    f = t.fork().do("linear_1_1", tl.zero_ablate())
    np.testing.assert_allclose(f.output_ops[0].out.numpy(), by_hand(lambda h: 0 * h).numpy(), atol=1e-6)
    np.testing.assert_array_equal(t.output_ops[0].out.numpy(), m(X).numpy())  # the original is untouched


def test_bfloat16_payloads_save_load_and_validate_bit_for_bit(tmp_path):
    """bfloat16 has no numpy dtype: host_copy gives float32, saved payloads keep their bits and
    dtype, and the loaded trace validates. (paddle's CPU kernels for matmul and relu have no
    bfloat16: elementwise ops only.)"""
    x = paddle.to_tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)).astype("bfloat16")
    t = tl.trace(lambda v: (v * 2 + 1).reshape([4, 3]), x, backend="paddle")
    assert [o.dtypes for o in t.ops if o.kind == "op"] == [("bfloat16",)] * 3
    want = ((x.astype("float32") * 2).astype("bfloat16").astype("float32") + 1).astype("bfloat16")
    got = t.ops["add_1_2"].out
    np.testing.assert_array_equal(got.astype("float32").numpy(), want.astype("float32").numpy())
    assert _proto().host_copy(got).dtype == np.float32
    t.save(tmp_path / "bf16.tlens")
    back = tl.load(tmp_path / "bf16.tlens")
    for op in t.ops:
        b = back.ops[op.label].out
        assert b.dtype == paddle.bfloat16
        np.testing.assert_array_equal(b.numpy(), op.out.numpy())  # the raw bits (numpy() gives them as uint16)
    assert _proto().validate(back).ok


def test_nested_results_and_tensor_flag_copies_keep_the_graph_whole(tmp_path):
    """The `rnn` kernel returns (out, dropout state, [h, c]): one op whose output slots are the
    leaves, depth first, replayed and saved as such; `AdaptiveAvgPool2D` hands `pool2d` a copy
    made by `Tensor._use_gpudnn`, recorded as an op so the pool's parent is the conv output,
    not a constant. Both agree with the independent counter."""
    paddle.seed(0)
    lstm = nn.LSTM(4, 5)
    lstm.eval()
    x = paddle.randn([2, 3, 4])
    t = tl.trace(lstm, x, backend="paddle")
    rnn = [o for o in t.ops if o.func_name == "rnn"]
    assert len(rnn) == 1 and len(rnn[0].shapes) == 4 and rnn[0].meta["out_tree"] == ["tuple", [0, 0, ["list", [0, 0]]]]
    out, (h, c) = lstm(x)
    for got, want in zip(t.output_ops, (out, h, c)):
        np.testing.assert_array_equal(got.out.numpy(), want.numpy())
    assert Z.count_framework_calls(lstm, x) == sum(o.kind == "op" for o in t.ops) == 5
    t.save(tmp_path / "lstm.tlens")
    assert _proto().validate(t).ok and _proto().validate(tl.load(tmp_path / "lstm.tlens")).ok

    pool = nn.Sequential(nn.Conv2D(2, 3, 3), nn.AdaptiveAvgPool2D(1))
    img = paddle.randn([1, 2, 5, 5])
    p = tl.trace(pool, img, backend="paddle")
    ops = [o for o in p.ops if o.kind == "op"]
    assert [o.func_name for o in ops] == ["conv2d", "reshape", "add", "use_gpudnn", "pool2d"]
    assert ops[4].parents == (ops[3].label,) and ops[3].parents == (ops[2].label,)
    assert not [o for o in p.ops if o.kind == "constant"]
    assert Z.count_framework_calls(pool, img) == len(ops)
    assert _proto().validate(p).ok
