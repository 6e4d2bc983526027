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

A live-edited capture (`intervene=`, the rerun engine) keeps its edit plan here too: the
re-evaluation applies each forward edit where the capture did (after the op ran, before
anything reads it), so the gradients are those of the edited forward the trace recorded;
a gradient edit (`tl.when(tl.grad(site), edit)`) is an identity with a custom VJP at that
op's output, so the edited cotangent is what the op's `grads` holds and what flows further
back (a torch gradient hook's semantics).

A differentiable replay (`trace.fork().do(site, edit,
intervention=InterventionOptions(differentiable=True))` on a plain backward-ready capture)
gives the fork it returns its own state (`keep_replay_for_backward`, through core's
`ReplayGradientOps`): the same kept sources re-evaluated with every edit the fork's values
reflect applied where the replay applied it (sources included), so `fork.backward(loss)` is
the gradient of the edited forward. Editing that fork again without `differentiable=True`
makes its backward refuse (the kept replay no longer matches its values).

The walk itself is the SDK's `perturbed_replay` (the one the mlx, tf, paddle and tinygrad
backends use); this module adds what only JAX does with it: the `jax.vjp` objective, the
gradient-edit taps and the differentiable replay's edited sources.

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

from torchlens.backends.sdk import InvalidArgumentError, Replayer, param_values, perturbed_replay
from torchlens_jax.validate import JaxReplayOps

_SOURCES = ("input", "buffer", "constant")


@dataclass
class GradState:
    """What a backward needs that the trace's records may not keep."""

    out_tree: Any
    save_grads: bool
    sources: dict[int, tuple[Any, ...]]
    owner: "weakref.ref[Any]"  # the trace this state was captured for
    edit_plan: Any = None  # core's EditPlan of a live-edited capture, or a differentiable replay's _ReplayPlan
    recipe_digest: str | None = None  # a differentiable replay's fork: the recipe its values reflect


@dataclass
class _ReplayPlan:
    """The edits a differentiable replay applied (by event id), in the shape `_evaluate` reads
    core's EditPlan: forward edits only, applied to sources too (the kept sources are clean)."""

    by_event: dict[int, list[Any]]
    labels: dict[int, str]
    ops: Any
    run_state: dict
    grad_by_event: dict = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.grad_by_event = {}


def keep_replay_for_backward(trace: Any, edits: dict[str, list[Any]], ops: Any) -> None:
    """Give the fork a differentiable replay returned its own backward state: the capture's kept
    sources re-evaluated with `edits` applied where the replay applied them. Nothing is kept (its
    backward refuses) when the fork does not come from a plain backward-ready capture."""
    root = trace.backend_state
    if not isinstance(root, GradState) or root.owner() is None or (
            root.edit_plan is not None and not isinstance(root.edit_plan, _ReplayPlan)):  # a live-edited capture
        return
    by_event = {trace._ops[label].event_id: list(es) for label, es in edits.items()}
    labels = {trace._ops[label].event_id: label for label in edits}
    plan = _ReplayPlan(by_event, labels, ops, {})
    trace.backend_state = GradState(root.out_tree, root.save_grads, root.sources, weakref.ref(trace), plan,
                                    trace.recipe.digest)


def keep_for_backward(trace: Any, out_tree: Any, save_grads: bool, edit_plan: Any = None) -> None:
    """Called by the capture, before the save plan releases payloads. Source values are kept
    as recorded (a live edit of an input is already in them)."""
    sources = {op.event_id: tuple(op.outs) for op in trace.ops if op.kind in _SOURCES}
    plan = edit_plan if edit_plan is not None and (edit_plan.by_event or edit_plan.grad_by_event) else None
    trace.backend_state = GradState(out_tree, save_grads, sources, weakref.ref(trace), plan)


