"""Live application of a recipe: capture-time `intervene=`, the rerun engine, `bind`.

A live edit is placed by event position: an unedited structure-only capture resolves each
rule's selector to final labels and from them to the backend's event ids; the edited
capture then applies the edits to those events' outputs as they are produced (backend
trace option `_edit_plan`). A graph-stable edit records the same graph, which is checked.
"""

from __future__ import annotations

import warnings
from typing import Any

from torchlens.errors import InterventionError
from torchlens.intervention.edits import Edit, HookContext, fire
from torchlens.intervention.recipe import Recipe


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
                 on_zero_fire: str = "warn", zero_fire_code: str = "trace_zero_fire", check_graph: bool = True) -> Any:
    """Capture `model(*args)` with `recipe`'s edits live; the trace records the edited run."""
    from torchlens.intervention.verbs import _audit, _state, _zero_fire

    import dataclasses

    from torchlens.intervention.edits import check_tensors_unchanged

    _check_backend(proto)
    for rule in recipe.rules:
        check_tensors_unchanged(rule.edit)
    ops = proto.edit_ops()
    has_grad = any(r.signal == "backward" for r in recipe.rules)
    forced = False
    if has_grad and not capture.backward_ready:
        proto.capabilities().refuse_unless("backward_capture", f"the {proto.name} backend cannot edit gradients")
        capture = dataclasses.replace(capture, backward_ready=True, inference_only=None)
        forced = True
    structure = proto.capture(model, args, kwargs, save="none", capture=capture)
    by_event, grad_by_event, labels, resolved = _plan(structure, recipe, ops)
    from torchlens.intervention.verbs import check_sites

    check_sites(structure, resolved)  # helper arguments vs the sites' shapes, before the edited run
    if not by_event and not grad_by_event:
        _zero_fire(on_zero_fire, zero_fire_code, list(recipe.rules), structure)
    plan = EditPlan(by_event, labels, ops, grad_by_event)
    result = proto.capture(model, args, kwargs, save=save, capture=capture, _edit_plan=plan)
    if check_graph and result.labels != structure.labels:
        warnings.warn("[rerun_graph_diverged] the edited run recorded a different graph than the unedited run; "
                      "edits after the divergence may sit at different ops", RuntimeWarning, stacklevel=3)
    st = _state(result)
    st["recipe"] = recipe
    st["is_fork"] = True
    _audit(st, "live", resolved)
    st["last_run"] = {"engine": "live", "hooks_fired": len(plan.fired),
                      "hooks_unfired": [labels[e] for e in by_event if e not in plan.fired],
                      "backward_ready_forced": forced, "armed_gradient_edits": len(grad_by_event)}
    result.__dict__["_edit_plan"] = plan
    result.annotations["unmatched_capture_selectors"] = [repr(r.target) for r, lbs, _, _ in resolved if not lbs]
    return result


def _as_args(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, tuple) else (inputs,)


def rerun(trace: Any, model: Any, inputs: Any, recipe: Recipe, *, on_zero_fire: str = "warn",
          input_kwargs: dict | None = None, check_graph: bool = True) -> Any:
    """The rerun engine: capture `model(inputs)` again with `recipe` live."""
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
    return live_capture(proto, model, _as_args(inputs), dict(input_kwargs or {}), recipe, save=save, capture=capture,
                        on_zero_fire=on_zero_fire, zero_fire_code="rerun_zero_fire", check_graph=check_graph)


def module_rule_parts(target: Any) -> tuple[str, int | None] | None:
    """(address, call or None) for a plain `tl.module(...)` target, else None."""
    from torchlens.select.selectors import ModuleSelector

    if type(target) is not ModuleSelector:
        return None
    base, _, token = target.address.rpartition(":")
    if base and token.isdigit():
        return base, int(token)
    return target.address, None


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
        if module_rules is not None and hasattr(proto, "attach_module_edits"):
            ops = proto.edit_ops()
            fired: dict[int, int] = {}
            handle = proto.attach_module_edits(self._model, module_rules, ops, fired)
            try:
                out = call()
            finally:
                handle.remove()
            zero = [i for i in range(len(module_rules)) if not fired.get(i)]
            self.last_report = {"mode": "module_hooks", "fire_counts": dict(fired), "zero_fire_rule_ids": zero}
            if zero:
                from torchlens.intervention.verbs import _zero_fire

                _zero_fire(self._on_zero_fire, "bind_zero_fire", [self._recipe.rules[i] for i in zero])
            return out
        from torchlens.options import CaptureOptions

        result = live_capture(proto, self._model, args, kwargs, self._recipe, save="none", capture=CaptureOptions(),
                              on_zero_fire=self._on_zero_fire, zero_fire_code="bind_zero_fire")
        st = result.__dict__["_intervention"]
        self.last_report = {"mode": "capture", **(st["last_run"] or {})}
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
