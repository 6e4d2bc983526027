"""Trace verbs for interventions: do, fork, clear_edits, run (attached to Trace)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

from torchlens.errors import InterventionError, TraceMutationWarning
from torchlens.intervention.edits import Edit, as_edit
from torchlens.intervention.recipe import Recipe, Rule


def resolve_site(trace: Any, site: Any) -> list[str]:
    """Op labels a site names. A string is an exact label (multi-pass bare labels refuse)."""
    from torchlens.select.selectors import LabelSelector, Selector

    if _is_grad(site):
        return [o.label for o in site.resolve(trace)]
    if isinstance(site, str):
        site = LabelSelector(site)
    if not isinstance(site, Selector):
        raise InterventionError("intervention_site_invalid", f"a site is a selector or a label, not {type(site).__name__}",
                                remedy="trace.do(tl.module('fc'), edit) or trace.do('relu_1_2', edit)")
    return [o.label for o in site.resolve(trace)]


def _is_grad(site: Any) -> bool:
    from torchlens.select import selectors

    grad_cls = getattr(selectors, "GradSelector", None)
    return grad_cls is not None and isinstance(site, grad_cls)


def normalize_plan(site: Any, edit: Any) -> list[Rule]:
    """`do`'s first two arguments as a list of rules."""
    if isinstance(site, Recipe):
        if edit is not None:
            raise InterventionError("intervention_edit_invalid", "do(recipe) takes no second argument",
                                    remedy="trace.do(recipe)")
        return list(site.rules)
    if hasattr(site, "recipe") and isinstance(getattr(site, "recipe"), Recipe) and edit is None:
        return list(site.recipe.rules)  # a loaded intervention spec
    if isinstance(site, dict):
        if edit is not None:
            raise InterventionError("intervention_edit_invalid", "do(mapping) takes no second argument",
                                    remedy="trace.do({site_a: edit_a, site_b: edit_b})")
        return [Rule(s, e) for s, e in site.items()]
    return [Rule(site, edit)]


def _state(trace: Any) -> dict:
    st = trace.__dict__.get("_intervention")
    if st is None:
        st = trace.__dict__["_intervention"] = {"recipe": Recipe(), "audit": [], "warned": False, "last_run": None,
                                                "is_fork": False}
    return st


