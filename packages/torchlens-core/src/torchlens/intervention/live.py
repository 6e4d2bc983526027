"""Live application of a recipe: capture-time `intervene=`, the rerun engine, `bind`.

A live edit is placed by event position: an unedited structure-only capture resolves each
rule's selector to final labels and from them to the backend's event ids; the edited
capture then applies the edits to those events' outputs as they are produced (backend
trace option `_edit_plan`). A graph-stable edit records the same graph, which is checked.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from torchlens.backends.protocol import SupportsInterventions, supports
from torchlens.errors import InterventionError
from torchlens.intervention.edits import Edit, HookContext, fire
from torchlens.intervention.recipe import Recipe
from torchlens.intervention.state import state_of


class EditPlan:
    """event id -> edits, applied by the backend to an op's output slots as it runs."""

    def __init__(self, by_event: dict[int, list[Edit]], labels: dict[int, str], ops: Any,
                 grad_by_event: dict[int, list[Edit]] | None = None) -> None:
        self.by_event = by_event
        self.grad_by_event = grad_by_event or {}
        self.labels = labels
        self.ops = ops
        self.fired: dict[int, int] = {}
        self.grad_fired: dict[int, int] = {}
        self.run_state: dict = {}

    def apply_grad(self, event_id: int, grad: Any) -> Any:
        """Edit the gradient arriving at an op's output (a backward hook)."""
        ctx = HookContext(self.labels.get(event_id, str(event_id)), None, None, self.ops, signal="backward",
                          run_state=self.run_state)
        for edit in self.grad_by_event[event_id]:
            grad = fire(edit, grad, ctx)
        self.grad_fired[event_id] = self.grad_fired.get(event_id, 0) + 1
        return grad

    def __contains__(self, event_id: int) -> bool:
        return event_id in self.by_event

    def apply(self, event_id: int, outs: tuple) -> tuple:
        from torchlens.intervention.replay import _check_shape

        new = list(outs)
        for edit in self.by_event[event_id]:
            for i, v in enumerate(new):
                if v is None or not hasattr(v, "shape"):
                    continue
                ctx = HookContext(self.labels.get(event_id, str(event_id)), None, None, self.ops, run_state=self.run_state)
                out = fire(edit, v, ctx)  # a user callable gets a copy: the live value may alias inputs or weights
                _check_shape(_Named(ctx.label), edit, v, out)
                new[i] = out
        self.fired[event_id] = self.fired.get(event_id, 0) + 1
        return tuple(new)


class _Named:
    def __init__(self, label: str) -> None:
        self.label = label


def _check_backend(proto: Any) -> None:
    proto.capabilities().refuse_unless("interventions", f"the {proto.name} backend cannot apply interventions")


def _plan(structure: Any, recipe: Recipe, ops: Any) -> tuple[dict[int, list[Edit]], dict[int, list[Edit]], dict[int, str], list]:
    from torchlens.intervention.verbs import lower_rules

    by_event: dict[int, list[Edit]] = {}
    grad_by_event: dict[int, list[Edit]] = {}
    labels: dict[int, str] = {}
    resolved = lower_rules(structure, list(recipe.rules))
    for rule, site_labels, applied, _source in resolved:
        target = grad_by_event if rule.signal == "backward" else by_event
        for label in site_labels:
            op = structure._ops[label]
            target.setdefault(op.event_id, []).append(applied)
            labels[op.event_id] = label
    return by_event, grad_by_event, labels, resolved


