"""The SDK's framework-free backend helpers (`torchlens.backends.sdk`, `sdk_grads`) against hand
values, on numpy values and the numpy reference backend's traces."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import torchlens as tl
from torchlens.backends import sdk
from torchlens.errors import InvalidArgumentError


def _is_arr(v):
    return isinstance(v, np.ndarray)


def _float_leaf(v):
    return v.dtype.kind == "f"


def _float_scalar(v):
    return isinstance(v, (np.ndarray, np.floating)) and np.shape(v) == () and np.asarray(v).dtype.kind == "f"


# --- leaf_paths / foreign_leaf / call_site ---------------------------------------------------


def test_leaf_paths_follow_the_input_path_convention():
    a, b, c = np.zeros(1), np.ones(2), np.full(3, 2.0)
    got = sdk.leaf_paths((a, [None, {"m": b, "n": 3}], {"k": (c,)}), "args", _is_arr)
    assert [p for p, _ in got] == ["args[0]", "args[1][1]['m']", "args[2]['k'][0]"]
    assert [v is w for (_, v), w in zip(got, (a, b, c))] == [True, True, True]
    assert sdk.leaf_paths(a, "output", _is_arr) == [("output", a)]
    assert sdk.leaf_paths((1, "s", None), "", _is_arr) == []


class _Foreign:
    """An object whose type claims to live in another framework's module."""

    def __init__(self, shape=None):
        if shape is not None:
            self.shape = shape


_Foreign.__module__ = "jax._src.array"


def test_foreign_leaf_names_the_first_foreign_value():
    f = _Foreign((2,))
    assert sdk.foreign_leaf([1, {"a": (2, f)}], ("jax", "torch")) == "jax._src.array._Foreign"
    assert sdk.foreign_leaf([1, {"a": (2, f)}], ("torch",)) is None
    # numpy arrays are foreign unless the backend says otherwise
    assert sdk.foreign_leaf({"x": np.zeros(2)}, ()) == "numpy.ndarray"
    assert sdk.foreign_leaf({"x": np.zeros(2)}, (), numpy=False) is None
    # need_shape: a module-level object without a shape (a dtype, a function) is not an array
    assert sdk.foreign_leaf([_Foreign()], ("jax",), need_shape=True) is None
    assert sdk.foreign_leaf([_Foreign((1,))], ("jax",), need_shape=True) == "jax._src.array._Foreign"


def _outer(stop_code, limit=16):
    return _inner(stop_code, limit)


def _inner(stop_code, limit):
    return sdk.call_site(sys._getframe(), stop_code, limit)


def test_call_site_walks_out_to_the_stop_code():
    key = sdk.call_site(sys._getframe(), None, 3)
    assert len(key) == 3 and key[0][0] is sys._getframe().f_code
    key = _outer(_outer.__code__)
    assert [c for c, _ in key] == [_inner.__code__]  # stops below _outer
    key = _outer(frozenset({_outer.__code__, test_call_site_walks_out_to_the_stop_code.__code__}))
    assert [c for c, _ in key] == [_inner.__code__]
    key = _outer(test_call_site_walks_out_to_the_stop_code.__code__)
    assert [c for c, _ in key] == [_inner.__code__, _outer.__code__]
    assert len(_outer(None, 1)) == 1
    # two calls from two lines differ; the same line gives the same key
    k1, k2 = _outer(None, 3), _outer(None, 3)
    assert k1[:2] == k2[:2] and k1[2] != k2[2]
    keys = [_outer(None, 3) for _ in range(2)]
    assert keys[0] == keys[1]


def test_module_parents_skip_addresses_that_are_not_modules():
    got = sdk.module_parents(["self", "enc", "enc.layers.0", "enc.layers.0.attn", "head", "blocks.1.mlp"])
    assert got == {"enc": "self", "enc.layers.0": "enc", "enc.layers.0.attn": "enc.layers.0", "head": "self",
                   "blocks.1.mlp": "self"}
    assert sdk.module_parents(["self"]) == {}


# --- GradOptions -------------------------------------------------------------------------------


def test_grad_options_is_one_dataclass_with_a_typed_refusal():
    g = sdk.GradOptions(wrt="both")
    assert (g.wrt, g.loss, g.intermediates) == ("both", None, True)
    with pytest.raises(InvalidArgumentError) as e:
        sdk.GradOptions(wrt="weights")
    assert e.value.code == "invalid_argument" and "wrt" in str(e.value)
    from torchlens.backends.sdk_grads import GradOptions

    assert GradOptions is sdk.GradOptions


# --- output template ---------------------------------------------------------------------------


