"""Gradients of a tinygrad trace: tinygrad's autodiff (`Tensor.gradient`, the machinery
`Tensor.backward` runs) over the recorded ops.

A capture made with `CaptureOptions(backward_ready=True, save_grads=True)` keeps the values
of its source ops (inputs, constants) and the structure of its output here, before `save=`
drops any payload. `trace.backward(loss)` re-executes the recorded ops through core's replay
engine, lazily (a realized tensor has no graph), as one function of a zero perturbation
added to every float op output, and differentiates `loss(output)` with respect to those
perturbations: the gradient at an op's perturbation is the gradient of the loss with respect
to that op's output. Each saved op's `grads` gets one entry per output slot (`None` for an
integer or boolean slot).

The state lives in `trace.backend_state` and names the trace it was made for: a fork shares
the slot but is not that trace, and a loaded trace has none; for both `backward` refuses with
`backward_not_requested`. A live-edited capture replays its forward edits where the capture
applied them; gradient edits are not supported here and refuse.

The walk itself (kept sources, perturbed replay, loss, stored gradients) is the SDK's
(`torchlens.backends.sdk_grads`); only the autodiff call (`Tensor.gradient`) and the lazy
replay switch are this backend's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tinygrad import Tensor

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
from torchlens_tinygrad.backend import realize

_FLOATS = ("float16", "float32", "float64", "half", "float", "double", "bfloat16")


def _is_tensor(v: Any) -> bool:
    return isinstance(v, Tensor)


def _inexact(dtype_name: str) -> bool:
    return str(dtype_name).replace("dtypes.", "") in _FLOATS


def _float_leaf(v: Any) -> bool:
    return _inexact(str(v.dtype))


def _float_scalar(v: Any) -> bool:
    return isinstance(v, Tensor) and tuple(v.shape) == () and _inexact(str(v.dtype))


def _add_cast(value: Any, eps: Any) -> Any:
    return value + eps.cast(value.dtype)


def keep_for_backward(trace: Any, out: Any, save_grads: bool, edit_plan: Any = None) -> None:
    _keep(trace, out, save_grads, _is_tensor, edit_plan)


def backward(trace: Any, loss: Any = None, **kwargs: Any) -> None:
    """Fill `op.grads` for the saved ops of a trace captured for a backward (module doc)."""
    from torchlens_tinygrad.edit_ops import TinygradEditOps

    state = backward_state(trace, loss, kwargs, backend="tinygrad",
                           loss_note="a realized Tensor carries no graph to differentiate")
    keys = grad_keys(trace.ops, _inexact)
    shapes = {op.event_id: op.shapes for op in trace.ops}
    eps_list = []
    for e, k in keys:
        t = Tensor(np.zeros(tuple(shapes[e][k]), np.float32))
        realize(t)
        eps_list.append(t)
    edit_ops = TinygradEditOps()
    edit_ops.lazy = True
    replayer = Replayer(trace, edit_ops)
    TinygradEditOps.lazy_edits = True
    try:
        leaves = perturbed_replay(trace, state, replayer, by_event(keys, eps_list), params=param_values(trace),
                                  is_leaf=_is_tensor, add=_add_cast)
    finally:
        TinygradEditOps.lazy_edits = False
    value = loss_value(state, leaves, loss, is_float_leaf=_float_leaf, reduce_sum=Tensor.sum,
                       is_float_scalar=_float_scalar)
    cot = list(value.gradient(*eps_list))
    realize(*cot)
    store_grads(trace, state, keys, cot)
    return None


__all__ = ["backward", "keep_for_backward", "GradState"]