def live_capture(proto: Any, model: Any, args: tuple, kwargs: dict, recipe: Recipe, *, save: Any, capture: Any,
                 on_zero_fire: str = "warn", zero_fire_code: str = "trace_zero_fire", check_graph: bool = True,
                 engine: str = "live", trace_options: dict | None = None) -> Any:
    """Capture `model(*args)` with `recipe`'s edits live; the trace records the edited run.
    `trace_options` are the backend's own trace options, passed to both captures."""
    trace_options = dict(trace_options or {})
    from torchlens.intervention.verbs import _audit, _state, _zero_fire

    import dataclasses

    from torchlens.intervention.edits import check_tensors_unchanged

    from torchlens.intervention.verbs import refuse_placeholders

    _check_backend(proto)
    refuse_placeholders(recipe.rules)  # a saved placeholder never reruns silently without its edit
    for rule in recipe.rules:
        check_tensors_unchanged(rule.edit)
    ops = proto.edit_ops()
    has_grad = any(r.signal == "backward" for r in recipe.rules)
    forced = False
    if has_grad and not capture.backward_ready:
        proto.capabilities().refuse_unless("backward_capture", f"the {proto.name} backend cannot edit gradients")
        capture = dataclasses.replace(capture, backward_ready=True, inference_only=None)
        forced = True
    # both captures pass an edit plan (the first an empty one): a backend runs a live capture on
    # copies of the caller's inputs, so the two runs see the same inputs and the caller's stay put
    structure = proto.capture(model, args, kwargs, save="none", capture=capture, _edit_plan=EditPlan({}, {}, ops),
                              **trace_options)
    by_event, grad_by_event, labels, resolved = _plan(structure, recipe, ops)
    from torchlens.intervention.verbs import check_sites

    check_sites(structure, resolved)  # helper arguments vs the sites' shapes, before the edited run
    if not by_event and not grad_by_event:
        _zero_fire(on_zero_fire, zero_fire_code, list(recipe.rules), structure)
    plan = EditPlan(by_event, labels, ops, grad_by_event)
    result = proto.capture(model, args, kwargs, save=save, capture=capture, _edit_plan=plan, **trace_options)
    diverged = check_divergence(structure, result, set(by_event) | set(grad_by_event), warn=check_graph)
    st = _state(result)
    st.recipe = recipe
    st.is_fork = True
    _audit(st, engine, resolved)
    st.steered_digest = recipe.digest  # the recorded values reflect exactly this recipe
    st.live_armed = tuple(r.identity() for r in recipe.rules if r.signal == "backward")  # hooked on this graph
    fired_rules, unfired_rules = _fire_report(resolved, result, plan)
    if engine == "rerun":  # S2: a rerun edit that matched sites but cannot fire live refuses (spec l. 289, 811)
        from torchlens.intervention.checks import refuse_unmatchable_live

        refuse_unmatchable_live(resolved, plan.fired, {o.label: o.event_id for o in result._ops.values()})
    st.last_run = {"engine": engine, "hooks_fired": len(fired_rules), "hooks_unfired": unfired_rules,
                      "unfired_sites": [labels[e] for e in by_event if e not in plan.fired],
                      "backward_ready_forced": forced, "armed_gradient_edits": len(grad_by_event),
                      "graph_diverged_at": diverged}
    result._edit_plan = plan
    result.annotations["unmatched_capture_selectors"] = [repr(r.target) for r, lbs, _, _ in resolved if not lbs]
    return result


def _op_key(op: Any) -> tuple:
    return (op.label, op.parents)


def check_divergence(structure: Any, result: Any, edited_events: set[int], *, warn: bool = True) -> str | None:
    """Compare the edited run's graph with the unedited run's (op labels in order and their
    edges). Edits are placed by event position, so when the graphs part at or before an
    edited event an edit may have landed on another op: refuse (`rerun_graph_diverged`,
    nothing adopted). A divergence after every edited event is the edit's own effect on
    the control flow downstream: the result is kept, the warning
    `rerun_graph_diverged_downstream` says where. Returns the first diverging label."""
    before = list(structure._ops.values())
    after = list(result._ops.values())
    first = None
    for i in range(max(len(before), len(after))):
        if i >= len(before) or i >= len(after) or _op_key(before[i]) != _op_key(after[i]):
            first = i
            break
    if first is None:
        return None
    at = before[first] if first < len(before) else None
    label = at.label if at is not None else (after[first].label if first < len(after) else "<end>")
    edited = sorted(o.label for o in before if o.event_id in edited_events)
    if at is None or any(e >= at.event_id for e in edited_events):
        got = after[first].label if first < len(after) else "<end of graph>"
        raise InterventionError(
            "rerun_graph_diverged",
            f"the edited run recorded a different graph than the unedited run from op {first} on ({label} became "
            f"{got}), at or before an edited op ({', '.join(edited[:4])}): edits are placed by position, so one may "
            "have landed on another op; nothing was changed",
            remedy="make the forward's graph independent of the edit up to the edited ops (a value-dependent branch or "
                   "shape before them), or edit a site after the branch",
            first_divergence=label, became=got, position=first, edited=edited)
    if warn:
        warnings.warn(f"[rerun_graph_diverged_downstream] the edit changed the graph after every edited op "
                      f"(from {label} on): the result records the edited run's own ops", RuntimeWarning, stacklevel=4)
    return label


