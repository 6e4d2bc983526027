"""Retention plans and the payload rule every kit function follows.

`require_payloads(trace, sites, *, function)` is the one gate: a kit function lists EVERY op
whose payload it will read, and refuses with the COMPLETE missing set (``mi_payloads_missing``)
before reading any, never a partial table, never a silent widening.

`retention_plan(trace, *functions, **kwargs)` names those sites WITHOUT reading a payload (it
works on a ``save="none"`` trace), prices them in bytes from the captured shapes and dtypes,
prints as a table, and composes into ``tl.trace(..., save=plan.save)`` (``plan | other``
merges plans).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from torchlens.errors import MechInterpError


def _missing(trace: Any, labels: Iterable[str]) -> list[str]:
    ops = trace._ops
    return [lab for lab in dict.fromkeys(labels) if lab not in ops or not ops[lab].saved]


def require_payloads(trace: Any, sites: Iterable[str], *, function: str) -> None:
    """Refuse (``mi_payloads_missing``) unless every op label in `sites` has a saved payload.

    The refusal's ``missing`` field lists the COMPLETE missing set, in the order given; its
    remedy is a ``save=`` list that would capture them. Nothing is read or mutated."""
    missing = _missing(trace, sites)
    if missing:
        shown = ", ".join(repr(m) for m in missing[:6]) + (" ..." if len(missing) > 6 else "")
        raise MechInterpError("mi_payloads_missing", f"{function} needs {len(missing)} payload(s) this trace did not "
                              f"save: {shown}", remedy=f"capture again with save='all', or with "
                              f"save=torchlens.mechinterp.retention_plan(trace, {function!r}).save "
                              f"(the complete list is exc.fields['missing'])", function=function, missing=missing)


def _nbytes(op: Any) -> int:
    import math

    import numpy as np

    shape = tuple(op.shape or ())
    try:
        import torch

        item = torch.empty((), dtype=op.dtype).element_size() if isinstance(op.dtype, torch.dtype) else \
            np.dtype(str(op.dtype)).itemsize
    except Exception:  # noqa: BLE001 - an exotic dtype: fall back to the recorded size
        return int(op.nbytes or 0)
    return int(math.prod(shape)) * int(item)


@dataclass
class RetentionPlan:
    """The op payloads a set of kit calls read: `sites` (label -> bytes), `functions` (which
    calls asked for them), `save` (a list tl.trace's save= accepts), `total_bytes`."""

    sites: dict[str, int] = field(default_factory=dict)
    functions: tuple[str, ...] = ()
    reasons: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def save(self) -> list[str]:
        return list(self.sites)

    @property
    def total_bytes(self) -> int:
        return sum(self.sites.values())

    def __or__(self, other: "RetentionPlan") -> "RetentionPlan":
        if not isinstance(other, RetentionPlan):
            return NotImplemented
        sites = dict(self.sites)
        sites.update(other.sites)
        reasons = {k: tuple(dict.fromkeys(self.reasons.get(k, ()) + other.reasons.get(k, ()))) for k in sites}
        return RetentionPlan(sites, tuple(dict.fromkeys(self.functions + other.functions)), reasons)

    def __len__(self) -> int:
        return len(self.sites)

    def __contains__(self, label: object) -> bool:
        return label in self.sites

    def __str__(self) -> str:
        lines = [f"RetentionPlan for {', '.join(self.functions)}: {len(self.sites)} payloads, "
                 f"{self.total_bytes:,} bytes"]
        for lab, n in self.sites.items():
            lines.append(f"  {lab:<24} {n:>12,} B   {', '.join(self.reasons.get(lab, ()))}")
        return "\n".join(lines)

    __repr__ = __str__


def _sites_for(trace: Any, function: str, kwargs: dict[str, Any]) -> list[str]:
    if function == "residual_decomposition":
        from torchlens_mechinterp.residual import residual_sites

        return residual_sites(trace)
    if function == "direct_logit_contributions":
        from torchlens_mechinterp.dla import dla_sites

        return dla_sites(trace, grain=kwargs.get("grain", "layer"))
    if function == "attention_head_contributions":
        from torchlens_mechinterp.heads import head_contribution_sites

        return head_contribution_sites(trace, kwargs.get("attention"))
    if function == "mlp_neuron_contributions":
        from torchlens_mechinterp.neurons import neuron_sites

        return neuron_sites(trace, kwargs.get("mlp"))
    if function in ("head_weight_views", "qk_circuit", "ov_circuit"):
        return []  # parameters only
    if function == "head_scores":
        from torchlens_mechinterp.scores import head_scores_sites

        return head_scores_sites(trace)
    if function == "component_graph":
        from torchlens_mechinterp.graph import graph_sites

        return graph_sites(trace)
    raise MechInterpError("mi_retention_function_unknown", f"retention_plan does not know {function!r}",
                          remedy="name one of: residual_decomposition, direct_logit_contributions, "
                          "attention_head_contributions, mlp_neuron_contributions, head_weight_views, qk_circuit, "
                          "ov_circuit, head_scores, component_graph", function=function)


def retention_plan(trace: Any, *functions: str, **kwargs: Any) -> RetentionPlan:
    """The payloads `functions` (default: residual_decomposition and direct_logit_contributions)
    read on a trace of this model and input shape, priced in bytes; keyword arguments are the
    functions' own (``grain="head"``, ``attention=...``, ``mlp=...``)."""
    functions = functions or ("residual_decomposition", "direct_logit_contributions")
    for f in functions:  # validate every name before any work
        if not isinstance(f, str) or f not in _KNOWN:
            raise MechInterpError("mi_retention_function_unknown", f"retention_plan does not know {f!r}",
                                  remedy=f"name one of: {', '.join(sorted(_KNOWN))}", function=str(f))
    plan = RetentionPlan(functions=())
    for f in functions:
        labels = _sites_for(trace, f, kwargs)
        part = RetentionPlan({lab: _nbytes(trace._ops[lab]) for lab in labels}, (f,),
                             {lab: (f,) for lab in labels})
        plan = plan | part
    return plan


_KNOWN = frozenset({"residual_decomposition", "direct_logit_contributions", "attention_head_contributions",
                    "mlp_neuron_contributions", "head_weight_views", "qk_circuit", "ov_circuit", "head_scores",
                    "component_graph"})

__all__ = ["require_payloads", "retention_plan", "RetentionPlan"]
