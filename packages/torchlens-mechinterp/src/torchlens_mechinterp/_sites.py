"""Where the kit's head-level functions (scores, prompts, patching) find attention in a trace.

An attention call is a module call an attention recipe describes (it declares `q`, `pattern`
or `z`), found from the captured graph, never from module names. When the payloads a facet
reads were not kept, the caller is refused with the COMPLETE set of missing op labels
(`require_payloads`, shared with the rest of the kit), never a partial table.
"""

from __future__ import annotations

from typing import Any

from torchlens.errors import MechInterpError

ATTENTION_FACETS = ("q", "pattern", "z")


def attention_calls(trace: Any) -> list[Any]:
    """Every attention module call, in execution order (a module called twice gives two)."""
    from torchlens.facets.view import call_entries

    calls = []
    for module in trace._modules.values():
        for call in module.calls:
            entries = call_entries(call)
            if any(entries.get(n) is not None and entries[n].spec is not None for n in ATTENTION_FACETS):
                calls.append(call)
    order = {label: i for i, label in enumerate(trace._ops)}
    return sorted(calls, key=lambda c: min((order.get(lb, 0) for lb in c.op_labels), default=0))


def facet_specs(trace: Any, calls: list[Any], name: str, *, function: str, extra: tuple = ()) -> list[Any]:
    """The spec of facet `name` for every call; refuses with every missing payload at once
    (including the `extra` op labels the caller also reads)."""
    from torchlens.facets.view import call_entries, missing_inputs

    specs, absent = [], []
    missing = {lb for lb in extra if lb not in trace._ops or not trace._ops[lb].saved}
    for call in calls:
        entry = call_entries(call).get(name)
        if entry is None or entry.spec is None:
            absent.append(call.label)
            specs.append(None)
            continue
        missing.update(missing_inputs(trace, entry.spec))
        if entry.status == "needs_capture" and not missing_inputs(trace, entry.spec):
            raise MechInterpError("mi_facet_needs_capture", f"{function}: facet {name!r} of {call.label!r} is not "
                                  f"readable in this capture: {entry.reason}", remedy=entry.reason or "recapture",
                                  function=function, facet=name, module=call.label)
        specs.append(entry.spec)
    if absent:
        raise MechInterpError("mi_facet_absent", f"{function}: {len(absent)} attention call(s) declare no {name!r} "
                              f"facet ({', '.join(absent[:4])})", remedy="load the model with attention an attention "
                              "recipe describes (eager, or SDPA captured with CaptureOptions(save_args=True))",
                              function=function, facet=name, modules=absent)
    if missing:
        require_payloads(trace, sorted(missing), function=function)
    return specs


def require_payloads(trace: Any, sites: Any, *, function: str) -> None:
    """The kit's shared refusal (retention.require_payloads) when it exists; the same code
    and fields otherwise."""
    try:
        from torchlens_mechinterp.retention import require_payloads as shared
    except ImportError:
        shared = None
    if shared is not None:
        shared(trace, sites, function=function)
        return
    missing = sorted(lb for lb in sites if lb not in trace._ops or not trace._ops[lb].saved)
    if missing:
        raise MechInterpError("mi_payloads_missing", f"{function} needs {len(missing)} payload(s) this capture did "
                              f"not keep: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}",
                              remedy=f"capture again with save='all' or save={missing!r}", missing=missing,
                              function=function)


def facet_sites(trace: Any, calls: list[Any], name: str) -> list[str]:
    """The op labels facet `name` of every call reads (for retention plans)."""
    from torchlens.facets.view import call_entries

    out: list[str] = []
    for call in calls:
        e = call_entries(call).get(name)
        if e is None or e.spec is None:
            continue
        labels = e.spec.inputs if e.spec.home_kind == "computed" else (e.spec.home,)
        out.extend(lb for lb in labels if lb not in out)
    return out


def token_input_label(trace: Any) -> str | None:
    """The label of the integer token input op (saved or not), or None."""
    for op in trace.input_ops:
        dtype = str(getattr(op, "dtype", ""))
        if "int" in dtype or "long" in dtype:
            return op.label
    return None


def value(trace: Any, spec: Any) -> Any:
    from torchlens.facets.view import value_of

    return value_of(trace, spec)


def input_tokens(trace: Any) -> Any:
    """The integer token ids the trace was captured on ([batch, pos]), or None."""
    for op in trace.input_ops:
        if not op.saved:
            continue
        v = op.out
        dtype = str(getattr(v, "dtype", ""))
        if getattr(v, "ndim", 0) in (1, 2) and ("int" in dtype or "long" in dtype):
            return v if v.ndim == 2 else v.unsqueeze(0)
    return None