def _fire_report(resolved: list, result: Any, plan: EditPlan) -> tuple[list[str], list[str]]:
    """(rules that fired, rules that fired nowhere) of a live run, each rule named by its
    target. A forward rule fired when one of its events ran; a gradient rule is armed (it
    fires at `trace.backward`), so it counts as fired when it matched a site."""
    fired, unfired = [], []
    ev_of = {}
    for op in result._ops.values():
        ev_of[op.label] = op.event_id
    for rule, site_labels, _applied, _src in resolved:
        name = repr(rule.target)
        if rule.signal == "backward":
            (fired if site_labels else unfired).append(name)
            continue
        events = {ev_of.get(lb) for lb in site_labels}
        (fired if any(e in plan.fired for e in events if e is not None) else unfired).append(name)
    return fired, unfired


def _as_args(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, tuple) else (inputs,)


def rerun(trace: Any, model: Any, inputs: Any, recipe: Recipe, *, on_zero_fire: str = "warn",
          input_kwargs: dict | None = None, check_graph: bool = True, fast_refused: str | None = None) -> Any:
    """The rerun engine: capture `model(inputs)` again with `recipe` live (`last_run["engine"]`
    is "rerun"; `fast_refused` names the guard that refused the fast engine, if one was tried)."""
    proto = trace._backend
    saved = [o.label for o in trace._ops.values() if o.saved]
    save: Any = "all" if len(saved) == len(trace._ops) else (saved or "none")
    from torchlens.options import CaptureOptions

    from torchlens.options import TraceOptions

    if isinstance(trace.options, TraceOptions):
        capture = trace.options.capture_options()
    elif isinstance(trace.options, CaptureOptions):
        capture = trace.options
    else:
        capture = CaptureOptions()
    result = live_capture(proto, model, _as_args(inputs), dict(input_kwargs or {}), recipe, save=save, capture=capture,
                          on_zero_fire=on_zero_fire, zero_fire_code="rerun_zero_fire", check_graph=check_graph,
                          engine="rerun")
    state_of(result).last_run["fast_refused"] = fast_refused
    return result


def module_rule_parts(target: Any) -> tuple[str, int | None] | None:
    """(address, call or None) for a plain `tl.module(...)` target, else None."""
    from torchlens.select.selectors import ModuleSelector

    if type(target) is not ModuleSelector:
        return None
    base, _, token = target.address.rpartition(":")
    if base and token.isdigit():
        return base, int(token)
    return target.address, None


def _refuse_alias_spellings(model: Any, addresses: list[str]) -> None:
    """A module address that is not a canonical `named_modules()` name but reaches a module
    (an alias attribute) refuses, as it does on a trace (`bind_static_anchor_unresolved`)."""
    named = getattr(model, "named_modules", None)
    if not callable(named):
        return
    canonical = {id(m): (a or "self") for a, m in named()}
    names = set(canonical.values())
    for address in addresses:
        if address in names:
            continue
        obj: Any = model
        for part in address.split("."):
            obj = getattr(obj, part, None)
        if obj is not None and id(obj) in canonical:
            from torchlens.errors import SelectorCompositionError

            raise SelectorCompositionError(
                "bind_static_anchor_unresolved", f"{address!r} is an alias of module {canonical[id(obj)]!r}; a forward "
                "cannot tell which name it called the module through",
                remedy=f"select the canonical name tl.module({canonical[id(obj)]!r})", address=address,
                canonical=canonical[id(obj)])


def _steered_lazy(it: Any, settle: Any) -> Any:
    """A sync lazy output of a bound call (glossary l. 282): the edits stay attached while it is
    iterated, and `settle` (detach the edits, write last_report, apply the zero-fire policy) runs
    once when the iteration is exhausted, closed or raises."""
    done = False

    def finish() -> None:
        nonlocal done
        if not done:
            done = True
            settle()

    try:
        while True:
            try:
                item = next(it)
            except StopIteration as stop:
                finish()
                return stop.value
            yield item
    except BaseException:
        close = getattr(it, "close", None)
        if callable(close):
            close()
        finish()
        raise
    finally:
        finish()