def test_out_template_and_rebuild_round_trip():
    a, b, c = np.zeros(1), np.ones(2), np.full(3, 2.0)
    out = {"h": (a, 7), "l": [b, {"z": c}], "s": "x"}
    tmpl = sdk.out_template(out, _is_arr)
    assert [tmpl["h"][0].index, tmpl["l"][0].index, tmpl["l"][1]["z"].index] == [0, 1, 2]
    assert tmpl["h"][1] == 7 and tmpl["s"] == "x" and isinstance(tmpl["h"], tuple)
    back = sdk.rebuild(tmpl, ["A", "B", "C"])
    assert back == {"h": ("A", 7), "l": ["B", {"z": "C"}], "s": "x"}


# --- perturbed replay on the numpy reference backend -------------------------------------------


@pytest.fixture
def mlp_trace():
    from torchlens_reference import nn

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    trace = tl.trace(model, x, backend="reference")
    p = {q.address: q.value for q in trace.params}
    return trace, x, p


def _hand(x, p, eps_hidden=0.0):
    h = np.maximum(x @ p["0.weight"].T + p["0.bias"], 0) + eps_hidden
    return h @ p["2.weight"].T + p["2.bias"]


def _replayer(trace):
    from torchlens_reference.edit_ops import ReferenceEditOps

    return sdk.Replayer(trace, ReferenceEditOps())


def test_perturbed_replay_adds_each_perturbation_where_it_is_named(mlp_trace):
    trace, x, p = mlp_trace
    state = sdk.keep_for_backward(trace, trace.output_ops[0].outs[0], True, _is_arr)
    assert trace.backend_state is state and set(state.sources) == {0}
    keys = sdk.grad_keys(trace.ops, lambda d: d.startswith("float"))
    assert keys == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)]
    assert sdk.grad_keys(trace.ops, lambda d: d.startswith("float"), kinds=("op",)) == [(1, 0), (2, 0), (3, 0)]
    # zero perturbations: the recorded output
    leaves = sdk.perturbed_replay(trace, state, _replayer(trace), {}, params=sdk.param_values(trace), is_leaf=_is_arr)
    np.testing.assert_allclose(leaves[0], _hand(x, p), rtol=1e-6)
    # a perturbation at the relu output (event 2) travels through the second linear only
    d = np.arange(24, dtype=np.float32).reshape(3, 8) / 10
    relu = next(op for op in trace.ops if op.label.startswith("relu"))
    leaves = sdk.perturbed_replay(trace, state, _replayer(trace), {relu.event_id: {0: d}},
                                  params=sdk.param_values(trace), is_leaf=_is_arr)
    np.testing.assert_allclose(leaves[0], _hand(x, p, d), rtol=1e-5)
    # the add callable is the backend's (here: a scaled add)
    leaves = sdk.perturbed_replay(trace, state, _replayer(trace), {relu.event_id: {0: d}},
                                  params=sdk.param_values(trace), is_leaf=_is_arr, add=lambda v, e: v + 2 * e)
    np.testing.assert_allclose(leaves[0], _hand(x, p, 2 * d), rtol=1e-5)
    # a perturbation on an input is seen by every later op
    dx = np.full((3, 4), 0.25, np.float32)
    leaves = sdk.perturbed_replay(trace, state, _replayer(trace), {0: {0: dx}}, params=sdk.param_values(trace),
                                  is_leaf=_is_arr)
    np.testing.assert_allclose(leaves[0], _hand(x + dx, p), rtol=1e-5)
    # replay reads the params it is given, not the model's
    q = dict(sdk.param_values(trace), **{"2.bias": np.array([10.0, -10.0], np.float32)})
    leaves = sdk.perturbed_replay(trace, state, _replayer(trace), {}, params=q, is_leaf=_is_arr)
    np.testing.assert_allclose(leaves[0], _hand(x, dict(p, **{"2.bias": q["2.bias"]})), rtol=1e-6)


def test_loss_value_sums_float_leaves_or_calls_the_loss(mlp_trace):
    trace, x, p = mlp_trace
    state = sdk.keep_for_backward(trace, (trace.output_ops[0].outs[0], 3), True, _is_arr)
    y = _hand(x, p)
    kw = dict(is_float_leaf=_float_leaf, reduce_sum=np.sum, is_float_scalar=_float_scalar)
    assert sdk.loss_value(state, [y], None, **kw) == pytest.approx(float(y.sum()))
    assert sdk.loss_value(state, [y, y], None, **kw) == pytest.approx(2 * float(y.sum()), rel=1e-6)
    got = sdk.loss_value(state, [y], lambda out: (out[0] ** 2).sum() + out[1], **kw)
    assert got == pytest.approx(float((y ** 2).sum()) + 3, rel=1e-6)
    with pytest.raises(InvalidArgumentError) as e:
        sdk.loss_value(state, [y], lambda out: out[0], **kw)
    assert e.value.code == "invalid_argument" and "not a float scalar" in str(e.value)
    with pytest.raises(InvalidArgumentError, match="no floating-point leaf"):
        sdk.loss_value(state, [np.arange(3)], None, **kw)