def do(trace: Any, site: Any, edit: Any = None, /, *, model: Any = None, inputs: Any = None, intervention: Any = None,
       input_kwargs: dict | None = None, loss: Any = None) -> Any:
    from torchlens.intervention.edits import stamp_tensors
    from torchlens.options import InterventionOptions, as_intervention_options

    opts = as_intervention_options(intervention)
    rules = normalize_plan(site, edit)
    for r in rules:
        stamp_tensors(r.edit)
    if loss is not None:
        if not callable(loss):
            raise InterventionError("do_loss_not_callable", f"loss= takes a callable of the returned trace, not {type(loss).__name__}",
                                    remedy="loss=lambda t: t.output.sum()")
        if not any(_is_grad(r.target) for r in rules):
            raise InterventionError("do_loss_without_gradient_site", "loss= was given but no rule edits a gradient site",
                                    remedy="wrap the site in tl.grad(...) or drop loss=")
    engine = opts.engine
    if engine is None:
        if (model is None) != (inputs is None):
            raise InterventionError("rerun_inputs_required", "the rerun engine needs both model= and inputs=",
                                    remedy="pass both, or neither for the replay engine")
        engine = "rerun" if model is not None else "replay"
    if engine == "rerun" and (model is None or inputs is None):
        raise InterventionError("rerun_inputs_required", "engine='rerun' needs model= and inputs=",
                                remedy="trace.do(site, edit, model=model, inputs=x)")
    if engine == "replay":
        for r in rules:
            if _is_grad(r.target):
                raise InterventionError(
                    "replay_gradient_edit_unsupported", f"{r.target!r} is a gradient site; replay re-executes forward ops only",
                    remedy="Pass model= and inputs= to rerun with the edit armed, then call result.backward(loss), "
                    "or stage it with engine='set_only' and call trace.backward(loss) on this trace")
    # resolve every site, and check each edit fits the sites' recorded shapes, before anything changes
    # (a rerun checks against the shapes of its own inputs, in live_capture)
    resolved = lower_rules(trace, rules)
    if engine != "rerun":
        check_sites(trace, resolved)
    st = _state(trace)
    if engine == "set_only":
        _warn_root(trace, st)
        st["recipe"] = Recipe(st["recipe"].rules + tuple(rules))
        _audit(st, engine, resolved)
        return trace
    if engine == "rerun":
        from torchlens.intervention.live import rerun

        new_recipe = Recipe(st["recipe"].rules + tuple(rules))
        result = rerun(trace, model, inputs, new_recipe, on_zero_fire=opts.on_zero_fire, input_kwargs=input_kwargs)
        _warn_root(trace, st)
        _adopt(trace, result)
        st = _state(trace)
        st["recipe"] = new_recipe
        st["last_run"] = result.__dict__["_intervention"]["last_run"]
        _audit(st, engine, resolved)
        if loss is not None:
            trace.backward(loss(trace))
        return trace
    # replay
    from torchlens.intervention.replay import replay

    if opts.differentiable:
        target = fork(trace, f"{trace.name}-differentiable")
        grad_on = getattr(trace._backend.edit_ops(), "grad_enabled", None)
        import contextlib

        with grad_on() if grad_on is not None else contextlib.nullcontext():
            return do(target, site, edit, intervention=InterventionOptions(
                engine="replay", on_zero_fire=opts.on_zero_fire, allow_changed_params=opts.allow_changed_params))

    plan: dict[str, list[Edit]] = {}
    for r, labels, applied, _ in resolved:
        for label in labels:
            plan.setdefault(label, []).append(applied)
    if not plan:
        _zero_fire(opts.on_zero_fire, "trace_zero_fire", rules, trace)
    report: dict = {}
    changed, reexecuted = replay(trace, plan, allow_changed_params=opts.allow_changed_params, report=report)
    _warn_root(trace, st)
    for label, outs in changed.items():
        op = trace._ops[label]
        op._outputs = tuple(outs)
        op.saved = True
    st["recipe"] = Recipe(st["recipe"].rules + tuple(rules))
    st["last_run"] = {"engine": "replay", "origins": sorted(plan, key=lambda lb: trace._ops[lb].index),
                      "cone": list(changed), "reexecuted": reexecuted, "num_reexecuted": len(reexecuted),
                      "replayed_with_changed_params": report.get("replayed_with_changed_params", [])}
    _audit(st, engine, resolved)
    return trace


def _zero_fire(policy: str, code: str, rules: list[Rule], trace: Any = None) -> None:
    from torchlens.select.hints import no_match_hint  # why it matched nothing (issue 27)

    hints = [h for h in (no_match_hint(trace, r.target) for r in rules) if h]
    msg = "the intervention matched no site: " + ", ".join(repr(r.target) for r in rules) + "".join(f" ({h})" for h in hints)
    if policy == "error":
        raise InterventionError(code, msg, remedy="check the selector against trace.labels", hints=hints)
    if policy == "warn":
        warnings.warn(f"[{code}] {msg}", RuntimeWarning, stacklevel=4)


def _warn_root(trace: Any, st: dict) -> None:
    if not st["is_fork"] and not st["warned"]:
        st["warned"] = True
        warnings.warn("editing a root trace in place; use trace.fork() for branched experiments",
                      TraceMutationWarning, stacklevel=4)


def lower_rules(trace: Any, rules: list[Rule]) -> list[tuple[Rule, list[str], Edit, str]]:
    """(rule, op labels, edit to apply, audit source) for each rule; subspace and units
    sites become their inner site with a projecting edit."""
    from torchlens.intervention.subspace import lower

    out = []
    for r in rules:
        site, applied, source = lower(r.target, r.edit)
        out.append((r, resolve_site(trace, site), applied, source))
    return out


def check_sites(trace: Any, resolved: list) -> None:
    """Run each edit's site check against the recorded shape of every output slot it will
    edit (helper arguments vs the site: axes, lengths, broadcasting), before anything changes."""
    for _rule, labels, applied, _source in resolved:
        if applied.check is None:
            continue
        for label in labels:
            for shape in trace._ops[label].shapes or ():
                if shape is not None:
                    applied.check_site(shape)