def _grad_tap(plan: Any, eid: int) -> Callable[[Any], Any]:
    """An identity whose VJP applies the plan's gradient edits of event `eid` to the cotangent."""

    @jax.custom_vjp
    def tap(x: Any) -> Any:
        return x

    def fwd(x: Any) -> tuple[Any, None]:
        return x, None

    def bwd(_res: None, g: Any) -> tuple[Any]:
        return (plan.apply_grad(eid, g),)

    tap.defvjp(fwd, bwd)
    return tap


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


def _evaluate(trace: Any, state: GradState, params: dict[str, Any]) -> Callable[[dict], Any]:
    """A function of the per-op perturbations returning the output pytree's leaves."""

    plan = state.edit_plan
    grad_edited = set(plan.grad_by_event) if plan is not None else set()
    taps = {eid: _grad_tap(plan, eid) for eid in grad_edited}
    # each op is re-executed by core's one replay engine (JaxReplayOps: parents as arrays, a
    # primitive's several results as its slots), on the values this evaluation computed
    replayer = Replayer(trace, JaxReplayOps(trace._backend))
    # the SDK's perturbed-replay walk (the one mlx, tf, paddle and tinygrad use): a differentiable
    # replay's plan edits the (clean) kept sources too; a gradient edit taps the perturbed value
    edit_sources = isinstance(plan, _ReplayPlan)

    def run(eps: dict[int, tuple[Any, ...]]) -> list[Any]:
        return perturbed_replay(trace, state, replayer, eps, params=params, is_leaf=_is_value,
                                edit_sources=edit_sources, taps=taps)

    return run


def _is_value(v: Any) -> bool:
    """A slot the forward edits apply to (an array; not a None slot)."""
    return v is not None and hasattr(v, "shape")


def backward(trace: Any, loss: Any = None, **kwargs: Any) -> None:
    """Fill `op.grads` for the saved ops of a trace captured for a backward (module doc)."""
    if kwargs:
        raise InvalidArgumentError("invalid_argument", f"the jax backend's backward takes no {', '.join(sorted(kwargs))}=",
                                   remedy="trace.backward(loss) with loss a callable of the model output",
                                   options=sorted(kwargs))
    state = trace.backend_state
    if not isinstance(state, GradState) or state.owner() is not trace:
        fork = isinstance(state, GradState)  # a fork shares the slot of the trace it was copied from
        raise InvalidArgumentError("backward_not_requested", "this trace was not captured for a backward pass "
                                   "(or it is a fork or a loaded trace, which keep no backward state)",
                                   remedy="capture with capture=CaptureOptions(backward_ready=True, save_grads=True)"
                                   + ("; to differentiate an edited forward, capture it edited: add "
                                      "intervene=tl.when(site, edit) to that tl.trace call, or replay the edit with "
                                      "intervention=tl.InterventionOptions(differentiable=True) on a fork of the "
                                      "backward-ready capture (a plain replayed fork keeps no backward state)"
                                      if fork else ""),
                                   fork=fork)
    if state.recipe_digest is not None and trace.recipe.digest != state.recipe_digest:
        raise InvalidArgumentError("backward_not_requested", "this differentiable fork was edited again after its "
                                   "differentiable replay; its values are no longer what the kept replay recomputes",
                                   remedy="fork again and apply every edit with InterventionOptions(differentiable=True)",
                                   fork=True)
    if loss is not None and not callable(loss):
        raise InvalidArgumentError("invalid_argument", f"the jax backend's backward takes a callable of the model output, "
                                   f"not {type(loss).__name__} (a JAX array carries no graph to differentiate)",
                                   remedy="pass a callable of the model output: trace.backward(lambda out: (out ** 2).sum()), "
                                          "or trace.backward(None) for the sum of its float leaves",
                                   loss_type=type(loss).__name__)
    ops = list(trace.ops)
    eps0 = {op.event_id: {k: jnp.zeros(op.shapes[k], jnp.dtype(d)) for k, d in enumerate(op.dtypes) if _inexact(d)}
            for op in ops if op.kind in (*_SOURCES, "op", "output")}
    run = _evaluate(trace, state, param_values(trace))

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
