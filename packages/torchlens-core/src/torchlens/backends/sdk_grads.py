"""Framework-free pieces of a backend's `trace.backward(loss)` by perturbed replay (re-exported by
`torchlens.backends.sdk`; imports no ML framework).

A backend that has no live autograd graph after a capture (mlx, tf, paddle, tinygrad) computes
the gradients of a trace the same way: at capture it keeps the values of the source ops and the
structure of the output (`keep_for_backward`); at `trace.backward(loss)` it re-executes the
recorded ops through core's `Replayer` with a zero perturbation added to every floating op
output (`perturbed_replay`), reduces the output to a scalar (`loss_value`), asks its framework's
autodiff for the gradient of that scalar with respect to every perturbation, and stores them
(`store_grads`). Only the autodiff call is the framework's; every other step is here and takes
the framework operations it needs as callables (`is_leaf`, `add`, `reduce_sum`, ...).

    state = backward_state(trace, loss, kwargs, backend="mlx")      # the typed refusals
    keys = grad_keys(trace.ops, is_float)                          # (event_id, slot) of float outputs
    leaves = perturbed_replay(trace, state, replayer, eps_by_event, params=param_values(trace),
                              is_leaf=is_array)
    value = loss_value(state, leaves, loss, is_float_leaf=..., reduce_sum=..., is_float_scalar=...)
    store_grads(trace, state, keys, gradients)

Also `GradOptions`, the one dataclass every backend namespace exports as
`tl.backends.<name>.GradOptions`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from torchlens.errors import InvalidArgumentError

#: The op kinds whose values a backward keeps from the capture (they are not re-executed).
SOURCE_KINDS = ("input", "buffer", "constant")


@dataclass(frozen=True)
class GradOptions:
    """Which derived gradients a capture should compute (`tl.backends.<name>.GradOptions`).

    - `wrt`: what to differentiate with respect to: `"inputs"`, `"params"` or `"both"`.
    - `loss`: optional callable mapping the model output to a scalar (default: sum).
    - `intermediates`: also derive gradients at every recorded op output.

    A backend that declares `intermediate_derived_grads=False` refuses `grad_options=` with
    `intermediate_derived_grads_unsupported` before anything runs; the dataclass exists so code
    written against the spec's namespace imports and type-checks on every backend.
    """

    wrt: str = "inputs"
    loss: object = None
    intermediates: bool = True

    def __post_init__(self) -> None:
        if self.wrt not in ("inputs", "params", "both"):
            raise InvalidArgumentError("invalid_argument", f"GradOptions(wrt={self.wrt!r}) is not 'inputs', 'params' or 'both'",
                                       remedy="wrt='inputs'", field="wrt")


@dataclass
class GradState:
    """What a capture keeps for a later `trace.backward` (in `trace.backend_state`)."""

    out_template: Any
    save_grads: bool
    sources: dict[int, tuple[Any, ...]]
    owner: "weakref.ref[Any]"
    edit_plan: Any = None


class OutLeaf:
    """A position in an output template (`out_template`)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"OutLeaf({self.index})"


def out_template(out: Any, is_leaf: Callable[[Any], bool], counter: list[int] | None = None) -> Any:
    """The structure of `out` (tuples, lists, dicts) with each leaf (`is_leaf`) replaced by its
    position, in depth-first order; anything else is kept as it is."""
    counter = [0] if counter is None else counter
    if is_leaf(out):
        counter[0] += 1
        return OutLeaf(counter[0] - 1)
    if isinstance(out, (tuple, list)):
        return type(out)(out_template(o, is_leaf, counter) for o in out)
    if isinstance(out, dict):
        return {k: out_template(v, is_leaf, counter) for k, v in out.items()}
    return out


def rebuild(template: Any, leaves: Sequence[Any]) -> Any:
    """The inverse of `out_template`: the structure with each position replaced by `leaves[i]`."""
    if isinstance(template, OutLeaf):
        return leaves[template.index]
    if isinstance(template, (tuple, list)):
        return type(template)(rebuild(t, leaves) for t in template)
    if isinstance(template, dict):
        return {k: rebuild(v, leaves) for k, v in template.items()}
    return template