class BoundModel:
    """A recipe bound to a model: calling it runs the model with the edits live and returns
    the model's own output; `.last_report` says where each rule fired."""

    def __init__(self, model: Any, recipe: Recipe, *, backend: str | None = None, on_zero_fire: str = "warn") -> None:
        from torchlens.options import InterventionOptions

        InterventionOptions(on_zero_fire=on_zero_fire)  # validates the policy
        self._model = model
        self._recipe = recipe
        self._backend_name = backend
        self._on_zero_fire = on_zero_fire
        self.last_report: dict[str, Any] | None = None

    @property
    def model(self) -> Any:
        return self._model

    @property
    def recipe(self) -> Recipe:
        return self._recipe

    def _proto(self, args: tuple, kwargs: dict) -> Any:
        from torchlens.backends.registry import select_backend

        proto = select_backend(self._model, args, kwargs, self._backend_name)
        _check_backend(proto)
        return proto

    def _module_rules(self) -> list[tuple[str, int | None, Edit]] | None:
        for rule in self._recipe.rules:
            if rule.signal != "forward":
                raise InterventionError("bind_rule_unsupported",
                                        f"{rule.target!r} is a gradient site; a bound executor replaces forward values only",
                                        remedy="edit gradients with trace.do(tl.grad(site), edit, model=..., inputs=..., loss=...)")
        out = []
        for rule in self._recipe.rules:
            parts = module_rule_parts(rule.target)
            if parts is None:
                return None
            out.append((parts[0], parts[1], rule.edit))
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(lambda: self._model(*args, **kwargs), args, kwargs)

    def _run(self, call: Any, args: tuple, kwargs: dict) -> Any:
        proto = self._proto(args, kwargs)
        module_rules = self._module_rules()
        if module_rules is not None:
            _refuse_alias_spellings(self._model, [a for a, _c, _e in module_rules])
        if module_rules is not None and supports(proto, SupportsInterventions):
            ops = proto.edit_ops()
            fired: dict[int, int] = {}
            handle = proto.attach_module_edits(self._model, module_rules, ops, fired)
            try:
                out = call()
            except BaseException:
                handle.remove()
                raise
            from torchlens.intervention.checks import refuse_async_lazy

            def settle() -> None:
                handle.remove()
                zero = [i for i in range(len(module_rules)) if not fired.get(i)]
                self.last_report = {"mode": "module_hooks", "fire_counts": dict(fired), "zero_fire_rule_ids": zero}
                if zero:
                    from torchlens.intervention.verbs import _zero_fire

                    _zero_fire(self._on_zero_fire, "bind_zero_fire", [self._recipe.rules[i] for i in zero])

            try:
                refuse_async_lazy(out)  # bind_lazy_output (glossary l. 282)
            except BaseException:
                handle.remove()
                raise
            if inspect.isgenerator(out) or (hasattr(out, "__next__") and hasattr(out, "__iter__")
                                            and not isinstance(out, (str, bytes)) and not hasattr(out, "shape")):
                return _steered_lazy(out, settle)  # stays steered for every step; settles when it ends
            settle()
            return out
        from torchlens.options import CaptureOptions

        result = live_capture(proto, self._model, args, kwargs, self._recipe, save="none", capture=CaptureOptions(),
                              on_zero_fire=self._on_zero_fire, zero_fire_code="bind_zero_fire")
        self.last_report = {"mode": "capture", **(state_of(result).last_run or {})}
        return result.output

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._model, name)
        if not callable(attr):
            return attr

        def method(*args: Any, **kwargs: Any) -> Any:
            if self._module_rules() is None:
                raise InterventionError("bind_rule_unsupported",
                                        f"bound.{name}(...) can steer only tl.module(...) rules (op-level rules need a capture)",
                                        remedy=f"use tl.module(address) sites, or call the bound model directly instead of .{name}")
            return self._run(lambda: attr(*args, **kwargs), args, kwargs)

        return method

    def __repr__(self) -> str:
        return f"<BoundModel of {type(self._model).__name__} with {len(self._recipe)} rule(s)>"
