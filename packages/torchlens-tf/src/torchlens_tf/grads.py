"""Gradients of a TensorFlow trace: `tf.GradientTape` over the recorded ops.

A capture made with `CaptureOptions(backward_ready=True, save_grads=True)` keeps the values
of its source ops (inputs, constants) and the structure of its output here, before `save=`
drops any payload. `trace.backward(loss)` re-executes the recorded ops through core's replay
engine with a zero perturbation added to every float op output, under a `tf.GradientTape`
that watches the perturbations (each replayed kernel records its gradient as TensorFlow's
generated op wrappers do: `torchlens_tf.ops.RawOp`), and asks the tape for the gradient of
`loss(output)` with respect to every perturbation: the gradient of the loss with respect to
that op's output. Each saved op's `grads` gets one entry per output slot (`None` for an
integer or boolean slot).

The state lives in `trace.backend_state` and names the trace it was made for: a fork shares
the slot but is not that trace, and a loaded trace has none; for both `backward` refuses with
`backward_not_requested`.

The walk itself (kept sources, perturbed replay, loss, stored gradients) is the SDK's
(`torchlens.backends.sdk_grads`); only the autodiff call (`tf.GradientTape`) is this backend's.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from torchlens.backends.sdk import (
    GradState,
    Replayer,
    backward_state,
    by_event,
    grad_keys,
    loss_value,
    param_values,
    perturbed_replay,
    store_grads,
)
from torchlens.backends.sdk import keep_for_backward as _keep


def _is_tensor(v: Any) -> bool:
    return isinstance(v, tf.Tensor)


def _inexact(dtype_name: str) -> bool:
    return dtype_name in ("float16", "float32", "float64", "bfloat16", "complex64", "complex128")


def _float_leaf(v: Any) -> bool:
    return _inexact(v.dtype.name)


def _float_scalar(v: Any) -> bool:
    return isinstance(v, tf.Tensor) and tuple(v.shape) == () and _inexact(v.dtype.name)


def keep_for_backward(trace: Any, out: Any, save_grads: bool) -> None:
    _keep(trace, out, save_grads, _is_tensor)


def backward(trace: Any, loss: Any = None, **kwargs: Any) -> None:
    """Fill `op.grads` for the saved ops of a trace captured for a backward (module doc)."""
    from torchlens_tf.edit_ops import TFEditOps

    state = backward_state(trace, loss, kwargs, backend="tf",
                           loss_note="a tf.Tensor computed outside a tape carries no graph",
                           loss_remedy="trace.backward(lambda out: tf.reduce_sum(out ** 2)), or trace.backward(None) "
                                       "for the sum of its float leaves")
    keys = grad_keys(trace.ops, _inexact)
    shapes = {op.event_id: op.shapes for op in trace.ops}
    dtypes = {op.event_id: op.dtypes for op in trace.ops}
    eps0 = [tf.zeros(tuple(shapes[e][k]), dtype=tf.as_dtype(str(dtypes[e][k]))) for e, k in keys]
    replayer = Replayer(trace, TFEditOps())
    with tf.GradientTape() as tape:
        for e in eps0:
            tape.watch(e)
        leaves = perturbed_replay(trace, state, replayer, by_event(keys, eps0), params=param_values(trace),
                                  is_leaf=_is_tensor)
        value = loss_value(state, leaves, loss, is_float_leaf=_float_leaf, reduce_sum=tf.reduce_sum,
                           is_float_scalar=_float_scalar,
                           scalar_remedy="reduce the loss to a scalar, for example with tf.reduce_sum")
    cot = tape.gradient(value, eps0, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    store_grads(trace, state, keys, cot)
    return None


__all__ = ["backward", "keep_for_backward", "GradState"]
