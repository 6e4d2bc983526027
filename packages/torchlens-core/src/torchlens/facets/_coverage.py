"""`tl.facets.coverage(trace)` (experimental): per-module recipe coverage of a completed
trace: which recipes matched, which declared facets are readable now, the typed absence
reasons, the structural-only module classes (recipe candidates), and a disclosed row for
every module whose facet view refuses (a module called more than once is reported per call).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CoverageRow:
    address: str
    call: str
    class_name: str
    recipes: tuple[str, ...]
    statuses: dict[str, str]
    reasons: dict[str, str]
    note: str = ""


@dataclass
class Coverage:
    rows: list[CoverageRow]
    structural_only_classes: dict[str, int] = field(default_factory=dict)

    @property
    def matched(self) -> list[CoverageRow]:
        return [r for r in self.rows if r.recipes]

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [r.__dict__ for r in self.rows], "structural_only_classes": dict(self.structural_only_classes)}


def coverage(trace: Any) -> Coverage:
    from torchlens.facets.registry import snapshot_for
    from torchlens.facets.view import call_entries

    snap = snapshot_for(trace)
    rows: list[CoverageRow] = []
    structural_only: Counter = Counter()
    for module in trace._modules.values():
        if not module.calls:
            continue
        recipes = tuple(r.recipe_id for r in snap.matching(module))
        note = f"module.facets refuses (facet_module_multi_call): {len(module.calls)} calls" \
            if len(module.calls) > 1 else ""
        for call in module.calls:
            try:
                entries = call_entries(call)
            except Exception as exc:  # noqa: BLE001 - a recipe fault is disclosed, not hidden
                rows.append(CoverageRow(module.address, call.label, module.class_name, recipes, {}, {},
                                        f"recipe failed: {type(exc).__name__}: {exc}"))
                continue
            used = tuple(sorted({e.recipe_id for e in entries.values() if e.kind == "recipe"}))
            rows.append(CoverageRow(module.address, call.label, module.class_name, used,
                                    {n: e.status for n, e in entries.items()},
                                    {n: e.reason for n, e in entries.items() if e.reason}, note))
            if not used:
                structural_only[module.class_name] += 1
    return Coverage(rows, dict(structural_only))


__all__ = ["coverage", "Coverage", "CoverageRow"]
