"""Gradients of a paddle trace: `paddle.grad` over the recorded ops.

A capture made with `CaptureOptions(backward_ready=True, save_grads=True)` keeps the values
of its source ops (inputs, buffers, constants) and the structure of its output here, before
`save=` drops any payload. `trace.backward(loss)` re-executes the recorded ops through core's
replay engine with a zero perturbation (a tensor with `stop_gradient=False`) added to every
floating op output, and takes `paddle.grad` of `loss(output)` with respect to the
perturbations: the gradient at a perturbation is the gradient of the loss with respect to
that op's output. Each saved op's `grads` gets one entry per output slot (`None` for an
integer or boolean slot, or one the loss does not reach: zeros).

The state lives in `trace.backend_state` and names the trace it was made for: a fork shares
the slot but is not that trace, and a loaded trace has none; for both `backward` refuses with
`backward_not_requested`. Gradient edits refuse.

The walk itself (kept sources, perturbed replay, loss, stored gradients) is the SDK's
(`torchlens.backends.sdk_grads`); only the autodiff call (`paddle.grad`) is this backend's.
"""

from __future__ import annotations

from typing import Any

from torchlens.backends.sdk import (
    SOURCE_KINDS,
    GradState,
    Replayer,
    backward_state,
    grad_keys,
    loss_value,
    param_values,
    perturbed_replay,
    store_grads,
)
from torchlens.backends.sdk import keep_for_backward as _keep
from torchlens_paddle.patch import TENSOR, paddle

_FLOATS = ("float16", "float32", "float64", "bfloat16")


def _is_tensor(v: Any) -> bool:
    return isinstance(v, TENSOR)


def _is_float(dtype_name: str) -> bool:
    return dtype_name in _FLOATS


def _float_leaf(v: Any) -> bool:
    return str(v.dtype).replace("paddle.", "") in _FLOATS


def _float_scalar(v: Any) -> bool:
    return isinstance(v, TENSOR) and tuple(v.shape) == () and _float_leaf(v)


def keep_for_backward(trace: Any, out: Any, save_grads: bool, edit_plan: Any = None) -> None:
    _keep(trace, out, save_grads, _is_tensor, edit_plan)


def backward(trace: Any, loss: Any = None, **kwargs: Any) -> None:
    """Fill `op.grads` for the saved ops of a trace captured for a backward (module doc)."""
    from torchlens_paddle.edit_ops import PaddleEditOps

    state = backward_state(trace, loss, kwargs, backend="paddle")
    ops = list(trace.ops)
    keys = grad_keys(ops, _is_float, kinds=(*SOURCE_KINDS, "op"))
    by_id = {op.event_id: op for op in ops}
    eps: dict[int, dict[int, Any]] = {}
    for e, k in keys:
        op = by_id[e]
        z = paddle.zeros(list(op.shapes[k]), dtype=str(op.dtypes[k]))
        z.stop_gradient = False
        eps.setdefault(e, {})[k] = z
    replayer = Replayer(trace, PaddleEditOps())
    with paddle.set_grad_enabled(True):
        leaves = perturbed_replay(trace, state, replayer, eps, params=param_values(trace), is_leaf=_is_tensor)
        value = loss_value(state, leaves, loss, is_float_leaf=_float_leaf, reduce_sum=paddle.sum,
                           is_float_scalar=_float_scalar)
        flat = [eps[e][k] for e, k in keys]
        cot = paddle.grad([value], flat, allow_unused=True) if flat else []
    if not state.save_grads:
        return None
    store_grads(trace, state, keys, [paddle.zeros_like(z) if g is None else g.detach() for g, z in zip(cot, flat)])
    return None


__all__ = ["backward", "keep_for_backward", "GradState"]