def _audit(st: dict, engine: str, resolved: list) -> None:
    for r, labels, applied, source in resolved:
        st["audit"].append({
            "engine": engine, "edit": r.edit.name, "applied": applied.name, "edit_identity": applied.identity(),
            "target": repr(r.target), "signal": r.signal, "sites": [{"label": lb, "source": source} for lb in labels],
            "fire_count": len(labels), "status": "fired" if labels else "no_fire",
        })


def fork(trace: Any, name: str | None = None) -> Any:
    """A copy whose records can be edited independently; payload values are shared until
    an edit replaces them. Edits never write into a shared value: built-in helpers build new
    values, and a user callable is handed its own copy (`edits.fire`)."""
    new = copy.copy(trace)
    new.__dict__ = dict(trace.__dict__)
    new.name = name or f"{trace.name}-fork"
    new._ops = {}
    for label, op in trace._ops.items():
        o = copy.copy(op)
        o.children = list(op.children)
        o._trace = new
        new._ops[label] = o
    new._layers = {}
    for label, layer in trace._layers.items():
        lay = copy.copy(layer)
        lay._trace = new
        lay.ops = [new._ops[o.label] for o in layer.ops]
        new._layers[label] = lay
    for attr in ("_modules", "_module_calls", "_params", "_buffers"):
        d = {}
        for k, rec in getattr(trace, attr).items():
            r = copy.copy(rec)
            r._trace = new
            d[k] = r
        setattr(new, attr, d)
    for m in new._modules.values():
        m.calls = [new._module_calls[c.label] for c in m.calls]
    old = _state(trace)
    new.__dict__["_intervention"] = {"recipe": old["recipe"], "audit": list(old["audit"]), "warned": True,
                                     "last_run": old["last_run"], "is_fork": True}
    return new


def _adopt(trace: Any, result: Any) -> None:
    """Make `trace` hold `result`'s records (the rerun engine's result), in place."""
    keep_state = trace.__dict__.get("_intervention")
    name = trace.name
    trace.__dict__.update(result.__dict__)
    trace.name = name
    if keep_state is not None:
        trace.__dict__["_intervention"] = keep_state
    for coll in (trace._ops, trace._layers, trace._modules, trace._module_calls, trace._params, trace._buffers):
        for rec in coll.values():
            rec._trace = trace


def clear_edits(trace: Any, site: Any = None, handle: Any = None, *, strict: bool = False) -> Any:
    st = _state(trace)
    rules = st["recipe"].rules
    if site is None and handle is None:
        if strict:
            raise InterventionError("clear_edits_unmatched", "clear_edits(strict=True) needs site= or handle=",
                                    remedy="name the site to clear")
        kept: tuple = ()
    else:
        key = repr(site) if not isinstance(site, str) else site
        kept = tuple(r for i, r in enumerate(rules)
                     if not ((site is not None and (r.target == site or repr(r.target) == key)) or handle == i))
        if strict and len(kept) == len(rules):
            raise InterventionError("clear_edits_unmatched", f"no staged edit matches {site!r}",
                                    remedy="list the staged rules with trace.recipe.rules")
    st["recipe"] = Recipe(kept)
    return trace


def recipe(trace: Any) -> Recipe:
    return _state(trace)["recipe"]


def is_pristine(trace: Any) -> bool:
    return not _state(trace)["audit"]


def run(trace: Any, model: Any, inputs: Any, /, *, input_kwargs: dict | None = None, on_zero_fire: str = "warn") -> Any:
    """Re-execute `model` on `inputs` with this trace's recipe live; returns a new Trace."""
    from torchlens.intervention.live import rerun

    result = rerun(trace, model, inputs, _state(trace)["recipe"], on_zero_fire=on_zero_fire, input_kwargs=input_kwargs,
                   check_graph=False)
    st = _state(result)
    st["recipe"] = _state(trace)["recipe"]
    st["is_fork"] = True
    return result


def as_rules(edit_or_rules: Any) -> list[Rule]:
    return [Rule(s, as_edit(e)) for s, e in edit_or_rules]
