"""Trace verbs for interventions: do, fork, clear_edits, run (attached to Trace)."""

from __future__ import annotations

import warnings
from typing import Any

from torchlens.backends.protocol import edit_ops_of
from torchlens.errors import InterventionError, TraceMutationWarning
from torchlens.intervention.edits import Edit, as_edit, fire
from torchlens.intervention.recipe import Recipe, Rule
from torchlens.intervention.state import InterventionState, state_of


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


def _state(trace: Any) -> InterventionState:
    """The trace's typed intervention state (made on first use)."""
    return state_of(trace)


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
    if engine == "rerun":
        _refuse_bound_method(trace)
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
        st.recipe = Recipe(st.recipe.rules + tuple(rules))
        _audit(st, engine, resolved)
        armable = _arming_ops(trace) is not None and _backward_ready(trace)
        for row, r in zip(st.audit[-len(resolved):], rules):
            if r.signal == "backward":
                # on a backward-ready capture whose backend can hook its kept graph, trace.backward
                # arms it ("trace_backward" once armed); else it waits for a rerun's backward
                row["armed_for"] = "trace_backward_pending" if armable else "next_rerun"
        return trace
    if engine == "rerun":
        from torchlens.intervention.live import rerun

        new_recipe = Recipe(st.recipe.rules + tuple(rules))
        result = rerun(trace, model, inputs, new_recipe, on_zero_fire=opts.on_zero_fire, input_kwargs=input_kwargs)
        _warn_root(trace, st)
        _adopt(trace, result)
        st = _state(trace)
        st.recipe = new_recipe
        st.steered_digest = new_recipe.digest
        st.live_armed = _state(result).live_armed
        st.last_run = _state(result).last_run
        _audit(st, engine, resolved)
        if loss is not None:
            trace.backward(loss(trace))
        return trace
    # replay
    from torchlens.intervention.replay import replay

    if opts.differentiable:
        target = fork(trace, f"{trace.name}-differentiable")
        backend = trace._backend
        ops = edit_ops_of(backend, "differentiable replay")
        backend.capabilities().refuse_unless("backward_capture", f"differentiable replay needs gradients: the "
                                             f"{backend.name} backend does not declare backward_capture")
        from torchlens.intervention.edits import differentiable_replay  # S2: keep_grad_replay_frontier

        with ops.grad_enabled(), differentiable_replay():  # DifferentiableEditOps (checked at registration)
            result = do(target, site, edit, intervention=InterventionOptions(
                engine="replay", on_zero_fire=opts.on_zero_fire, allow_changed_params=opts.allow_changed_params))
        _keep_replay_for_backward(result, ops)
        return result

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
        trace._ops[label].replace_outputs(outs)
    if trace._output_state is None and any(trace._ops[lb].kind == "output" for lb in changed):
        trace.drop_output("edited")  # the live return is the clean value
    if steered_digest(trace) == st.recipe.digest:  # the values reflected the recipe; now they reflect the new one
        st.steered_digest = Recipe(st.recipe.rules + tuple(rules)).digest
    st.recipe = Recipe(st.recipe.rules + tuple(rules))
    st.last_run = {"engine": "replay", "origins": sorted(plan, key=lambda lb: trace._ops[lb].index),
                      "cone": list(changed), "reexecuted": reexecuted, "num_reexecuted": len(reexecuted),
                      "replayed_with_changed_params": report.get("replayed_with_changed_params", [])}
    _audit(st, engine, resolved)
    return trace


def _backward_ready(trace: Any) -> bool:
    """The trace was captured keeping its backward graph (`CaptureOptions(backward_ready=True)`)."""
    from torchlens.options import CaptureOptions, TraceOptions

    opts = trace.options
    if isinstance(opts, TraceOptions):
        opts = opts.capture_options()
    return isinstance(opts, CaptureOptions) and bool(opts.backward_ready or opts.save_grads)


def _keep_replay_for_backward(trace: Any, ops: Any) -> None:
    """Hand a graph-free backend (`ReplayGradientOps`) every edit a differentiable fork's values
    reflect, when they reflect exactly its recipe of forward rules (else its backward refuses)."""
    from torchlens.intervention.state import ReplayGradientOps, offers

    st = _state(trace)
    if not offers(ops, ReplayGradientOps) or st.steered_digest != st.recipe.digest:
        return
    if any(r.signal == "backward" for r in st.recipe.rules):
        return
    edits: dict[str, list[Edit]] = {}
    for _r, labels, applied, _source in lower_rules(trace, list(st.recipe.rules)):
        for label in labels:
            edits.setdefault(label, []).append(applied)
    ops.keep_replay_for_backward(trace, edits)


