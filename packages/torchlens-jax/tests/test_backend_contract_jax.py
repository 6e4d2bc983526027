"""JAX gradients and RNG replay (issue 14 §8), and the capabilities declared for them.

Gradients: with `CaptureOptions(backward_ready=True, save_grads=True)`, `trace.backward(loss)`
fills each saved op's gradient by `jax.vjp` over the evaluated jaxpr. The oracle is
`jax.grad` written by hand for each intermediate of the MLP (the model's own weights and
the part of the forward downstream of that op), independent of the recorded graph.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("equinox")

import jax.numpy as jnp  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.errors import BackendUnsupportedError, InvalidArgumentError  # noqa: E402
from torchlens_jax import zoo as Z  # noqa: E402

X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
GRADS = tl.CaptureOptions(backward_ready=True, save_grads=True)


def loss(y):
    return jnp.sum(jnp.sin(3.0 * y) * y)  # not linear: the gradient depends on the values


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def _mlp_hand_grads(m):
    """label -> (value at that op, d loss / d value by jax.grad of the hand-written rest)."""
    W1, b1 = m.fc1.kernel[...], m.fc1.bias[...]
    W2, b2 = m.fc2.kernel[...], m.fc2.bias[...]
    d1 = X @ W1
    r1 = b1.reshape(1, 8)
    h = d1 + r1
    r = jnp.maximum(h, 0.0)
    d2 = r @ W2
    r2 = b2.reshape(1, 2)
    y = d2 + r2
    return {
        "input_1": jax.grad(lambda x: loss(jnp.maximum(x @ W1 + r1, 0.0) @ W2 + r2))(X),
        "dotgeneral_1_1": jax.grad(lambda d: loss(jnp.maximum(d + r1, 0.0) @ W2 + r2))(d1),
        "reshape_1_2": jax.grad(lambda b: loss(jnp.maximum(d1 + b, 0.0) @ W2 + r2))(r1),
        "add_1_3": jax.grad(lambda v: loss(jnp.maximum(v, 0.0) @ W2 + r2))(h),
        "max_1_4": jax.grad(lambda v: loss(v @ W2 + r2))(r),
        "dotgeneral_2_5": jax.grad(lambda d: loss(d + r2))(d2),
        "reshape_2_6": jax.grad(lambda b: loss(d2 + b))(r2),
        "add_2_7": jax.grad(loss)(y),
        "output_1": jax.grad(loss)(y),
    }


def test_every_saved_op_gradient_of_the_mlp_equals_jax_grad_by_hand():
    m = Z.MLP()
    t = tl.trace(m, X, backend="jax", capture=GRADS)
    assert t.backward(loss) is None
    hand = _mlp_hand_grads(m)
    assert sorted(hand) == sorted(op.label for op in t.ops if op.saved)  # every saved op is checked
    for label, expected in hand.items():
        op = t.ops[label]
        assert op.grad.shape == expected.shape and op.grad.dtype == expected.dtype, label
        _close(op.grad, expected)
    assert float(jnp.abs(t.ops["add_1_3"].grad).sum()) > 0  # not vacuous


def test_gradients_follow_save_and_reach_only_saved_ops():
    m = Z.MLP()
    t = tl.trace(m, X, backend="jax", capture=GRADS, save=tl.func("max"))
    t.backward(loss)
    assert [op.label for op in t.ops if op.has_grad] == ["max_1_4"]
    _close(t.ops["max_1_4"].grad, _mlp_hand_grads(m)["max_1_4"])


def test_equinox_and_attention_input_gradients_equal_jax_grad():
    for m, x in ((Z.EqxMLP(jax.random.PRNGKey(5)), X[0]), (Z.AttentionBlock(), jnp.sin(jnp.arange(160.0)).reshape(2, 5, 16))):
        t = tl.trace(m, x, backend="jax", capture=GRADS)
        t.backward(loss)
        want_in = np.asarray(jax.grad(lambda v: loss(m(v)))(x))
        want_out = np.asarray(jax.grad(loss)(m(x)))
        assert np.allclose(np.asarray(t.input_ops[0].grad), want_in, rtol=1e-6, atol=1e-6)
        assert np.allclose(np.asarray(t.output_ops[0].grad), want_out, rtol=1e-6, atol=1e-6)
        assert np.abs(want_in).max() > 0  # a real gradient, not a zero both sides agree on


def test_random_draws_are_differentiated_through_their_recorded_key():
    m = Z.RandomNet()
    key = jax.random.PRNGKey(7)
    t = tl.trace(m, X, backend="jax", capture=GRADS, input_kwargs={"key": key})
    t.backward(loss)
    by_path = {op.path: op for op in t.input_ops}
    _close(by_path["args[0]"].grad, jax.grad(lambda v: loss(m(v, key)))(X))
    key_op = next(op for op in t.input_ops if op.dtypes[0] != "float32")
    assert key_op.grads == (None,)  # an integer key has no gradient


def test_backward_refusals():
    m = Z.MLP()
    plain = tl.trace(m, X, backend="jax")
    with pytest.raises(InvalidArgumentError) as exc:
        plain.backward(loss)
    assert exc.value.code == "backward_not_requested"
    t = tl.trace(m, X, backend="jax", capture=GRADS)
    with pytest.raises(InvalidArgumentError) as exc:
        t.backward(t.output_ops[0].out.sum())  # an array has no graph: say so, typed
    assert exc.value.code == "invalid_argument" and "callable" in exc.value.remedy
    with pytest.raises(InvalidArgumentError) as exc:
        t.backward(lambda y: y)  # not a scalar
    assert exc.value.code == "invalid_argument"
    assert not any(op.has_grad for op in t.ops)  # nothing was written by a refused call
    with pytest.raises(InvalidArgumentError) as exc:
        t.fork().backward(loss)
    assert exc.value.code == "backward_not_requested"


def test_loaded_trace_has_no_backward_state(tmp_path):
    t = tl.trace(Z.MLP(), X, backend="jax", capture=GRADS)
    t.save(tmp_path / "m.tlspec")
    loaded = tl.load(tmp_path / "m.tlspec")
    with pytest.raises(InvalidArgumentError) as exc:
        loaded.backward(loss)
    assert exc.value.code == "backward_not_requested"


# RNG replay ----------------------------------------------------------------------------------

def test_rng_replay_is_declared_and_replay_rng_is_accepted():
    proto = tl.backends.get_protocol("jax")
    caps = proto.capabilities()
    assert caps.rng_replay and caps.backward_capture and caps.interventions
    assert "rng_replay_unsupported" not in proto.refusal_codes()
    assert "backward_capture_unsupported" not in proto.refusal_codes()
    m, key = Z.RandomNet(), jax.random.PRNGKey(3)
    t = tl.trace(m, X, backend="jax", replay_rng=True, input_kwargs={"key": key})
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(m(X, key)))
    with pytest.raises(InvalidArgumentError) as exc:
        tl.trace(m, X, backend="jax", replay_rng="yes", input_kwargs={"key": key})
    assert exc.value.code == "invalid_argument"


def test_random_ops_replay_exactly_from_their_recorded_key():
    m = Z.RandomNet()
    t = tl.trace(m, X, backend="jax", input_kwargs={"key": jax.random.PRNGKey(11)})
    status = t._backend.validate(t)
    assert status.ok
    random_ops = [op for op in t.ops if op.kind == "op" and op.func_name in ("random_bits", "threefry2x32")]
    assert random_ops  # the draw is recorded op by op, fed by the key input
    # the replay really reads the recorded key: another key's draw no longer matches
    key_op = next(op for op in t.input_ops if op.dtypes[0] != "float32")
    other = jnp.asarray(jax.random.PRNGKey(12), dtype=key_op.out.dtype)
    key_op._outputs = (other,)
    status = t._backend.validate(t)
    assert not status.ok and status.reason == "replay_mismatch"


def test_capability_cells_follow_the_declaration():
    from torchlens_conformance.cells import cells_for

    ids = set(cells_for(tl.backends.get_protocol("jax")))
    assert "c1_refusal_backward_capture" not in ids and "c1_refusal_rng_replay" not in ids
    assert "c1_refusal_interventions" not in ids and "c1_refusal_trace_option_replay_rng" not in ids
    with pytest.raises(BackendUnsupportedError) as exc:
        tl.trace(Z.MLP(), X, backend="jax", grad_options=tl.backends.jax.GradOptions())
    assert exc.value.code == "intermediate_derived_grads_unsupported"
