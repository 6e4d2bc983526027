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
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from torchlens.backends.sdk import InvalidArgumentError, Replayer, param_values

_SOURCES = ("input", "buffer", "constant")


@dataclass
class GradState:
    out_template: Any
    save_grads: bool
    sources: dict[int, tuple[Any, ...]]
    owner: "weakref.ref[Any]"
    edit_plan: Any = None


class _Leaf:
    def __init__(self, index: int) -> None:
        self.index = index


def out_template(out: Any, counter: list[int] | None = None) -> Any:
    """The output structure with each array leaf replaced by its position."""
    counter = [0] if counter is None else counter
    if isinstance(out, mx.array):
        counter[0] += 1
        return _Leaf(counter[0] - 1)
    if isinstance(out, (tuple, list)):
        return type(out)(out_template(o, counter) for o in out)
    if isinstance(out, dict):
        return {k: out_template(v, counter) for k, v in out.items()}
    return out


def _rebuild(template: Any, leaves: list[Any]) -> Any:
    if isinstance(template, _Leaf):
        return leaves[template.index]
    if isinstance(template, (tuple, list)):
        return type(template)(_rebuild(t, leaves) for t in template)
    if isinstance(template, dict):
        return {k: _rebuild(v, leaves) for k, v in template.items()}
    return template


def keep_for_backward(trace: Any, out: Any, save_grads: bool, edit_plan: Any = None) -> None:
    sources = {op.event_id: tuple(op.outs) for op in trace.ops if op.kind in _SOURCES}
    plan = edit_plan if edit_plan is not None and (edit_plan.by_event or edit_plan.grad_by_event) else None
    trace.backend_state = GradState(out_template(out), save_grads, sources, weakref.ref(trace), plan)


def _inexact(dtype_name: str) -> bool:
    return dtype_name in ("float16", "float32", "float64", "bfloat16", "complex64")


def _forward_edits(plan: Any, eid: int, outs: list[Any]) -> list[Any]:
    from torchlens.backends.sdk import HookContext, fire

    for edit in plan.by_event[eid]:
        for i, v in enumerate(outs):
            if isinstance(v, mx.array):
                ctx = HookContext(plan.labels.get(eid, str(eid)), None, None, plan.ops, run_state=plan.run_state)
                outs[i] = fire(edit, v, ctx)
    return outs


def backward(trace: Any, loss: Any = None, **kwargs: Any) -> None:
    """Fill `op.grads` for the saved ops of a trace captured for a backward (module doc)."""
    from torchlens_mlx.edit_ops import MLXEditOps

    if kwargs:
        raise InvalidArgumentError("invalid_argument", f"the mlx backend's backward takes no {', '.join(sorted(kwargs))}=",
                                   remedy="trace.backward(loss) with loss a callable of the model output",
                                   options=sorted(kwargs))
    state = trace.backend_state
    if not isinstance(state, GradState) or state.owner() is not trace:
        raise InvalidArgumentError("backward_not_requested", "this trace was not captured for a backward pass "
                                   "(or it is a fork or a loaded trace, which keep no backward state)",
                                   remedy="capture with capture=CaptureOptions(backward_ready=True, save_grads=True)",
                                   fork=isinstance(state, GradState))
    if loss is not None and not callable(loss):
        raise InvalidArgumentError("invalid_argument", f"the mlx backend's backward takes a callable of the model output, "
                                   f"not {type(loss).__name__} (an mx.array carries no graph to differentiate)",
                                   remedy="trace.backward(lambda out: (out ** 2).sum()), or trace.backward(None) for the "
                                          "sum of its float leaves", loss_type=type(loss).__name__)
    plan = state.edit_plan
    if plan is not None and plan.grad_by_event:
        raise InvalidArgumentError("invalid_argument", "gradient edits are not supported by the mlx backend (preview)",
                                   remedy="edit forward values only, or use the torch or jax backend for gradient edits")
    ops = list(trace.ops)
    keys = [(op.event_id, k) for op in ops if op.kind in (*_SOURCES, "op", "output")
            for k, d in enumerate(op.dtypes) if _inexact(str(d))]
    shapes = {op.event_id: op.shapes for op in ops}
    dtypes = {op.event_id: op.dtypes for op in ops}
    eps0 = [mx.zeros(tuple(shapes[e][k]), getattr(mx, str(dtypes[e][k]))) for e, k in keys]
    params = param_values(trace)
    replayer = Replayer(trace, MLXEditOps())
    fwd_edited = set(plan.by_event) if plan is not None else set()

    def objective(*eps_list: Any) -> Any:
        eps: dict[int, dict[int, Any]] = {}
        for (e, k), v in zip(keys, eps_list):
            eps.setdefault(e, {})[k] = v
        vals: dict[int, list[Any]] = {}
        by_label: dict[str, tuple[Any, ...]] = {}
        for op in ops:
            if op.kind in _SOURCES:
                outs = list(state.sources[op.event_id])
            elif op.kind == "output":
                pid, slot = op.parent_slots[0]
                outs = [vals[pid][slot]]
            elif op.kind == "op":
                outs = list(replayer.run(op, override=params, changed=by_label))
            else:
                continue
            if op.event_id in fwd_edited and op.kind in ("op", "output"):
                outs = _forward_edits(plan, op.event_id, outs)
            for k, e in (eps.get(op.event_id) or {}).items():
                outs[k] = outs[k] + e
            vals[op.event_id] = outs
            by_label[op.label] = tuple(outs)
        leaves = [vals[o.event_id][0] for o in trace.output_ops]
        if loss is None:
            floats = [mx.sum(v) for v in leaves if _inexact(str(v.dtype).replace("mlx.core.", ""))]
            if not floats:
                raise InvalidArgumentError("invalid_argument", "the model's output has no floating-point leaf",
                                           remedy="pass loss=, a callable of the output returning a float scalar")
            value = floats[0]
            for f in floats[1:]:
                value = value + f
        else:
            value = loss(_rebuild(state.out_template, leaves))
        if not isinstance(value, mx.array) or value.shape != () or not _inexact(str(value.dtype).replace("mlx.core.", "")):
            raise InvalidArgumentError("invalid_argument", f"loss(output) returned {type(value).__name__} "
                                       f"{getattr(value, 'shape', '')}, not a float scalar",
                                       remedy="reduce the loss to a scalar, for example with .sum()")
        return value

    _value, cot = mx.vjp(objective, eps0, [mx.array(1.0)])
    mx.eval(cot)
    if not state.save_grads:
        return None
    grads: dict[int, dict[int, Any]] = {}
    for (e, k), g in zip(keys, cot):
        grads.setdefault(e, {})[k] = g
    for op in ops:
        slots = grads.get(op.event_id)
        if slots is None or not op.saved:
            continue
        op.grads = tuple(slots.get(k) for k in range(len(op.shapes)))
    return None


__all__ = ["backward", "keep_for_backward", "GradState"]