def _zero_fire(policy: str, code: str, rules: list[Rule], trace: Any = None) -> None:
    from torchlens.select.hints import no_match_hint  # why it matched nothing (issue 27)

    hints = [h for h in (no_match_hint(trace, r.target) for r in rules) if h]
    msg = "the intervention matched no site: " + ", ".join(repr(r.target) for r in rules) + "".join(f" ({h})" for h in hints)
    extra = _non_tensor_module_output(trace, rules)
    if extra:
        msg += f"; {extra['reason_detail']}"
    if policy == "error":
        raise InterventionError(code, msg, remedy="check the selector against trace.labels", hints=hints, **extra)
    if policy == "warn":
        from torchlens.errors import ZeroFireWarning

        warnings.warn(ZeroFireWarning(code, msg, remedy="check the selector against trace.labels", hints=hints, **extra),
                      stacklevel=4)


def _non_tensor_module_output(trace: Any, rules: list[Rule]) -> dict[str, str]:
    """`reason="module_output_not_tensor"` and a sentence, when a plain module rule fired
    nowhere because the module ran but returned no tensor (a distribution object): the
    module's calls recorded no output op. The sentence names the ops to target instead."""
    from torchlens.intervention.live import module_rule_parts

    if trace is None:
        return {}
    for r in rules:
        parts = module_rule_parts(r.target)
        mod = trace._modules.get(parts[0]) if parts else None
        if mod is None or not mod.calls or any(c.output_labels for c in mod.calls):
            continue
        inside = [trace._ops[lb] for c in mod.calls for lb in c.op_labels if lb in trace._ops]
        def checks_only(o: Any) -> bool:  # a validity check of the output object (bool ops), not a value
            return str(o.dtype or "").endswith("bool")

        kids = {o.label: [trace._ops[c] for c in o.children if c in trace._ops] for o in inside}
        leaving = [o.label for o in inside if not checks_only(o) and o.kind == "op" and all(
            checks_only(c) or mod.address not in (c.modules or ()) for c in kids[o.label])]
        detail = (f"module {mod.address!r} output is not a tensor; target its parameter ops instead"
                  + (f" ({', '.join(leaving[:6])})" if leaving else ""))
        return {"reason": "module_output_not_tensor", "reason_detail": detail}
    return {}


def _warn_root(trace: Any, st: InterventionState) -> None:
    if not st.is_fork and not st.warned:
        st.warned = True
        warnings.warn("editing a root trace in place; use trace.fork() for branched experiments",
                      TraceMutationWarning, stacklevel=4)


def lower_rules(trace: Any, rules: list[Rule]) -> list[tuple[Rule, list[str], Edit, str]]:
    """(rule, op labels, edit to apply, audit source) for each rule; subspace and units
    sites become their inner site with a projecting edit."""
    from torchlens.intervention.subspace import lower

    out = []
    for r in rules:
        if getattr(r.target, "_tl_facet", False):  # tl.facet / tl.head: written back into each home op
            from torchlens.select.facet import lower_facet

            out += [(r, [label], applied, source) for label, applied, source in lower_facet(trace, r.target, r.edit)]
            continue
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


def _audit(st: InterventionState, engine: str, resolved: list) -> None:
    for r, labels, applied, source in resolved:
        st.audit.append({
            "engine": engine, "edit": r.edit.name, "applied": applied.name, "edit_identity": applied.identity(),
            "target": repr(r.target), "signal": r.signal, "sites": [{"label": lb, "source": source} for lb in labels],
            "fire_count": len(labels), "status": "fired" if labels else "no_fire",
            **applied.audit_extra,  # S2: facts the edit adds (a Population mean: stochastic=False)
        })


def fork(trace: Any, name: str | None = None) -> Any:
    """A copy whose records can be edited independently; payload values are shared until
    an edit replaces them. Edits never write into a shared value: built-in helpers build new
    values, and a user callable is handed its own copy (`edits.fire`)."""
    new = trace.copy(name or f"{trace.name}-fork")  # records copied by their owner; no live output
    old = _state(trace)
    new._intervention = old.forked(steered_digest(trace))
    return new