def keep_for_backward(trace: Any, out: Any, save_grads: bool, is_leaf: Callable[[Any], bool],
                      edit_plan: Any = None) -> GradState:
    """Store a `GradState` for `trace` in `trace.backend_state` (call it before `save=` drops
    payloads): the source ops' values, the output's template, and the live edit plan when it
    edited anything."""
    sources = {op.event_id: tuple(op.outs) for op in trace.ops if op.kind in SOURCE_KINDS}
    plan = edit_plan if edit_plan is not None and (edit_plan.by_event or edit_plan.grad_by_event) else None
    state = GradState(out_template(out, is_leaf), save_grads, sources, weakref.ref(trace), plan)
    trace.backend_state = state
    return state


def backward_state(trace: Any, loss: Any, kwargs: Mapping[str, Any], *, backend: str, loss_note: str = "",
                   loss_remedy: str = "trace.backward(lambda out: (out ** 2).sum()), or trace.backward(None) for the "
                                      "sum of its float leaves") -> GradState:
    """The checks every perturbed-replay backward makes before it runs, in order, as typed
    errors: unknown keyword arguments (`invalid_argument`), a trace with no `GradState` of its
    own (`backward_not_requested`: never captured for a backward, a fork, or a loaded trace), a
    `loss` that is not callable (`invalid_argument`, `loss_note` says why), and gradient edits
    (`invalid_argument`). Returns the trace's `GradState`."""
    if kwargs:
        raise InvalidArgumentError("invalid_argument", f"the {backend} backend's backward takes no {', '.join(sorted(kwargs))}=",
                                   remedy="trace.backward(loss) with loss a callable of the model output",
                                   options=sorted(kwargs))
    state = trace.backend_state
    if not isinstance(state, GradState) or state.owner() is not trace:
        raise InvalidArgumentError("backward_not_requested", "this trace was not captured for a backward pass "
                                   "(or it is a fork or a loaded trace, which keep no backward state)",
                                   remedy="capture with capture=CaptureOptions(backward_ready=True, save_grads=True)",
                                   fork=isinstance(state, GradState))
    if loss is not None and not callable(loss):
        note = f" ({loss_note})" if loss_note else ""
        raise InvalidArgumentError("invalid_argument", f"the {backend} backend's backward takes a callable of the model "
                                   f"output, not {type(loss).__name__}{note}",
                                   remedy=loss_remedy, loss_type=type(loss).__name__)
    plan = state.edit_plan
    if plan is not None and plan.grad_by_event:
        raise InvalidArgumentError("invalid_argument", f"gradient edits are not supported by the {backend} backend (preview)",
                                   remedy="edit forward values only, or use the torch or jax backend for gradient edits")
    return state


def grad_keys(ops: Iterable[Any], is_float: Callable[[str], bool],
              kinds: Sequence[str] = (*SOURCE_KINDS, "op", "output")) -> list[tuple[int, int]]:
    """`(event_id, slot)` of every floating output slot (`is_float(str(dtype))`) of the ops of
    `kinds`: where `perturbed_replay` adds a perturbation and a gradient is stored."""
    return [(op.event_id, k) for op in ops if op.kind in kinds for k, d in enumerate(op.dtypes) if is_float(str(d))]


def by_event(keys: Sequence[tuple[int, int]], values: Iterable[Any]) -> dict[int, dict[int, Any]]:
    """`{event_id: {slot: value}}` from parallel `keys` and `values`."""
    out: dict[int, dict[int, Any]] = {}
    for (e, k), v in zip(keys, values):
        out.setdefault(e, {})[k] = v
    return out


def forward_edits(plan: Any, eid: int, outs: list[Any], is_leaf: Callable[[Any], bool]) -> list[Any]:
    """Apply the live edit plan's forward edits of event `eid` to its tensor outputs (in place
    in `outs`, which is returned), as the capture applied them."""
    from torchlens.backends import sdk  # the facade serves the intervention layer's HookContext/fire lazily

    for edit in plan.by_event[eid]:
        for i, v in enumerate(outs):
            if is_leaf(v):
                ctx = sdk.HookContext(plan.labels.get(eid, str(eid)), None, None, plan.ops, run_state=plan.run_state)
                outs[i] = sdk.fire(edit, v, ctx)
    return outs


def _plain_add(value: Any, eps: Any) -> Any:
    return value + eps


