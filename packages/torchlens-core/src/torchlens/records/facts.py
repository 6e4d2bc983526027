"""Trace fact groups: `trace.source`, `trace.health`, `trace.graph`, `trace.autograd`.

Read-only views that sort a Trace's capture facts by concern (spec glossary l. 13-20). Each
is computed from the trace's saved records, so a loaded trace answers exactly as the
original did. A spec field this build cannot compute truthfully is None, and the group's
`unavailable` maps it to the reason (docs/reference/trace-facts.md); nothing is guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_NOT_RECORDED = "the capture does not record the model's source code"
_NO_WITNESS = "this build runs no completeness witness or escape detector"
_NO_BRANCHES = "this build does not record control-flow branches"


@dataclass(frozen=True)
class SourceFacts:
    """`trace.source`: facts about the model's source. `class_name` and `class_qualname`
    come from the root module record; file, line, docstring and signatures are not recorded
    (None, reason in `unavailable`)."""

    class_name: str | None
    class_qualname: str | None
    class_file: None = None
    class_line: None = None
    class_docstring: None = None
    init_signature: None = None
    forward_signature: None = None
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HealthFacts:
    """`trace.health`: how complete the capture really was. `verified` and
    `verification_reason` repeat the provenance verdict; the witness and escape-detector
    counts are None (no such detector runs in this build)."""

    verified: bool
    verification_reason: str | None
    num_nonfinite_ops: int
    completeness_verified: None = None
    completeness_mode: None = None
    num_witness_events: None = None
    num_accounted_witness_events: None = None
    num_unaccounted_witness_events: None = None
    escape_detector_verified: None = None
    escape_detector_mode: None = None
    num_escape_detector_events: None = None
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GraphFacts:
    """`trace.graph`: the graph's shape. `edges` are (parent, child) op labels; a trace is
    recurrent when some layer ran more than once; `orphans` are ops with neither parents nor
    children; `tied_param_groups` are the module paths of each tied parameter (its address
    first, then its recorded aliases)."""

    edges: tuple[tuple[str, str], ...]
    is_recurrent: bool
    orphans: tuple[str, ...]
    tied_param_groups: tuple[tuple[str, ...], ...]
    is_dynamic: None = None
    conditionals: None = None
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AutogradFacts:
    """`trace.autograd`: the backward records. `backward_passes` counts successful
    `trace.backward` calls (saved with the trace); `has_grads` says whether any op holds a
    saved gradient. `grad_fns` holds the captured grad_fn graph as portable `GradFn` records
    (`torchlens.records.autograd`), `grad_fn_order` their labels in a topological order from
    the roots, and `grad_fn_calls` the nodes' runs during backward passes; each is None, with
    the reason in `unavailable`, when the capture recorded none."""

    backward_passes: int
    has_backward_pass: bool
    has_grads: bool
    ops_with_grads: tuple[str, ...]
    grad_fns: Any = None
    grad_fn_calls: Any = None
    grad_fn_order: tuple[str, ...] | None = None
    unavailable: dict[str, str] = field(default_factory=dict)


def source_facts(trace: Any) -> SourceFacts:
    root = next((m for m in trace._modules.values() if getattr(m, "parent", None) is None), None)
    name = getattr(root, "class_name", None) or (trace.provenance.model_class or None)
    qual = getattr(root, "class_qualname", None)
    why = {k: _NOT_RECORDED for k in ("class_file", "class_line", "class_docstring", "init_signature",
                                       "forward_signature")}
    if qual is None:
        why["class_qualname"] = "the trace has no root module record (a function was traced)"
    return SourceFacts(class_name=name, class_qualname=qual, unavailable=why)


def health_facts(trace: Any) -> HealthFacts:
    why = {k: _NO_WITNESS for k in ("completeness_verified", "completeness_mode", "num_witness_events",
                                     "num_accounted_witness_events", "num_unaccounted_witness_events",
                                     "escape_detector_verified", "escape_detector_mode", "num_escape_detector_events")}
    prov = trace.provenance
    return HealthFacts(verified=bool(prov.verified), verification_reason=prov.verification_reason,
                       num_nonfinite_ops=len(trace.ops.nonfinite), unavailable=why)


def graph_facts(trace: Any) -> GraphFacts:
    ops = trace._ops.values()
    # one Param per stored value; its recorded aliases are the other paths of the tie
    tied = tuple(p.addresses for p in trace._params.values() if p.aliases)
    return GraphFacts(
        edges=tuple(trace.graph_edges),
        is_recurrent=any(len(layer.ops) > 1 for layer in trace._layers.values()),
        orphans=tuple(o.label for o in ops if not o.parents and not o.children),
        tied_param_groups=tied,
        unavailable={"is_dynamic": _NO_BRANCHES, "conditionals": _NO_BRANCHES})


def autograd_facts(trace: Any) -> AutogradFacts:
    with_grads = tuple(o.label for o in trace._ops.values() if o.grads is not None)
    passes = int(trace.__dict__.get("_backward_passes", 0))
    from torchlens.records.autograd import grad_fn_calls_of, grad_fns_of

    grad_fns, why_fns = grad_fns_of(trace)
    calls, why_calls = grad_fn_calls_of(trace)
    why: dict[str, str] = {}
    if grad_fns is None:
        why["grad_fns"] = why["grad_fn_order"] = str(why_fns)
    if calls is None:
        why["grad_fn_calls"] = str(why_calls)
    return AutogradFacts(backward_passes=passes, has_backward_pass=passes > 0 or bool(with_grads),
                         has_grads=bool(with_grads), ops_with_grads=with_grads, grad_fns=grad_fns, grad_fn_calls=calls,
                         grad_fn_order=None if grad_fns is None else grad_fns.labels, unavailable=why)