def _adopt(trace: Any, result: Any) -> None:
    """Make `trace` hold `result`'s records (the rerun engine's result), in place."""
    trace.adopt(result)


def clear_edits(trace: Any, site: Any = None, handle: Any = None, *, strict: bool = False) -> Any:
    st = _state(trace)
    rules = st.recipe.rules
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
    st.recipe = Recipe(kept)
    if trace.__dict__.get("_facet_writes"):  # the accepted same-home facet write masks go with their rules
        from torchlens.intervention.edits import as_edit

        live = {(repr(r.target), as_edit(r.edit).identity()) for r in kept if getattr(r.target, "_tl_facet", False)}
        kept_writes = {label: [(k, m) for k, m in writes if k in live] for label, writes in trace._facet_writes.items()}
        trace._facet_writes = {label: w for label, w in kept_writes.items() if w} or None
    return trace


def recipe(trace: Any) -> Recipe:
    return _state(trace).recipe


def is_pristine(trace: Any) -> bool:
    """Read from the evidence the trace carries (its audit rows and direct writes, both
    saved with it): True only when nothing ever intervened."""
    st = _state(trace)
    return not st.audit and not st.direct_writes and not st.direct_write_dirty


def note_direct_write(trace: Any, label: str) -> bool:
    """Record a direct write (`op.out = v`) as evidence; True the first time for this trace."""
    st = _state(trace)
    if label not in st.direct_writes:
        st.direct_writes.append(label)
    first = not st.direct_write_dirty
    st.direct_write_dirty = True
    return first


def restore_state(trace: Any, saved: dict) -> None:
    """Give a loaded trace the intervention state its artifact saved (recipe and evidence)."""
    st = _state(trace)
    st.recipe = saved["recipe"]
    st.audit = list(saved["audit"])
    st.steered_digest = saved["recipe"].digest if saved["steered"] else None
    if saved["direct_writes"]:
        st.direct_writes = list(saved["direct_writes"])
        st.direct_write_dirty = True


def unapplied_gradient_rules(trace: Any) -> list[Rule]:
    """Called by `trace.backward` before it runs: arm the gradient rules of the trace's recipe
    that its recorded backward graph does not carry yet (staged with `engine="set_only"` after
    capture) on that graph, when the backend can (`GradientArmingOps`: a backward-ready capture
    whose saved values reach the live graph); return the rules left unapplied (all of them when
    any site cannot be armed; nothing is armed then), which `trace.backward` refuses."""
    st = trace._intervention
    if st is None:
        return []
    live = set(st.live_armed)
    pending = [r for r in st.recipe.rules if r.signal == "backward" and r.identity() not in live]
    if pending:
        return _arm_on_graph(trace, st, pending)
    return []


def _arming_ops(trace: Any) -> Any:
    """The backend's edit ops when they can arm gradient edits after capture, else None."""
    from torchlens.backends.protocol import SupportsInterventions, supports
    from torchlens.intervention.state import GradientArmingOps, offers

    backend = trace._backend
    if backend is None or not supports(backend, SupportsInterventions):
        return None
    ops = backend.edit_ops()
    return ops if offers(ops, GradientArmingOps) else None


def _arm_on_graph(trace: Any, st: InterventionState, pending: list[Rule]) -> list[Rule]:
    """Arm `pending` gradient rules on the trace's kept backward graph (see
    `unapplied_gradient_rules`); the rules left unapplied."""
    from torchlens.intervention.edits import HookContext

    ops = _arming_ops(trace)
    if ops is None:
        return pending
    resolved = lower_rules(trace, pending)
    if any(not labels for _r, labels, _a, _s in resolved):
        return pending  # a rule that matches no site here: refused, never silently dropped
    by_label: dict[str, list[tuple[Rule, Edit]]] = {}
    for r, labels, applied, _source in resolved:
        for label in labels:
            by_label.setdefault(label, []).append((r, applied))
    run_state: dict = {}

    def apply(label: str, slot: int, grad: Any) -> Any:
        current = {r.identity() for r in st.recipe.rules}  # a rule cleared since arming no longer edits
        edits = [e for r, e in by_label[label] if r.identity() in current]
        if not edits:
            return grad
        ctx = HookContext(label, trace._ops.get(label), trace, ops, signal="backward", run_state=run_state)
        for e in edits:
            grad = fire(e, grad, ctx)
        st.armed_site_grads.setdefault(label, {})[slot] = ops.clone(grad)  # the site's own `grad`
        return grad

    if ops.arm_gradient_edits(trace, list(by_label), apply):
        return pending
    st.live_armed = tuple(st.live_armed) + tuple(r.identity() for r in pending)
    for row in st.audit:
        if row.get("armed_for") == "trace_backward_pending" and any(row["target"] == repr(r.target) for r in pending):
            row["armed_for"] = "trace_backward"
    return []


