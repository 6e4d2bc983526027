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

(Twin of `torchlens_mlx.grads`: the walk over the ops with perturbations is the same; only
the differentiation call differs. An SDK helper `perturbed_replay(trace, ops, sources, eps)`
returning the output leaves would serve both: see the notes.)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from torchlens.backends.sdk import InvalidArgumentError, Replayer, param_values

_SOURCES = ("input", "buffer", "constant")


@dataclass
class GradState:
    out_template: Any
    save_grads: bool
    sources: dict[int, tuple[Any, ...]]
    owner: "weakref.ref[Any]"


class _Leaf:
    def __init__(self, index: int) -> None:
        self.index = index


def out_template(out: Any, counter: list[int] | None = None) -> Any:
    """The output structure with each tensor leaf replaced by its position."""
    counter = [0] if counter is None else counter
    if isinstance(out, tf.Tensor):
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


def keep_for_backward(trace: Any, out: Any, save_grads: bool) -> None:
    sources = {op.event_id: tuple(op.outs) for op in trace.ops if op.kind in _SOURCES}
    trace.backend_state = GradState(out_template(out), save_grads, sources, weakref.ref(trace))


def _inexact(dtype_name: str) -> bool:
    return dtype_name in ("float16", "float32", "float64", "bfloat16", "complex64", "complex128")


def backward(trace: Any, loss: Any = None, **kwargs: Any) -> None:
    """Fill `op.grads` for the saved ops of a trace captured for a backward (module doc)."""
    from torchlens_tf.edit_ops import TFEditOps

    if kwargs:
        raise InvalidArgumentError("invalid_argument", f"the tf backend's backward takes no {', '.join(sorted(kwargs))}=",
                                   remedy="trace.backward(loss) with loss a callable of the model output",
                                   options=sorted(kwargs))
    state = trace.backend_state
    if not isinstance(state, GradState) or state.owner() is not trace:
        raise InvalidArgumentError("backward_not_requested", "this trace was not captured for a backward pass "
                                   "(or it is a fork or a loaded trace, which keep no backward state)",
                                   remedy="capture with capture=CaptureOptions(backward_ready=True, save_grads=True)",
                                   fork=isinstance(state, GradState))
    if loss is not None and not callable(loss):
        raise InvalidArgumentError("invalid_argument", f"the tf backend's backward takes a callable of the model output, "
                                   f"not {type(loss).__name__} (a tf.Tensor computed outside a tape carries no graph)",
                                   remedy="trace.backward(lambda out: tf.reduce_sum(out ** 2)), or trace.backward(None) "
                                          "for the sum of its float leaves", loss_type=type(loss).__name__)
    ops = list(trace.ops)
    keys = [(op.event_id, k) for op in ops if op.kind in (*_SOURCES, "op", "output")
            for k, d in enumerate(op.dtypes) if _inexact(str(d))]
    shapes = {op.event_id: op.shapes for op in ops}
    dtypes = {op.event_id: op.dtypes for op in ops}
    eps0 = [tf.zeros(tuple(shapes[e][k]), dtype=tf.as_dtype(str(dtypes[e][k]))) for e, k in keys]
    params = param_values(trace)
    replayer = Replayer(trace, TFEditOps())
    with tf.GradientTape() as tape:
        for e in eps0:
            tape.watch(e)
        eps: dict[int, dict[int, Any]] = {}
        for (e, k), v in zip(keys, eps0):
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
            for k, e in (eps.get(op.event_id) or {}).items():
                outs[k] = outs[k] + e
            vals[op.event_id] = outs
            by_label[op.label] = tuple(outs)
        leaves = [vals[o.event_id][0] for o in trace.output_ops]
        if loss is None:
            floats = [tf.reduce_sum(v) for v in leaves if _inexact(v.dtype.name)]
            if not floats:
                raise InvalidArgumentError("invalid_argument", "the model's output has no floating-point leaf",
                                           remedy="pass loss=, a callable of the output returning a float scalar")
            value = tf.add_n(floats) if len(floats) > 1 else floats[0]
        else:
            value = loss(_rebuild(state.out_template, leaves))
    if not isinstance(value, tf.Tensor) or tuple(value.shape) != () or not _inexact(value.dtype.name):
        raise InvalidArgumentError("invalid_argument", f"loss(output) returned {type(value).__name__} "
                                   f"{getattr(value, 'shape', '')}, not a float scalar",
                                   remedy="reduce the loss to a scalar, for example with tf.reduce_sum")
    cot = tape.gradient(value, eps0, unconnected_gradients=tf.UnconnectedGradients.ZERO)
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
