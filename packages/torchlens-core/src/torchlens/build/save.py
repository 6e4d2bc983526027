"""`save=`: which payloads a capture keeps.

`"all"` keeps every payload, `"none"` none (structure only). A selector or a list (labels,
pass-qualified labels, module addresses, integer op indexes, label substrings, `"all"`,
`"none"`) is resolved against the final labels after the build, and payloads outside it are
released. Backends may decide cheaply at capture time when `save_plan(save).kind` is
`"all"` or `"none"`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchlens.errors import InvalidArgumentError

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.trace import Trace


@dataclass(frozen=True)
class SavePlan:
    kind: str  # "all" | "none" | "select"
    spec: Any = None


def save_plan(save: Any) -> SavePlan:
    """Normalise and check a `save=` value before anything runs."""
    from torchlens.select.selectors import Selector

    if save is None or save == "none" or save is False:
        return SavePlan("none")
    if save == "all" or save is True:
        return SavePlan("all")
    if isinstance(save, Selector):
        return SavePlan("select", save)
    if isinstance(save, str) and save == "stats":  # reduce and discard: tl.trace handles it before any backend
        raise InvalidArgumentError("save_spec_invalid", "save='stats' (reduce and discard) is taken by tl.trace only",
                                   remedy="tl.trace(model, x, save='stats'), then tl.stats.site_stats(trace)",
                                   save="stats")
    if isinstance(save, str):
        return SavePlan("select", [save])
    if isinstance(save, (list, tuple)):
        for item in save:
            if not isinstance(item, (str, int, Selector)) or isinstance(item, bool):
                raise InvalidArgumentError("save_spec_invalid", f"save= list item {item!r} is not a label, address, index or selector",
                                           remedy="save=['linear_1_1', 'fc', 3] or save=tl.func('relu')", item=repr(item))
        if "all" in save:
            return SavePlan("all")
        items = [i for i in save if i != "none"]
        return SavePlan("select", list(items)) if items else SavePlan("none")
    raise InvalidArgumentError("save_spec_invalid", f"save={save!r} is not 'all', 'none', a selector or a list",
                               remedy="save='all', save='none', save=tl.module('fc') or save=['relu_1_2']", save=repr(save))


def resolve_save(trace: "Trace", plan: SavePlan) -> set[str]:
    """The op labels whose payloads `plan` keeps."""
    from torchlens.select.selectors import Selector

    if plan.kind == "all":
        return set(trace._ops)
    if plan.kind == "none":
        return set()
    if isinstance(plan.spec, Selector):
        return plan.spec.match_set(trace)
    keep: set[str] = set()
    ops = list(trace._ops.values())
    for item in plan.spec:
        if isinstance(item, Selector):
            keep |= item.match_set(trace)
        elif isinstance(item, int):
            if not -len(ops) <= item < len(ops):
                raise InvalidArgumentError("save_spec_invalid", f"save= index {item} is out of range for {len(ops)} ops",
                                           remedy=f"use an index in range({len(ops)})", item=item)
            keep.add(ops[item].label)
        else:
            keep |= _resolve_text(trace, item)
    return keep


def _resolve_text(trace: "Trace", item: str) -> set[str]:
    from torchlens.records.collections import split_pass_token

    if item in trace._ops:
        return {item}
    if item in trace._layers:
        return {o.label for o in trace._layers[item].ops}
    base, token = split_pass_token(item)
    if base in trace._layers and token is not None:
        layer = trace._layers[base]
        if token == "all":
            return {o.label for o in layer.ops}
        return {trace._pass_op(layer, token, item).label}
    if item in trace._modules or (base in trace._modules and token is not None and token.isdigit()):
        from torchlens.select.selectors import ModuleSelector

        return ModuleSelector(item).match_set(trace)
    found = {label for label in trace._ops if item in label}
    if not found:
        raise InvalidArgumentError("save_spec_invalid", f"save= item {item!r} matches no op label, layer or module",
                                   remedy="check trace.labels and trace.modules.labels", item=item)
    return found


def apply_save(trace: "Trace", plan: SavePlan, *, keep_output_ops: bool = False) -> None:
    """Release every payload outside the plan (after the build)."""
    if plan.kind == "all":
        return
    keep = resolve_save(trace, plan)
    for op in trace._ops.values():
        if op.label not in keep and not (keep_output_ops and op.kind == "output"):
            op.saved = False
            op._outputs = tuple(None for _ in op._outputs)


def check_saved_matches(trace: "Trace", save: Any, backend: str = "") -> None:
    """Core's check, after any backend's capture, that no payload outside `save=` was kept.

    A backend that ignores `save_plan`/`apply_save` would otherwise silently save everything
    (7 of 7 ops kept for `save=tl.func("relu")`). Output ops are exempt (a backend may keep the
    model's return value). Ops the plan names but the backend could not keep are not refused:
    `op.saved` says so per op, and reading one raises `payload_unavailable`.
    """
    plan = save_plan(save)
    if plan.kind == "all":
        return
    keep = resolve_save(trace, plan)
    extra = [op.label for op in trace._ops.values() if op.saved and op.kind != "output" and op.label not in keep]
    if extra:
        from torchlens.errors import PluginError

        name = backend or getattr(getattr(trace, "provenance", None), "backend", "") or "?"
        raise PluginError("backend_save_plan_ignored",
                          f"the {name} backend kept {len(extra)} payload(s) that save={save!r} did not ask for "
                          f"({', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''})",
                          remedy="the backend must apply the plan: call torchlens.backends.sdk.apply_save(trace, "
                                 "save_plan(save)) after building (see docs/guides/plugins.md); until then use save='all'",
                          backend=name, extra_labels=extra[:20], num_extra=len(extra))