def refuse_placeholders(rules: Any) -> None:
    """A rule whose edit or target is a saved placeholder for user code cannot run: refuse
    (`run_intervention_spec_not_persisted`, naming the rule) before anything runs."""
    from torchlens.io.intervention import not_persisted
    from torchlens.select.selectors import PlaceholderSelector

    for i, r in enumerate(rules):
        if r.edit.portability == "placeholder":
            raise not_persisted(i, str(dict(r.edit.kwargs).get("qualname") or r.edit.name))
        if isinstance(r.target, PlaceholderSelector):
            raise not_persisted(i, r.target.text)


_FAST_FALLBACK = ("run_capability_unavailable", "rerun_graph_diverged", "output_structure_mismatch")


def steered_digest(trace: Any) -> str | None:
    """The digest of the recipe the trace's recorded values reflect (a plain capture: the
    empty recipe's; None when unknown)."""
    st = _state(trace)
    return st.steered_digest


def _refuse_bound_method(trace: Any) -> None:
    """Spec glossary (bound-method capture, Errors): a capture rooted at a bound method
    cannot be rerun (the rerun entry point is the model's call); replay is unaffected."""
    entry = str(getattr(trace.provenance, "root_entry_point", "module"))
    if entry.startswith("bound_method:"):
        raise InterventionError("rerun_entry_point_unsupported", f"this trace was captured from {entry[13:]}, a bound "
                                "method; the rerun engine re-executes the model's call and cannot rerun it",
                                remedy="edit it with the replay engine (omit model= and inputs=), or capture "
                                "tl.trace(model, ...) to rerun", root_entry_point=entry)


def run(trace: Any, model: Any, inputs: Any, /, *, input_kwargs: dict | None = None, on_zero_fire: str = "warn") -> Any:
    """Re-execute `model` on `inputs` with this trace's recipe live; returns a new Trace.

    A trace that saved a selection of sites, or stages an intervention, tries the guarded fast
    rerun first (`last_run["engine"] == "guarded_fast"`) and falls back to the capture engine
    on a typed refusal (`engine == "rerun"`, `fast_refused == "<code>:<stage>"`)."""
    from torchlens.intervention.fast import fast_rerun
    from torchlens.intervention.live import _as_args, rerun

    _refuse_bound_method(trace)
    recipe_ = _state(trace).recipe
    refuse_placeholders(recipe_.rules)
    fast_refused = None
    saved_all = all(o.saved for o in trace._ops.values())
    if recipe_.rules or not saved_all:
        try:
            result = fast_rerun(trace, model, _as_args(inputs), dict(input_kwargs or {}), recipe_, steered_digest(trace))
        except InterventionError as exc:
            if exc.code not in _FAST_FALLBACK or "stage" not in exc.fields:
                raise
            fast_refused = f"{exc.code}:{exc.fields['stage']}"
        else:
            st = _state(result)
            st.is_fork = True
            unfired = [r for r in recipe_.rules if repr(r.target) in st.last_run["hooks_unfired"]]
            _audit(st, "guarded_fast", [(r, [] if r in unfired else resolve_site(trace, r.target), r.edit, "module_hook")
                                        for r in recipe_.rules])
            if unfired:
                _zero_fire(on_zero_fire, "rerun_zero_fire", unfired, trace)
            return result
    result = rerun(trace, model, inputs, recipe_, on_zero_fire=on_zero_fire, input_kwargs=input_kwargs,
                   check_graph=False, fast_refused=fast_refused)
    st = _state(result)
    st.recipe = _state(trace).recipe
    st.is_fork = True
    return result


def as_rules(edit_or_rules: Any) -> list[Rule]:
    return [Rule(s, as_edit(e)) for s, e in edit_or_rules]
