"""torchlens_mechinterp: the mech-interp kit (experimental; names may change in any release).

Reach it as `torchlens.mechinterp.<name>` or bound to a trace as `trace.using("mechinterp")`.
Public names resolve lazily from the module that defines them, so importing the kit costs
nothing until a name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> defining submodule (part 1: issue 16).
_NAMES: dict[str, str] = {
    # residual stream, DLA, heads, circuits, neurons, retention (helper K1)
    "residual_decomposition": "residual",
    "ResidualDecomposition": "residual",
    "ComponentStack": "stack",
    "direct_logit_contributions": "dla",
    "DirectLogitContributions": "dla",
    "StackRow": "stack",
    "attention_head_contributions": "heads",
    "head_weight_views": "heads",
    "HeadWeightViews": "heads",
    "qk_circuit": "circuits",
    "ov_circuit": "circuits",
    "FactoredMatrix": "circuits",
    "mlp_neuron_contributions": "neurons",
    "retention_plan": "retention",
    "RetentionPlan": "retention",
    # head taxonomy, prompts, aliases, patching (helper K2)
    "head_scores": "scores",
    "FixedPeriodInduction": "scores",
    "HeadScores": "scores",
    "inspect_prompt": "prompts",
    "test_prompt": "prompts",
    "resolve_alias": "aliases",
    "alias_report": "aliases",
    "patch_grid": "patching",
    "patch_head": "patching",
    "patch_query_heads_grid": "patching",
    "PatchGrid": "patching",
    "PatchCost": "patching",
    "PatchedHead": "patching",
    "AliasResolution": "aliases",
    "AliasReport": "aliases",
    "PromptRecord": "prompts",
    "AnswerScore": "prompts",
    # component graph, edge patching and scores, circuit faithfulness (helper K3, issue 17)
    "component_graph": "graph",
    "ComponentGraph": "graph",
    "patch_edges": "edges",
    "edge_scores": "edges",
    "EdgeScoreTable": "edges",
    "circuit_performance_ratio": "faithfulness",
    "circuit_model_difference": "faithfulness",
    # ACDC recipe, causal_audit of EDGE tables, the replayability check (helper A, issue 17)
    "acdc": "acdc",
    "AcdcResult": "acdc",
    "AcdcDecision": "acdc",
    "causal_audit": "audit",
    "EdgeAudit": "audit",
    "EdgeAuditRow": "audit",
    "require_replayable": "audit",
}

#: functions whose first parameter is a trace: what `trace.using("mechinterp")` serves.
TRACE_FUNCTIONS = frozenset({
    "residual_decomposition", "direct_logit_contributions", "attention_head_contributions",
    "head_weight_views", "qk_circuit", "ov_circuit", "mlp_neuron_contributions", "retention_plan",
    "head_scores", "inspect_prompt", "resolve_alias", "alias_report", "component_graph", "patch_edges",
    "acdc", "require_replayable",
})

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'torchlens_mechinterp' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"torchlens_mechinterp.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
