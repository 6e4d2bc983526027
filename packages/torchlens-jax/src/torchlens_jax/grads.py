"""Gradients of a JAX trace: `jax.vjp` over the evaluated jaxpr.

A capture made with `CaptureOptions(backward_ready=True, save_grads=True)` keeps the values
of its source ops (inputs, buffers, constants) and the output tree here, before `save=`
drops any payload. `trace.backward(loss)` then re-evaluates the recorded ops (the jaxpr as
the capture evaluated it: call primitives stepped into, control flow unrolled) as one
function of a zero perturbation added to every op output, and pulls the cotangent of
`loss(output)` back through it with `jax.vjp`. The cotangent of an op's perturbation is the
gradient of the loss with respect to that op's output: what `jax.grad` gives for the part of
the model downstream of the op. Each saved op's `grads` gets one entry per output slot
(`None` for a slot of an integer, boolean or key dtype); an op the loss does not depend on
gets zeros.

The state lives in the trace's backend-state slot (`trace.backend_state`, never on its
records) and names the trace it was made for: a fork shares the slot but is not that trace,
and a loaded trace has none, so for both `backward` refuses with `backward_not_requested`
(a fork's edited values are not what the kept sources would recompute).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from torchlens.backends.sdk import ArgRef, InvalidArgumentError, param_values

_SOURCES = ("input", "buffer", "constant")


@dataclass
class GradState:
    """What a backward needs that the trace's records may not keep."""

    out_tree: Any
    save_grads: bool
    sources: dict[int, tuple[Any, ...]]
    owner: "weakref.ref[Any]"  # the trace this state was captured for


def keep_for_backward(trace: Any, out_tree: Any, save_grads: bool) -> None:
    """Called by the capture, before the save plan releases payloads."""
    sources = {op.event_id: tuple(op.outs) for op in trace.ops if op.kind in _SOURCES}
    trace.backend_state = GradState(out_tree, save_grads, sources, weakref.ref(trace))


def _inexact(dtype_name: str) -> bool:
    try:
        return bool(jnp.issubdtype(jnp.dtype(dtype_name), jnp.inexact))
    except TypeError:  # a PRNG key dtype
        return False


def _default_loss(leaves: list[Any]) -> Any:
    total = None
    for leaf in leaves:
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            s = jnp.sum(leaf)
            total = s if total is None else total + s
    if total is None:
        raise InvalidArgumentError("invalid_argument", "the model's output has no floating-point leaf to differentiate",
                                   remedy="pass loss=, a callable of the output returning a float scalar")
    return total


def _evaluate(trace: Any, state: GradState, ops: list[Any], params: dict[str, Any]) -> Callable[[dict], Any]:
    """A function of the per-op perturbations returning the output pytree's leaves."""

    def run(eps: dict[int, tuple[Any, ...]]) -> list[Any]:
        vals: dict[int, list[Any]] = {}
        for op in ops:
            if op.kind in _SOURCES:
                outs = list(state.sources[op.event_id])
            elif op.kind == "output":
                pid, slot = op.parent_slots[0]
                outs = [vals[pid][slot]]
            elif op.kind == "op":
                parents = [vals[pid][slot] for pid, slot in op.parent_slots]
                args = []
                for a in op.args_template or ():
                    if isinstance(a, ArgRef):
                        args.append(params[a.address] if a.address is not None else jnp.asarray(parents[a.index]))
                    else:
                        args.append(a)
                got = op.func(*args)
                outs = list(got) if getattr(op.func, "multiple_results", False) else [got]
            else:
                continue
            for k, e in (eps.get(op.event_id) or {}).items():
                outs[k] = outs[k] + e
            vals[op.event_id] = outs
        return [vals[o.event_id][0] for o in trace.output_ops]

    return run


def backward(trace: Any, loss: Any = None, **kwargs: Any) -> None:
    """Fill `op.grads` for the saved ops of a trace captured for a backward (module doc)."""
    if kwargs:
        raise InvalidArgumentError("invalid_argument", f"the jax backend's backward takes no {', '.join(sorted(kwargs))}=",
                                   remedy="trace.backward(loss) with loss a callable of the model output",
                                   options=sorted(kwargs))
    state = trace.backend_state
    if not isinstance(state, GradState) or state.owner() is not trace:
        raise InvalidArgumentError("backward_not_requested", "this trace was not captured for a backward pass "
                                   "(or it is a fork or a loaded trace, which keep no backward state)",
                                   remedy="capture with capture=CaptureOptions(backward_ready=True, save_grads=True)")
    if loss is not None and not callable(loss):
        raise InvalidArgumentError("invalid_argument", f"the jax backend's backward takes a callable of the model output, "
                                   f"not {type(loss).__name__} (a JAX array carries no graph to differentiate)",
                                   remedy="pass a callable of the model output: trace.backward(lambda out: (out ** 2).sum()), "
                                          "or trace.backward(None) for the sum of its float leaves",
                                   loss_type=type(loss).__name__)
    ops = list(trace.ops)
    eps0 = {op.event_id: {k: jnp.zeros(op.shapes[k], jnp.dtype(d)) for k, d in enumerate(op.dtypes) if _inexact(d)}
            for op in ops if op.kind in (*_SOURCES, "op", "output")}
    run = _evaluate(trace, state, ops, param_values(trace))

    def objective(eps: dict) -> Any:
        leaves = run(eps)
        if loss is None:
            return _default_loss(leaves)
        return loss(jax.tree_util.tree_unflatten(state.out_tree, leaves))

    value, pull = jax.vjp(objective, eps0)
    if jnp.shape(value) != () or not jnp.issubdtype(jnp.result_type(value), jnp.inexact):
        raise InvalidArgumentError("invalid_argument", f"loss(output) returned shape {jnp.shape(value)} "
                                   f"{jnp.result_type(value)}, not a float scalar",
                                   remedy="reduce the loss to a scalar, for example with .sum()")
    (cot,) = pull(jnp.ones_like(value))
    if not state.save_grads:
        return None
    for op in ops:
        slots = cot.get(op.event_id)
        if slots is None or not op.saved:
            continue
        op.grads = tuple(slots.get(k) for k in range(len(op.shapes)))
    return None


__all__ = ["backward", "keep_for_backward", "GradState"]