def test_store_grads_fills_saved_ops_slot_by_slot(mlp_trace):
    trace, _x, _p = mlp_trace
    state = sdk.keep_for_backward(trace, trace.output_ops[0].outs[0], True, _is_arr)
    keys = [(1, 0), (3, 0)]
    sdk.store_grads(trace, state, keys, ["g1", "g3"])
    assert [op.grads for op in trace.ops][1] == ("g1",) and trace.ops[3].grads == ("g3",)
    assert trace.ops[2].grads in (None, ())
    trace2 = mlp_trace[0].fork()
    state2 = sdk.keep_for_backward(trace2, None, False, _is_arr)
    sdk.store_grads(trace2, state2, keys, ["x", "y"])
    assert trace2.ops[1].grads != ("x",)
    assert sdk.by_event([(1, 0), (1, 2), (4, 0)], "abc") == {1: {0: "a", 2: "b"}, 4: {0: "c"}}


def test_backward_state_refusals_in_order(mlp_trace):
    trace, _x, _p = mlp_trace
    with pytest.raises(InvalidArgumentError) as e:
        sdk.backward_state(trace, None, {}, backend="toy")
    assert e.value.code == "backward_not_requested"
    state = sdk.keep_for_backward(trace, None, True, _is_arr)
    assert sdk.backward_state(trace, None, {}, backend="toy") is state
    with pytest.raises(InvalidArgumentError) as e:
        sdk.backward_state(trace, None, {"retain": True}, backend="toy")
    assert e.value.code == "invalid_argument" and "toy backend's backward takes no retain=" in str(e.value)
    with pytest.raises(InvalidArgumentError) as e:
        sdk.backward_state(trace, 3.0, {}, backend="toy", loss_note="why")
    assert e.value.code == "invalid_argument" and "not float (why)" in str(e.value)
    # a fork shares the slot but is not the trace the state names
    fork = trace.fork()
    fork.backend_state = state
    with pytest.raises(InvalidArgumentError) as e:
        sdk.backward_state(fork, None, {}, backend="toy")
    assert e.value.code == "backward_not_requested" and "fork" in str(e.value)

    class Plan:
        by_event: dict = {}
        grad_by_event = {1: ["edit"]}

    sdk.keep_for_backward(trace, None, True, _is_arr, Plan())
    assert trace.backend_state.edit_plan is not None
    with pytest.raises(InvalidArgumentError, match="gradient edits are not supported by the toy backend"):
        sdk.backward_state(trace, None, {}, backend="toy")
    Plan.grad_by_event = {}
    assert sdk.keep_for_backward(trace, None, True, _is_arr, Plan()).edit_plan is None  # nothing edited: no plan


def test_perturbed_replay_applies_forward_edits_where_the_capture_did(mlp_trace):
    from torchlens.intervention.numpy_ops import NumpyEditOps

    trace, x, p = mlp_trace
    relu = next(op for op in trace.ops if op.label.startswith("relu"))

    class Plan:  # the live edit plan's members perturbed_replay reads
        by_event = {relu.event_id: [tl.scale(3.0)]}
        grad_by_event: dict = {}
        labels = {relu.event_id: relu.label}
        ops = NumpyEditOps()
        run_state = None

    state = sdk.keep_for_backward(trace, None, True, _is_arr, Plan())
    d = np.full((3, 8), 0.5, np.float32)
    leaves = sdk.perturbed_replay(trace, state, _replayer(trace), {relu.event_id: {0: d}},
                                  params=sdk.param_values(trace), is_leaf=_is_arr)
    # the edit runs on the replayed value, the perturbation is added after it
    h = np.maximum(x @ p["0.weight"].T + p["0.bias"], 0)
    np.testing.assert_allclose(leaves[0], (3 * h + d) @ p["2.weight"].T + p["2.bias"], rtol=1e-5)
    # only leaves the backend's is_leaf accepts are edited
    leaves = sdk.perturbed_replay(trace, state, _replayer(trace), {}, params=sdk.param_values(trace),
                                  is_leaf=lambda v: False)
    np.testing.assert_allclose(leaves[0], _hand(x, p), rtol=1e-5)
