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

Twin of `torchlens_mlx.grads` (the perturbation walk is the same; only the autodiff call
differs): an SDK helper `replay_with_perturbations(trace, ops, sources, eps, edit_plan)`
returning the replayed values would let both keep only their autodiff call.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from torchlens.backends.sdk import InvalidArgumentError, Replayer, param_values
from torchlens_paddle.patch import TENSOR, paddle

_SOURCES = ("input", "buffer", "constant")
_FLOATS = ("float16", "float32", "float64", "bfloat16")


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
    if isinstance(out, TENSOR):
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


def _forward_edits(plan: Any, eid: int, outs: list[Any]) -> list[Any]:
    from torchlens.backends.sdk import HookContext, fire

    for edit in plan.by_event[eid]:
        for i, v in enumerate(outs):
            if isinstance(v, TENSOR):
                ctx = HookContext(plan.labels.get(eid, str(eid)), None, None, plan.ops, run_state=plan.run_state)
                outs[i] = fire(edit, v, ctx)
    return outs


def backward(trace: Any, loss: Any = None, **kwargs: Any) -> None:
    """Fill `op.grads` for the saved ops of a trace captured for a backward (module doc)."""
    from torchlens_paddle.edit_ops import PaddleEditOps

    if kwargs:
        raise InvalidArgumentError("invalid_argument", f"the paddle backend's backward takes no {', '.join(sorted(kwargs))}=",
                                   remedy="trace.backward(loss) with loss a callable of the model output",
                                   options=sorted(kwargs))
    state = trace.backend_state
    if not isinstance(state, GradState) or state.owner() is not trace:
        raise InvalidArgumentError("backward_not_requested", "this trace was not captured for a backward pass "
                                   "(or it is a fork or a loaded trace, which keep no backward state)",
                                   remedy="capture with capture=CaptureOptions(backward_ready=True, save_grads=True)",
                                   fork=isinstance(state, GradState))
    if loss is not None and not callable(loss):
        raise InvalidArgumentError("invalid_argument", f"the paddle backend's backward takes a callable of the model "
                                   f"output, not {type(loss).__name__}",
                                   remedy="trace.backward(lambda out: (out ** 2).sum()), or trace.backward(None) for the "
                                          "sum of its float leaves", loss_type=type(loss).__name__)
    plan = state.edit_plan
    if plan is not None and plan.grad_by_event:
        raise InvalidArgumentError("invalid_argument", "gradient edits are not supported by the paddle backend (preview)",
                                   remedy="edit forward values only, or use the torch or jax backend for gradient edits")
    ops = list(trace.ops)
    keys = [(op.event_id, k) for op in ops if op.kind in (*_SOURCES, "op")
            for k, d in enumerate(op.dtypes) if str(d) in _FLOATS]
    eps = {}
    for e, k in keys:
        op = next(o for o in ops if o.event_id == e)
        z = paddle.zeros(list(op.shapes[k]), dtype=str(op.dtypes[k]))
        z.stop_gradient = False
        eps.setdefault(e, {})[k] = z
    params = param_values(trace)
    replayer = Replayer(trace, PaddleEditOps())
    fwd_edited = set(plan.by_event) if plan is not None else set()
    vals: dict[int, list[Any]] = {}
    by_label: dict[str, tuple[Any, ...]] = {}
    with paddle.set_grad_enabled(True):
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
            floats = [paddle.sum(v) for v in leaves if str(v.dtype).replace("paddle.", "") in _FLOATS]
            if not floats:
                raise InvalidArgumentError("invalid_argument", "the model's output has no floating-point leaf",
                                           remedy="pass loss=, a callable of the output returning a float scalar")
            value = floats[0]
            for f in floats[1:]:
                value = value + f
        else:
            value = loss(_rebuild(state.out_template, leaves))
        if not isinstance(value, TENSOR) or tuple(value.shape) != () or \
                str(value.dtype).replace("paddle.", "") not in _FLOATS:
            raise InvalidArgumentError("invalid_argument", f"loss(output) returned {type(value).__name__} "
                                       f"{getattr(value, 'shape', '')}, not a float scalar",
                                       remedy="reduce the loss to a scalar, for example with .sum()")
        flat = [eps[e][k] for e, k in keys]
        cot = paddle.grad([value], flat, allow_unused=True) if flat else []
    if not state.save_grads:
        return None
    grads: dict[int, dict[int, Any]] = {}
    for (e, k), g, z in zip(keys, cot, flat):
        grads.setdefault(e, {})[k] = paddle.zeros_like(z) if g is None else g.detach()
    for op in ops:
        slots = grads.get(op.event_id)
        if slots is None or not op.saved:
            continue
        op.grads = tuple(slots.get(k) for k in range(len(op.shapes)))
    return None


__all__ = ["backward", "keep_for_backward", "GradState"]
