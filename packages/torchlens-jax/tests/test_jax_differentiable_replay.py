"""JAX differentiable replay: `trace.fork().do(site, edit, differentiable=True)` then
`fork.backward(loss)` differentiates the edited forward (issue 14 §8)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import jax.numpy as jnp  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens_jax import zoo as Z  # noqa: E402

X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
GRADS = tl.CaptureOptions(backward_ready=True, save_grads=True)
DIFF = tl.InterventionOptions(differentiable=True)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def loss(y):
    return jnp.sum(y ** 2)


def _close(a, b, tol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _parts(m):
    return m.fc1.kernel[...], m.fc1.bias[...], m.fc2.kernel[...], m.fc2.bias[...]


def test_a_differentiable_fork_backward_equals_jax_grad_of_the_edited_forward():
    m = Z.MLP()
    t = tl.trace(m, X, backend="jax", capture=GRADS)
    f = t.fork().do("max_1_4", tl.scale(0.5), intervention=DIFF)
    f.backward(loss)
    W1, b1, W2, b2 = _parts(m)
    h = X @ W1 + b1
    edited = lambda a: loss(0.5 * jnp.maximum(a, 0.0) @ W2 + b2)  # noqa: E731
    _close(f.ops["add_1_3"].grad, jax.grad(edited)(h))  # upstream of the edit: through the scale
    r = 0.5 * jnp.maximum(h, 0.0)
    _close(f.ops["max_1_4"].grad, jax.grad(lambda r: loss(r @ W2 + b2))(r))  # at the edited value
    _close(f.input_ops[0].grad, jax.grad(lambda x: loss(0.5 * jnp.maximum(x @ W1 + b1, 0.0) @ W2 + b2))(X))
    assert not np.allclose(np.asarray(f.ops["add_1_3"].grad),
                           np.asarray(jax.grad(lambda a: loss(jnp.maximum(a, 0.0) @ W2 + b2))(h)))  # edited, not clean
    assert not any(op.has_grad for op in t.ops)  # the root is untouched


def test_an_edited_input_and_a_later_plain_edit():
    m = Z.MLP()
    t = tl.trace(m, X, backend="jax", capture=GRADS)
    f = t.fork().do("input_1", tl.scale(2.0), intervention=DIFF)
    f.backward(loss)
    W1, b1, W2, b2 = _parts(m)
    _close(f.ops["add_2_7"].grad, jax.grad(loss)(jnp.maximum((2.0 * X) @ W1 + b1, 0.0) @ W2 + b2))
    f.do("max_1_4", tl.zero_ablate())  # a plain replay after: the kept replay no longer matches
    with pytest.raises(tl.errors.InvalidArgumentError) as exc:
        f.backward(loss)
    assert exc.value.code == "backward_not_requested"
    plain = t.fork().do("max_1_4", tl.scale(0.5))  # not differentiable: still refuses
    with pytest.raises(tl.errors.InvalidArgumentError):
        plain.backward(loss)
