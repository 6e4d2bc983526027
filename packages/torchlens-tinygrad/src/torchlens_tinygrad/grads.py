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

Twin: `torchlens_mlx.grads` (the same walk with `mx.vjp`). The generic part (output
template, source values, the perturbed replay walk) is a candidate SDK helper
(`sdk.perturbed_replay(trace, ops, eps, sources, loss)`; see the package README notes).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinygrad import Tensor

from torchlens.backends.sdk import InvalidArgumentError, Replayer, param_values
from torchlens_tinygrad.backend import realize

_SOURCES = ("input", "buffer", "constant")
_FLOATS = ("float16", "float32", "float64", "half", "float", "double", "bfloat16")


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
    """The output structure with each tensor leaf replaced by its position."""
    counter = [0] if counter is None else counter
    if isinstance(out, Tensor):
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
    return str(dtype_name).replace("dtypes.", "") in _FLOATS


def _forward_edits(plan: Any, eid: int, outs: list[Any]) -> list[Any]:
    from torchlens.backends.sdk import HookContext, fire

    for edit in plan.by_event[eid]:
        for i, v in enumerate(outs):
            if isinstance(v, Tensor):
                ctx = HookContext(plan.labels.get(eid, str(eid)), None, None, plan.ops, run_state=plan.run_state)
                outs[i] = fire(edit, v, ctx)
    return outs


def backward(trace: Any, loss: Any = None, **kwargs: Any) -> None:
    """Fill `op.grads` for the saved ops of a trace captured for a backward (module doc)."""
    from torchlens_tinygrad.edit_ops import TinygradEditOps

    if kwargs:
        raise InvalidArgumentError("invalid_argument", f"the tinygrad backend's backward takes no {', '.join(sorted(kwargs))}=",
                                   remedy="trace.backward(loss) with loss a callable of the model output",
                                   options=sorted(kwargs))
    state = trace.backend_state
    if not isinstance(state, GradState) or state.owner() is not trace:
        raise InvalidArgumentError("backward_not_requested", "this trace was not captured for a backward pass "
                                   "(or it is a fork or a loaded trace, which keep no backward state)",
                                   remedy="capture with capture=CaptureOptions(backward_ready=True, save_grads=True)",
                                   fork=isinstance(state, GradState))
    if loss is not None and not callable(loss):
        raise InvalidArgumentError("invalid_argument", f"the tinygrad backend's backward takes a callable of the model "
                                   f"output, not {type(loss).__name__} (a realized Tensor carries no graph to differentiate)",
                                   remedy="trace.backward(lambda out: (out ** 2).sum()), or trace.backward(None) for the "
                                          "sum of its float leaves", loss_type=type(loss).__name__)
    plan = state.edit_plan
    if plan is not None and plan.grad_by_event:
        raise InvalidArgumentError("invalid_argument", "gradient edits are not supported by the tinygrad backend (preview)",
                                   remedy="edit forward values only, or use the torch or jax backend for gradient edits")
    ops = list(trace.ops)
    keys = [(op.event_id, k) for op in ops if op.kind in (*_SOURCES, "op", "output")
            for k, d in enumerate(op.dtypes) if _inexact(str(d))]
    shapes = {op.event_id: op.shapes for op in ops}
    eps_list = []
    for e, k in keys:
        t = Tensor(np.zeros(tuple(shapes[e][k]), np.float32))
        realize(t)
        eps_list.append(t)
    params = param_values(trace)
    edit_ops = TinygradEditOps()
    edit_ops.lazy = True
    replayer = Replayer(trace, edit_ops)
    fwd_edited = set(plan.by_event) if plan is not None else set()
    eps: dict[int, dict[int, Any]] = {}
    for (e, k), v in zip(keys, eps_list):
        eps.setdefault(e, {})[k] = v
    vals: dict[int, list[Any]] = {}
    by_label: dict[str, tuple[Any, ...]] = {}
    TinygradEditOps.lazy_edits = True
    try:
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
                outs[k] = outs[k] + e.cast(outs[k].dtype)
            vals[op.event_id] = outs
            by_label[op.label] = tuple(outs)
    finally:
        TinygradEditOps.lazy_edits = False
    leaves = [vals[o.event_id][0] for o in trace.output_ops]
    if loss is None:
        floats = [v.sum() for v in leaves if _inexact(str(v.dtype))]
        if not floats:
            raise InvalidArgumentError("invalid_argument", "the model's output has no floating-point leaf",
                                       remedy="pass loss=, a callable of the output returning a float scalar")
        value = floats[0]
        for f in floats[1:]:
            value = value + f
    else:
        value = loss(_rebuild(state.out_template, leaves))
    if not isinstance(value, Tensor) or tuple(value.shape) != () or not _inexact(str(value.dtype)):
        raise InvalidArgumentError("invalid_argument", f"loss(output) returned {type(value).__name__} "
                                   f"{getattr(value, 'shape', '')}, not a float scalar",
                                   remedy="reduce the loss to a scalar, for example with .sum()")
    cot = list(value.gradient(*eps_list))
    realize(*cot)
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
