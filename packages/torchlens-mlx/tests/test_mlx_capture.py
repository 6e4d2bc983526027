"""Capture of mlx.nn models and functions: restore, records against independent evaluations,
validation, persistence, refusals."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import mlx.nn as nn  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.errors import BackendUnsupportedError, InvalidArgumentError, TraceCaptureError  # noqa: E402
from torchlens_mlx import patch  # noqa: E402
from torchlens_mlx import zoo as Z  # noqa: E402

X = mx.linspace(-1, 1, 12).reshape(3, 4)


def _proto():
    return tl.backends.get_protocol("mlx")


def _framework_objects() -> dict:
    """Every object a capture may replace, read from the framework itself."""
    objs = {}
    for path in patch.NAMESPACES:
        ns = patch._namespace(path)
        for name in dir(ns):
            objs[(path, name)] = getattr(ns, name)
    for name, obj in vars(mx.array).items():
        objs[("array", name)] = obj
    for cls in (nn.Linear, nn.Sequential, nn.ReLU, nn.MultiHeadAttention, nn.LayerNorm):
        objs[(cls.__name__, "__call__")] = cls.__dict__.get("__call__")
    return objs


def test_capture_restores_every_wrapped_object_on_exit_and_on_error():
    before = _framework_objects()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    tl.trace(model, X, backend="mlx")
    after = _framework_objects()
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def __call__(self, x):
            h = self.fc(x) * 2
            assert mx.add is not before[("mlx.core", "add")]  # patched while the forward runs
            raise RuntimeError("boom")

    with pytest.raises(TraceCaptureError) as info:
        tl.trace(Boom(), X, backend="mlx")
    assert info.value.code == "forward_failed"
    assert [o.func_name for o in info.value.partial_trace.ops if o.kind == "op"] == ["transpose", "addmm", "multiply"]
    after = _framework_objects()
    assert all(after[k] is before[k] for k in before)
    assert patch.ACTIVE.recorder is None


def _tapped(entry) -> dict:
    vals = {}

    def tap(label, v):
        vals[label] = v
        return v

    entry["c3"]["forward"](tap, *entry["args"])
    return vals


@pytest.mark.parametrize("name", ["mlp", "conv", "attention", "loop", "constant", "random"])
def test_zoo_ops_equal_an_independent_hand_evaluation(name):
    entry = Z.zoo()[name]
    t = tl.trace(entry["model"], *entry["args"], backend="mlx")
    want = _tapped(entry)
    assert len(want) >= 3 or name == "random"
    for label, v in want.items():
        np.testing.assert_allclose(np.asarray(t[label].out), np.asarray(v), rtol=1e-6, atol=1e-6, err_msg=label)
    np.testing.assert_allclose(np.asarray(t.output_ops[0].out),
                               np.asarray(entry["model"](*entry["args"])), rtol=0, atol=0)
    assert _proto().validate(t).ok
    assert tl.validate(entry["model"], *entry["args"], backend="mlx") is True


def test_module_paths_follow_the_model_tree():
    e = Z.zoo()["attention"]
    t = tl.trace(e["model"], *e["args"], backend="mlx")
    mods = {o.label: o.module for o in t.ops if o.kind == "op"}
    assert mods["layernorm_1_1"] == "norm"
    assert mods["matmul_1_3"] == "attn.query_proj" and mods["matmul_4_18"] == "attn.out_proj"
    assert mods["scaleddotproductattention_1_14"] == "attn"
    assert mods["add_1_19"] == "self"
    assert {m.address for m in t.modules} >= {"self", "norm", "attn", "attn.query_proj", "attn.out_proj"}
    loop = tl.trace(Z.LoopNet(), X, backend="mlx")
    assert [o.label for o in loop.ops if o.func_name == "tanh"] == ["tanh_1_5:1", "tanh_1_5:2", "tanh_1_5:3"]


def test_op_count_matches_an_independent_counter():
    """Every array-producing framework call of the forward is one op: count the calls with our
    own wrappers around the same functions (outside any capture) and compare."""
    e = Z.zoo()["attention"]
    counted = []
    names = ("addmm", "matmul", "unflatten", "flatten", "transpose", "add", "layer_norm", "scaled_dot_product_attention")
    originals = {}
    for n in ("unflatten",):
        originals[("mx", n)] = getattr(mx, n)
    saved_fast = {n: getattr(mx.fast, n) for n in ("layer_norm", "scaled_dot_product_attention")}
    try:
        for n, f in originals.items():
            setattr(mx, n[1], (lambda f, n: lambda *a, **k: (counted.append(n[1]), f(*a, **k))[1])(f, n))
        for n, f in saved_fast.items():
            setattr(mx.fast, n, (lambda f, n: lambda *a, **k: (counted.append(n), f(*a, **k))[1])(f, n))
        e["model"](*e["args"])
    finally:
        for n, f in originals.items():
            setattr(mx, n[1], f)
        for n, f in saved_fast.items():
            setattr(mx.fast, n, f)
    t = tl.trace(e["model"], *e["args"], backend="mlx")
    names = [o.func_name for o in t.ops if o.kind == "op"]
    assert names.count("unflatten") == counted.count("unflatten") == 3
    assert names.count("layer_norm") == counted.count("layer_norm") == 1
    assert names.count("scaled_dot_product_attention") == counted.count("scaled_dot_product_attention") == 1
    assert len(names) == 19


def test_compiled_functions_are_traced_through():
    @mx.compile
    def gate(x):
        return mx.tanh(x) * mx.sigmoid(x)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def __call__(self, x):
            return gate(self.fc(x))

    m = M()
    t = tl.trace(m, X, backend="mlx")
    ops = [o for o in t.ops if o.kind == "op"]
    assert [o.func_name for o in ops][-3:] == ["tanh", "sigmoid", "multiply"]
    assert [p for p in ops[-3].parents] == ["addmm_1_2"]  # found through the compiled call's new objects
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(m(X)))
    assert _proto().validate(t).ok


def test_keyless_random_and_in_place_writes_replay():
    class M(nn.Module):
        def __call__(self, x):
            y = x * 1.0
            y[0] = mx.random.normal((4,))  # keyless draw (global state), in-place write
            return y + 1

    mx.random.seed(3)
    t = tl.trace(M(), X, backend="mlx")
    mult = t["multiply_1_1"]
    np.testing.assert_array_equal(np.asarray(mult.out), np.asarray(X))  # the write did not reach the payload
    assert len(t["normal_1_2"].meta["rng_key"]) == 2  # the key it consumed, replayed explicitly
    assert _proto().validate(t).ok


def test_save_load_validates(tmp_path):
    e = Z.zoo()["attention"]
    t = tl.trace(e["model"], *e["args"], backend="mlx")
    t.save(tmp_path / "a.tlspec")
    back = tl.load(tmp_path / "a.tlspec")
    for a, b in zip(t.ops, back.ops):
        assert isinstance(b.out, mx.array)
        np.testing.assert_array_equal(np.asarray(a.out), np.asarray(b.out))
    assert _proto().validate(back).ok


def test_host_copy_is_numpy():
    t = tl.trace(nn.Linear(4, 2), X, backend="mlx")
    h = _proto().host_copy(t.output_ops[0].out)
    assert type(h) is np.ndarray and h.shape == (3, 2)


def test_bad_inputs_refuse_typed():
    proto = _proto()
    with pytest.raises(BackendUnsupportedError) as info:
        proto.capture(nn.Linear(4, 2), (np.ones((3, 4), np.float32),), {})
    assert info.value.code == "foreign_tensor_input" and info.value.remedy
    with pytest.raises(InvalidArgumentError) as info:
        proto.capture(42, (X,), {})
    assert info.value.code == "model_type_unsupported"

    class Mixed(nn.Module):  # a model holding an array of another framework
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = np.ones(4, np.float32)

        def __call__(self, x):
            return self.fc(x) * mx.array(self.scale)

    before = {n: getattr(mx, n) for n in ("add", "addmm", "multiply")}
    with pytest.raises(BackendUnsupportedError) as info:
        tl.trace(Mixed(), X, backend="mlx")
    assert info.value.code == "foreign_tensor_input" and "scale" in str(info.value)
    assert all(getattr(mx, n) is f for n, f in before.items())  # refused before anything was patched


def test_import_torchlens_imports_no_framework():
    code = "import sys, torchlens; print(sorted(m for m in ('mlx', 'torch', 'jax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_shipped_scorecard_is_current():
    out = subprocess.run([sys.executable, "-m", "torchlens_conformance.scorecard", "--backend", "mlx", "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_gradients_equal_mlx_autodiff_of_the_hand_forward():
    e = Z.zoo()["attention"]
    t = tl.trace(e["model"], *e["args"], backend="mlx", capture=tl.CaptureOptions(backward_ready=True, save_grads=True))
    t.backward(lambda out: (out ** 2).sum())
    want = e["c3"]["grads"](lambda out: (out ** 2).sum(), *e["args"])
    assert len(want) == 4
    for label, g in want.items():
        np.testing.assert_allclose(np.asarray(t[label].grad), np.asarray(g), rtol=1e-5, atol=1e-6, err_msg=label)
    with pytest.raises(InvalidArgumentError) as info:
        t.fork().backward(lambda out: out.sum())
    assert info.value.code == "backward_not_requested"


def test_bound_module_edit_and_live_trace_edit():
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    mx.eval(m.parameters())
    l0, l2 = m.layers[0], m.layers[2]

    def by_hand(pre):
        return mx.addmm(l2.bias, mx.maximum(pre(mx.addmm(l0.bias, X, l0.weight.T)), 0), l2.weight.T)

    bound = tl.when(tl.module("layers.0"), tl.scale(2.0)).bind(m)
    np.testing.assert_allclose(np.asarray(bound(X)), np.asarray(by_hand(lambda h: 2.0 * h)), rtol=1e-6, atol=1e-6)
    assert bound.last_report["fire_counts"] == {0: 1}
    np.testing.assert_allclose(np.asarray(m(X)), np.asarray(by_hand(lambda h: h)), rtol=0, atol=0)  # unpatched again
    t = tl.trace(m, X, backend="mlx")
    f = t.fork().do("addmm_1_2", tl.zero_ablate())
    np.testing.assert_allclose(np.asarray(f.output_ops[0].out), np.asarray(by_hand(lambda h: 0 * h)), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(m(X)))  # the original is untouched


def test_at_updates_and_iteration_are_ops():
    class M(nn.Module):
        def __call__(self, x):
            y = x.at[1].add(2.0)
            return mx.stack([r * 2 for r in y])

    x = mx.ones((3, 4))
    t = tl.trace(M(), x, backend="mlx")
    ops = [o for o in t.ops if o.kind == "op"]
    assert [o.func_name for o in ops] == ["at_add"] + ["getitem", "multiply"] * 3 + ["stack"]
    assert ops[1].parents == ("atadd_1_1",) and t.ops["stack_1_4"].parents == ("multiply_1_3:1", "multiply_1_3:2", "multiply_1_3:3")
    want = np.ones((3, 4), np.float32)
    want[1] += 2.0
    np.testing.assert_array_equal(np.asarray(t["atadd_1_1"].out), want)
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), 2 * want)
    assert _proto().validate(t).ok


def test_no_silent_gap_counter_equals_recorded_ops_and_catches_an_unwrapped_function(monkeypatch):
    """The conformance counter (`zoo.count_framework_calls`, wrapping every framework callable
    itself) sees as many calls as the capture records ops, for every zoo entry and for
    iteration, `.at[]` updates and item assignment; with `tanh` left out of the capture's
    wrappers the counts differ and the conformance cell fails."""
    from torchlens_conformance import cells
    from torchlens_conformance.zoo import load_zoo

    def recorded(model, *args):
        return sum(o.kind == "op" for o in tl.trace(model, *args, backend="mlx").ops)

    for name, e in Z.zoo().items():
        assert Z.count_framework_calls(e["model"], *e["args"]) == recorded(e["model"], *e["args"]), name

    def odd(x):
        rows = [r * 2 for r in x]
        y = x.at[0].add(1.0)
        y[1] = 0.0
        return mx.stack(rows) + y

    assert Z.count_framework_calls(odd, X) == recorded(odd, X) == 3 + 3 + 1 + 1 + 1 + 1

    spec = tl.backends.get_spec("mlx")
    ctx = cells.Context(spec, _proto(), load_zoo(spec))
    assert cells.c1_no_silent_gap(ctx).outcome == "passed"
    monkeypatch.setattr(patch, "_PLAN", [p for p in patch.framework_plan() if p[1] != "tanh"])
    with pytest.raises(cells.CellFailure, match="loop: 8 ops recorded, the independent counter saw 11"):
        cells.c1_no_silent_gap(ctx)


def test_keyless_draws_replay_exactly_and_consume_the_global_key_once(tmp_path):
    """rng_replay=True: dropout, uniform and normal without keys, traced from a seed, equal a
    plain forward from that seed, leave the global key where the plain forward leaves it, and
    validate (each draw re-drawn from its recorded key) before and after save/load; a wrong
    recorded key makes validation fail at that draw. replay_rng= takes a bool only."""
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.drop = nn.Dropout(0.5)

        def __call__(self, x):
            return self.drop(self.fc(x)) + mx.random.uniform(shape=x.shape) + mx.random.normal(x.shape)

    m = Noisy()
    mx.eval(m.parameters())
    proto = _proto()
    assert proto.capabilities().rng_replay and "replay_rng" in proto.trace_options()
    mx.random.seed(5)
    ref, next_ref = np.array(m(X)), np.array(mx.random.uniform(shape=(2,)))
    for replay_rng in (True, False):
        mx.random.seed(5)
        t = tl.trace(m, X, backend="mlx", replay_rng=replay_rng)
        np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), ref)
        np.testing.assert_array_equal(np.array(mx.random.uniform(shape=(2,))), next_ref)
        assert proto.validate(t, None).ok
    t.save(tmp_path / "noisy.tlens")
    back = tl.load(tmp_path / "noisy.tlens")
    assert proto.validate(back, None).ok
    draw = t["normal_1_8"]
    draw.meta["rng_key"] = mx.random.split(mx.array(draw.meta["rng_key"], dtype=mx.uint32))[0].tolist()
    status = proto.validate(t, None)
    assert not status.ok and status.first_failure == "normal_1_8"
    with pytest.raises(InvalidArgumentError) as info:
        tl.trace(m, X, backend="mlx", replay_rng="yes")
    assert info.value.code == "invalid_argument"


def test_bfloat16_traces_saves_loads_and_validates_bit_for_bit(tmp_path):
    """bfloat16 payloads (no numpy dtype): the capture records only the model's calls, every op
    equals a hand evaluation in bfloat16, the saved file brings back the same bits and dtype
    (also for the transposed weight view), and validation passes before and after load."""
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    m.set_dtype(mx.bfloat16)
    mx.eval(m.parameters())
    x = X.astype(mx.bfloat16)
    t = tl.trace(m, x, backend="mlx")
    assert [o.func_name for o in t.ops if o.kind == "op"] == ["transpose", "addmm", "maximum", "transpose", "addmm"]
    h = mx.addmm(m.layers[0].bias, x, m.layers[0].weight.T)
    want = {"addmm_1_2": h, "maximum_1_3": mx.maximum(h, 0),
            "addmm_2_5": mx.addmm(m.layers[2].bias, mx.maximum(h, 0), m.layers[2].weight.T)}
    for label, v in want.items():
        assert t[label].out.dtype == mx.bfloat16 and mx.array_equal(t[label].out, v).item(), label
    proto = _proto()
    assert proto.host_copy(t["addmm_1_2"].out).dtype == np.float32
    assert proto.validate(t, None).ok
    t.save(tmp_path / "bf16.tlens")
    back = tl.load(tmp_path / "bf16.tlens")
    for op in t.ops:
        if op.saved and op.out is not None:
            got = back[op.label].out
            assert got.dtype == op.out.dtype and got.shape == op.out.shape, op.label
            assert mx.array_equal(mx.view(got, mx.uint16), mx.view(op.out, mx.uint16)).item(), op.label
    assert proto.validate(back, None).ok