def perturbed_replay(trace: Any, state: GradState, replayer: Any, eps: Mapping[int, Mapping[int, Any]], *,
                     params: Mapping[str, Any], is_leaf: Callable[[Any], bool],
                     add: Callable[[Any, Any], Any] = _plain_add, edit_sources: bool = False,
                     taps: Mapping[int, Callable[[Any], Any]] | None = None) -> list[Any]:
    """Re-execute the recorded ops of `trace` and return the output leaves (one per output op).

    Source ops take their kept values (`state.sources`), each output op its parent's slot, each
    `op` is re-run by `replayer.run(op, override=params, changed=...)` on the values computed so
    far; the live edit plan's forward edits are applied where the capture applied them (to
    `op` and `output` ops; to sources too with `edit_sources`, as a replay that edited clean
    kept sources did); then `add(value, eps[event_id][slot])` adds the perturbation of every
    slot `eps` names, and `taps[event_id]`, where given, is applied to the sum (JAX's gradient
    edits: an identity whose VJP edits the cotangent). Other op kinds are skipped."""
    plan = state.edit_plan
    fwd_edited = set(plan.by_event) if plan is not None else set()
    taps = taps or {}
    vals: dict[int, list[Any]] = {}
    by_label: dict[str, tuple[Any, ...]] = {}
    for op in trace.ops:
        if op.kind in SOURCE_KINDS:
            outs = list(state.sources[op.event_id])
        elif op.kind == "output":
            pid, slot = op.parent_slots[0]
            outs = [vals[pid][slot]]
        elif op.kind == "op":
            outs = list(replayer.run(op, override=params, changed=by_label))
        else:
            continue
        if op.event_id in fwd_edited and (op.kind in ("op", "output") or edit_sources):
            outs = forward_edits(plan, op.event_id, outs, is_leaf)
        tap = taps.get(op.event_id)
        for k, e in (eps.get(op.event_id) or {}).items():
            outs[k] = add(outs[k], e)
            if tap is not None:
                outs[k] = tap(outs[k])
        vals[op.event_id] = outs
        by_label[op.label] = tuple(outs)
    return [vals[o.event_id][0] for o in trace.output_ops]


def loss_value(state: GradState, leaves: Sequence[Any], loss: Any, *, is_float_leaf: Callable[[Any], bool],
               reduce_sum: Callable[[Any], Any], is_float_scalar: Callable[[Any], bool],
               scalar_remedy: str = "reduce the loss to a scalar, for example with .sum()") -> Any:
    """The scalar to differentiate: `loss(output)` with the output rebuilt from `leaves`, or the
    sum (`reduce_sum`, then `+`) of the floating leaves when `loss` is None. Refuses with
    `invalid_argument` when there is no float leaf to sum or the result is not a float scalar."""
    if loss is None:
        floats = [reduce_sum(v) for v in leaves if is_float_leaf(v)]
        if not floats:
            raise InvalidArgumentError("invalid_argument", "the model's output has no floating-point leaf",
                                       remedy="pass loss=, a callable of the output returning a float scalar")
        value = floats[0]
        for f in floats[1:]:
            value = value + f
    else:
        value = loss(rebuild(state.out_template, leaves))
    if not is_float_scalar(value):
        raise InvalidArgumentError("invalid_argument", f"loss(output) returned {type(value).__name__} "
                                   f"{getattr(value, 'shape', '')}, not a float scalar", remedy=scalar_remedy)
    return value


def store_grads(trace: Any, state: GradState, keys: Sequence[tuple[int, int]], grads: Iterable[Any]) -> None:
    """Set `op.grads` of every saved op with a gradient (one entry per output slot, None where
    the slot has none), when the capture asked for `save_grads`."""
    if not state.save_grads:
        return
    slots_by_event = by_event(keys, grads)
    for op in trace.ops:
        slots = slots_by_event.get(op.event_id)
        if slots is None or not op.saved:
            continue
        op.grads = tuple(slots.get(k) for k in range(len(op.shapes)))


__all__ = ["GradOptions", "GradState", "OutLeaf", "SOURCE_KINDS", "out_template", "rebuild", "keep_for_backward",
           "backward_state", "grad_keys", "by_event", "forward_edits", "perturbed_replay", "loss_value", "store_grads"]
