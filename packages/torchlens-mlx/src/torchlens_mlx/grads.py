"""Gradients of an MLX trace: `mx.vjp` over the recorded ops.

A capture made with `CaptureOptions(backward_ready=True, save_grads=True)` keeps the values
of its source ops (inputs, constants) and the shape of its output here, before `save=` drops
any payload. `trace.backward(loss)` re-executes the recorded ops through core's replay engine
as one function of a zero perturbation added to every op output, and pulls the cotangent of
`loss(output)` back with `mx.vjp`. The cotangent of an op's perturbation is the gradient of
the loss with respect to that op's output. Each saved op's `grads` gets one entry per output
slot (`None` for an integer or boolean slot).

The state lives in `trace.backend_state` and names the trace it was made for: a fork shares
the slot but is not that trace, and a loaded trace has none; for both `backward` refuses with
`backward_not_requested`. A live-edited capture replays its forward edits where the capture
applied them; gradient edits are not supported here and refuse.

The walk itself (kept sources, perturbed replay, loss, stored gradients) is the SDK's
(`torchlens.backends.sdk_grads`); only the autodiff call (`mx.vjp`) is this backend's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

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


def _is_array(v: Any) -> bool:
    return isinstance(v, mx.array)


def _inexact(dtype_name: str) -> bool:
    return dtype_name in ("float16", "float32", "float64", "bfloat16", "complex64")


def _float_leaf(v: Any) -> bool:
    return _inexact(str(v.dtype).replace("mlx.core.", ""))


def _float_scalar(v: Any) -> bool:
    return isinstance(v, mx.array) and v.shape == () and _float_leaf(v)


def keep_for_backward(trace: Any, out: Any, save_grads: bool, edit_plan: Any = None) -> None:
    _keep(trace, out, save_grads, _is_array, edit_plan)


def backward(trace: Any, loss: Any = None, **kwargs: Any) -> None:
    """Fill `op.grads` for the saved ops of a trace captured for a backward (module doc)."""
    from torchlens_mlx.edit_ops import MLXEditOps

    state = backward_state(trace, loss, kwargs, backend="mlx", loss_note="an mx.array carries no graph to differentiate")
    keys = grad_keys(trace.ops, _inexact)
    shapes = {op.event_id: op.shapes for op in trace.ops}
    dtypes = {op.event_id: op.dtypes for op in trace.ops}
    eps0 = [mx.zeros(tuple(shapes[e][k]), getattr(mx, str(dtypes[e][k]))) for e, k in keys]
    params = param_values(trace)
    replayer = Replayer(trace, MLXEditOps())

    def objective(*eps_list: Any) -> Any:
        leaves = perturbed_replay(trace, state, replayer, by_event(keys, eps_list), params=params, is_leaf=_is_array)
        return loss_value(state, leaves, loss, is_float_leaf=_float_leaf, reduce_sum=mx.sum,
                          is_float_scalar=_float_scalar)

    _value, cot = mx.vjp(objective, eps0, [mx.array(1.0)])
    mx.eval(cot)
    store_grads(trace, state, keys, cot)
    return None


__all__ = ["backward", "keep_for_backward", "GradState"]
