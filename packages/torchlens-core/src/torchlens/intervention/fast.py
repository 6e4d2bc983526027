"""The guarded fast rerun: refresh a selective-save trace by one native forward with hooks.

`trace.run(model, x)` on a trace that saved a selection of sites (or stages plain module
edits) does not need a full capture: the saved sites it keeps are module outputs, so module
forward hooks can apply the staged `tl.module(...)` edits at each targeted module's exit and
copy the new values of the saved sites. That costs about a plain hooked forward. Every guard
that cannot prove the fast run equals what a capture would record refuses with a typed
`InterventionError` whose `fields["stage"]` names the guard; the legacy entry point then
falls back to the capture engine and reports `engine="rerun"` with
`fast_refused="<code>:<stage>"` (glossary: "Guarded fast rerun").

Guards, in order: the staged rules target only plain module selectors with no value
replacement (`fast_rerun_target_unsupported`); the recorded values reflect exactly the
staged recipe (`fast_rerun_graph_unsteered`); the backend can hook module exits; every saved
site is a module call's output (`fast_rerun_saved_site_unsupported`); the inputs have the
recorded shapes (`fast_live_input_signature`); each hooked module ran as often as recorded
and its output kept its recorded shape (`fast_live_call_fingerprint`); the model returned
one value where one output op was recorded (`fast_live_model_output_structure`).
"""

from __future__ import annotations

from typing import Any

from torchlens.backends.protocol import SupportsInterventions, supports
from torchlens.errors import InterventionError
from torchlens.intervention.edits import Edit, _builtin


def refused(stage: str, why: str, code: str = "run_capability_unavailable") -> InterventionError:
    return InterventionError(code, f"the guarded fast rerun cannot run: {why}", remedy="the capture engine reruns instead "
                             "(trace.run falls back on its own)", stage=stage)


def _observer(store: list, ops: Any) -> Edit:
    def fn(v: Any, ctx: Any) -> Any:
        store.append(ops.clone(v))
        return v

    return _builtin(Edit("observe", (), fn))


def _outermost_call(trace: Any, op: Any) -> tuple[str, int] | None:
    """(module address, call number) of the outermost module call whose output is `op`:
    its exit hook runs last, after every edit of an inner module that returned `op`."""
    best = None
    for cl in op.module_calls or ():
        call = trace._module_calls.get(cl)
        if call is None or op not in call.output_ops:
            continue
        address, _, n = cl.rpartition(":")
        depth = -1 if address == "self" else address.count(".")
        if best is None or depth < best[0]:
            best = (depth, address, int(n))
    return None if best is None else (best[1], best[2])


def check_rules(recipe: Any) -> list[tuple[str, int | None, Edit]]:
    """The staged rules as (module address, call or None, edit), or the target guard's refusal."""
    from torchlens.intervention.live import module_rule_parts

    out = []
    for rule in recipe.rules:
        parts = module_rule_parts(rule.target)
        if parts is None or rule.signal != "forward" or rule.edit.name == "replace_with":
            raise refused("fast_rerun_target_unsupported", f"{rule.target!r} -> {rule.edit.name} is not a plain module edit")
        out.append((parts[0], parts[1], rule.edit))
    return out


def fast_rerun(trace: Any, model: Any, inputs: tuple, input_kwargs: dict, recipe: Any, steered_digest: str) -> Any:
    """Run the guarded fast rerun; returns a new Trace (a fork of `trace` with refreshed saved
    sites, the live output and `last_run`), or raises the refusing guard's typed error."""
    from torchlens.intervention.edits import check_tensors_unchanged
    from torchlens.intervention.verbs import _state, fork

    rules = check_rules(recipe)
    if steered_digest != recipe.digest:
        raise refused("fast_rerun_graph_unsteered", "the recorded values do not reflect the staged recipe (an edit was "
                      "staged without running, or cleared after it ran)")
    proto = trace._backend
    if not supports(proto, SupportsInterventions):
        raise refused("fast_rerun_backend_unsupported", f"the {trace.provenance.backend} backend cannot hook module exits")
    for _a, _c, edit in rules:
        check_tensors_unchanged(edit)
    saved = [o for o in trace._ops.values() if o.saved and o.kind not in ("input", "output")]  # outputs: the return
    sites: dict[str, tuple[str, int]] = {}
    for op in saved:
        where = _outermost_call(trace, op) if op.kind == "op" else None
        if where is None:
            raise refused("fast_rerun_saved_site_unsupported", f"saved op {op.label} is not a module's output, so a "
                          "native forward cannot refresh it")
        sites[op.label] = where
    recorded_inputs = [o for o in trace._ops.values() if o.kind == "input"]
    given = list(inputs) + list(input_kwargs.values())
    if len(given) != len(recorded_inputs) or any(tuple(getattr(v, "shape", ())) != tuple(o.shape or ())
                                                  for v, o in zip(given, recorded_inputs)):
        raise refused("fast_live_input_signature", "the inputs differ in number or shape from the recorded ones",
                      code="rerun_graph_diverged")
    ops = proto.edit_ops()
    stores: dict[str, list] = {label: [] for label in sites}
    hooks = list(rules) + [(a, None, _observer(stores[label], ops)) for label, (a, _n) in sites.items()]
    fired: dict[int, int] = {}
    handle = proto.attach_module_edits(model, hooks, ops, fired)
    try:
        out = model(*inputs, **input_kwargs)
    finally:
        handle.remove()
    values = {}
    for label, (address, n) in sites.items():
        got = stores[label]
        recorded = len(trace._modules[address].calls) if address in trace._modules else None
        if recorded is not None and len(got) != recorded or len(got) < n:
            raise refused("fast_live_call_fingerprint", f"module {address} ran {len(got)} time(s), the capture recorded "
                          f"{recorded}", code="rerun_graph_diverged")
        value = got[n - 1]
        op = trace._ops[label]
        if tuple(getattr(value, "shape", ())) != tuple(op.shape or ()):
            raise refused("fast_live_call_fingerprint", f"{label} now has shape {tuple(getattr(value, 'shape', ()))}, "
                          f"the capture recorded {op.shape}", code="rerun_graph_diverged")
        values[label] = value
    if len(trace.output_ops) != 1 or not proto.is_tensor(out):
        raise refused("fast_live_model_output_structure", "the model's output is not the one tensor the capture recorded",
                      code="output_structure_mismatch")
    result = fork(trace, f"{trace.name}-run")
    for op, v in zip(recorded_inputs, given):
        if op.saved:  # a saved model input holds this run's input
            values[op.label] = ops.clone(v)
    for label, value in values.items():
        result._ops[label].replace_outputs((value,))
    out_op = result.output_ops[0]
    if out_op.saved:
        out_op.replace_outputs((out,))
    result.set_output(out)
    fired_rules = [repr(recipe.rules[i].target) for i in range(len(rules)) if fired.get(i)]
    unfired = [repr(recipe.rules[i].target) for i in range(len(rules)) if not fired.get(i)]
    st = _state(result)
    st.last_run = {"engine": "guarded_fast", "fast_refused": None, "hooks_fired": len(fired_rules),
                      "hooks_unfired": unfired, "refreshed": sorted(values, key=lambda lb: trace._ops[lb].index)}
    st.steered_digest = recipe.digest
    return result
