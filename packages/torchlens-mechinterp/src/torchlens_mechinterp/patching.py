"""Patch grids: receipted activation patching over the live-hook rerun route.

`patch_grid(model, clean_input, corrupted_input, metric, preset=...)` traces both inputs,
pairs their graphs, discloses the cost (forward runs) before any cell runs, refuses a grid
over `budget=`, then reruns the corrupted input once per cell with the clean value of one
site written in (a live edit at the site's home op), and reads `metric(patched_trace)`.
Every cell's edit counts its own fires: a cell whose edit did not fire exactly once is an
exception (`mi_patch_hook_not_fired`), never a number. The receipts carry the unpatched
baselines `clean_metric` and `corrupted_metric` and, per cell, the site it wrote.

`patch_query_heads_grid` patches one query head's copy of a grouped K/V head at the op that
expands the group (HF `repeat_kv`), found from the captured graph.

`patch_head` patches one head of a fused-SDPA model (default attention, no eager reload):
the head edit lowers exactly to an add at the real post-projection op,
`out += (z_new[h] - z[h]) @ W_O[h]`, with a receipt naming the virtual site, the real site,
the formula version and the facets the edit invalidated on the patched run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchlens.errors import MechInterpError, TorchLensError
from torchlens_mechinterp import _sites

#: preset -> (facet, axes). Head presets write a head slice of the facet; position presets one position.
PRESETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "heads": ("z", ("layer", "head")),
    "heads_q": ("q", ("layer", "head")),
    "heads_k": ("k", ("layer", "head")),
    "heads_v": ("v", ("layer", "head")),
    "heads_pattern": ("pattern", ("layer", "head")),
    "resid_pre": ("resid_pre", ("layer", "pos")),
    "resid_mid": ("resid_mid", ("layer", "pos")),
    "resid_post": ("resid_post", ("layer", "pos")),
    "attn_out": ("out", ("layer",)),
    "mlp_out": ("out", ("layer",)),
}

#: core rerun refusals that mean "the cell's edit did not fire exactly once on the rerun"
_NOT_FIRED = ("rerun_zero_fire", "trace_zero_fire", "rerun_graph_diverged", "rerun_selector_unmatchable_live")

FORMULA_VERSION = "mi_head_delta_v1: proj_out += (z_new[h] - z[h]) @ W_O[h]"


@dataclass(frozen=True)
class PatchCost:
    """What a grid will run, disclosed before it runs: cells, forward runs, an estimate."""

    cells: int
    forward_runs: int
    baseline_runs: int
    seconds_per_run: float
    estimated_seconds: float

    def __str__(self) -> str:
        return (f"{self.cells} cells, {self.forward_runs} forward runs (2 per cell: a structure capture and the "
                f"edited capture; {self.baseline_runs} baselines already run), about {self.estimated_seconds:.1f} s")


@dataclass(frozen=True)
class PatchGrid:
    """Patched-run metric values over `axes`; `receipts` holds the grid's facts (preset,
    engine, baselines clean_metric / corrupted_metric, cost), `cells` each cell's receipt."""

    values: Any
    axes: tuple[str, ...]
    coords: dict
    receipts: dict
    cells: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def __getitem__(self, key: Any) -> Any:
        return self.values[key]

    def normalized(self) -> Any:
        """(value - corrupted_metric) / (clean_metric - corrupted_metric): 1 restores the clean metric."""
        clean, corrupt = self.receipts["clean_metric"], self.receipts["corrupted_metric"]
        if clean == corrupt:
            raise MechInterpError("mi_patch_metric_invalid", "normalized(): the clean and corrupted metrics are equal",
                                  remedy="read .values, or choose a metric that separates the two inputs",
                                  clean_metric=clean, corrupted_metric=corrupt)
        return (self.values - corrupt) / (clean - corrupt)

    def __repr__(self) -> str:
        return f"<PatchGrid {self.receipts.get('preset')} {dict(zip(self.axes, self.shape))}>"


# ---------------------------------------------------------------------------------------- checks
def _check_common(metric: Any, budget: Any, engine: Any) -> None:
    if engine == "replay":
        raise MechInterpError("mi_patch_engine_reserved", "patch engine='replay' is reserved and not built; patch grids "
                              "run on the live-hook rerun route", remedy="drop engine= (or pass engine='rerun')",
                              engine=engine)
    if engine != "rerun":
        raise MechInterpError("mi_patch_setting_invalid", f"engine={engine!r}: patch grids run with engine='rerun'",
                              remedy="pass engine='rerun'", setting="engine")
    if not callable(metric):
        raise MechInterpError("mi_patch_setting_invalid", "metric must be a callable of the patched trace",
                              remedy="metric=lambda t: t.output_ops[0].out[0, -1, 3]", setting="metric")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise MechInterpError("mi_patch_setting_invalid", f"budget={budget!r}: the budget is a positive int (the most "
                              "cells, i.e. patched reruns, the grid may run)", remedy="budget=100", setting="budget")


def _trace(model: Any, inputs: Any, trace_kwargs: dict | None) -> Any:
    import torchlens as tl

    return tl.trace(model, inputs, **dict(trace_kwargs or {}))


def _pair(clean: Any, corrupt: Any) -> None:
    a = [(o.label, o.func_name, tuple(o.shape) if o.shape is not None else None) for o in clean._ops.values()]
    b = [(o.label, o.func_name, tuple(o.shape) if o.shape is not None else None) for o in corrupt._ops.values()]
    if a != b:
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise MechInterpError("mi_patch_inputs_mismatched", f"the clean and corrupted inputs trace to different graphs "
                              f"(first difference at op {first}: {a[first] if first < len(a) else '<end>'} vs "
                              f"{b[first] if first < len(b) else '<end>'})", remedy="pass inputs of the same shape "
                              "that take the same path through the model", position=first)


def _metric(metric: Callable, trace: Any, what: str) -> float:
    v = metric(trace)
    if hasattr(v, "detach"):
        if v.numel() != 1:
            raise MechInterpError("mi_patch_metric_invalid", f"{what}: the metric returned shape {tuple(v.shape)}, not "
                                  "one scalar", remedy="reduce the metric to one number", shape=tuple(v.shape))
        v = v.detach().reshape(()).item()
    try:
        v = float(v)
    except (TypeError, ValueError):
        raise MechInterpError("mi_patch_metric_invalid", f"{what}: the metric returned {type(v).__name__}, not a "
                              "number", remedy="return a float or a one-element tensor") from None
    if not math.isfinite(v):
        raise MechInterpError("mi_patch_metric_invalid", f"{what}: the metric is not finite ({v})",
                              remedy="check the metric on the unpatched inputs", value=v)
    return v


def _cost(trace: Any, cells: int) -> PatchCost:
    per = float(getattr(trace.cost, "forward_duration", 0.0) or 0.0)
    runs = 2 * cells
    return PatchCost(cells, runs, 2, per, per * runs)


def _check_budget(cost: PatchCost, budget: int | None, function: str) -> None:
    if budget is not None and cost.cells > budget:
        raise MechInterpError("mi_patch_budget_exceeded", f"{function}: {cost} exceeds budget={budget} cells; "
                              "nothing was patched", remedy="raise budget=, or narrow heads= / positions=",
                              cells=cost.cells, forward_runs=cost.forward_runs, budget=budget)


# ---------------------------------------------------------------------------------------- cells
def _run_cell(corrupt: Any, model: Any, inputs: Any, label: str, write: Callable, tensors: tuple, metric: Callable,
              coord: tuple) -> tuple[float, Any]:
    """Rerun `inputs` with `write(home_value) -> new home value` live at op `label`; the
    metric of the patched run. The edit counts its fires: anything but one refuses."""
    from torchlens.intervention.edits import Edit
    from torchlens.options import InterventionOptions

    fired: list[str] = []

    def fn(v: Any, ctx: Any) -> Any:
        fired.append(ctx.label)
        return write(v, ctx)

    edit = Edit("mi_patch_cell", (("cell", repr(coord)),), fn, portability="callable", tensors=tensors)
    fork = corrupt.fork(f"patch {coord}")
    try:
        fork.do({label: edit}, model=model, inputs=inputs, intervention=InterventionOptions(on_zero_fire="error"))
    except TorchLensError as exc:
        if exc.code in _NOT_FIRED:
            raise MechInterpError("mi_patch_hook_not_fired", f"cell {coord}: the patch at {label!r} did not fire on the "
                                  f"rerun ({exc.code})", remedy="patch a site the corrupted forward executes once; "
                                  "check the model's control flow", cell=coord, site=label, cause=exc.code) from exc
        raise
    if len(fired) != 1:
        raise MechInterpError("mi_patch_hook_not_fired", f"cell {coord}: the patch at {label!r} fired {len(fired)} "
                              "times on the rerun, not once", remedy="patch a site the corrupted forward executes "
                              "exactly once", cell=coord, site=label, fires=len(fired))
    return _metric(metric, fork, f"cell {coord}"), fork


def _facet_write(spec: Any, clean_value: Any) -> Callable:
    def write(v: Any, ctx: Any) -> Any:
        return spec.scatter_update(v, ctx.ops.asarray(clean_value, v), ctx.ops)

    return write


def _sites_for(corrupt: Any, preset: str) -> list[tuple[Any, str]]:
    """(module call, facet name) per layer of the preset, in execution order."""
    from torchlens.facets.view import call_entries

    facet = PRESETS[preset][0]
    if preset.startswith("heads") or preset == "attn_out":
        calls = _sites.attention_calls(corrupt)
        if not calls:
            raise MechInterpError("mi_no_attention", f"patch_grid preset {preset!r}: no attention module call",
                                  remedy="trace a model whose attention an attention recipe describes",
                                  function="patch_grid")
        if preset == "attn_out":
            return [(c, "out" if call_entries(c).get("out") is not None else "out0") for c in calls]
        return [(c, facet) for c in calls]
    want = "post" if preset == "mlp_out" else facet
    calls = []
    for module in corrupt._modules.values():
        for call in module.calls:
            e = call_entries(call).get(want)
            if e is not None and e.spec is not None:
                calls.append(call)
    order = {label: i for i, label in enumerate(corrupt._ops)}
    calls.sort(key=lambda c: min((order.get(lb, 0) for lb in c.op_labels), default=0))
    if not calls:
        raise MechInterpError("mi_patch_preset_unknown", f"patch_grid preset {preset!r}: no module of this trace has "
                              f"the {want!r} facet", remedy="tl.facets.coverage(trace) lists what each module has",
                              preset=preset)
    return [(c, facet) for c in calls]


def patch_grid(model: Any, clean_input: Any, corrupted_input: Any, metric: Callable, preset: str = "heads", *,
               heads: Any = None, positions: Any = None, budget: int | None = None, engine: str = "rerun",
               trace_kwargs: dict | None = None, dry_run: bool = False) -> Any:
    """A PatchGrid of `metric(patched)` with each `preset` site patched from clean into the
    corrupted run (see PRESETS). `heads=[(layer, head), ...]` / `positions=[...]` narrow the
    grid (unselected cells are NaN and have no receipt); `dry_run=True` returns the PatchCost
    only; `budget=` is the most cells that may run."""
    import numpy as np

    from torchlens.facets.view import FacetView, head_spec, home_value

    if preset not in PRESETS:
        raise MechInterpError("mi_patch_preset_unknown", f"patch_grid: unknown preset {preset!r}",
                              remedy=f"use one of {', '.join(PRESETS)}", preset=preset)
    _check_common(metric, budget, engine)
    clean = _trace(model, clean_input, trace_kwargs)
    corrupt = _trace(model, corrupted_input, trace_kwargs)
    _pair(clean, corrupt)
    sites = _sites_for(corrupt, preset)
    facet, axes = PRESETS[preset]
    _sites.facet_specs(corrupt, [c for c, _ in sites], sites[0][1], function="patch_grid")
    # every cell: (coord, spec of the written region); spec must be writable
    cells: list[tuple[tuple, Any]] = []
    width = 0  # the second axis (heads or positions): the widest layer
    wanted = None if heads is None else {tuple(x) for x in heads if isinstance(x, (tuple, list))}
    for layer, (call, name) in enumerate(sites):
        view = FacetView(call)
        if "head" in axes:
            if name in ("k", "v", "pattern") and "q" in view:
                n = int(view["q"].shape[-2])  # query heads (a grouped k/v head is read through each)
            else:
                n = int(view[name].shape[1] if name == "pattern" else view[name].shape[-2])
            width = max(width, n)
            cells.extend(((layer, h), head_spec(view, name, h)) for h in range(n)
                         if wanted is None or (layer, h) in wanted)
        elif "pos" in axes:
            spec = view[name].spec
            n = int(view[name].shape[1])
            width = max(width, n)
            cells.extend(((layer, p), spec.select(1, p)) for p in range(n)
                         if positions is None or p in set(positions))
        else:
            cells.append(((layer,), view[name].spec))
    shape = [len(sites)] + ([width] if len(axes) > 1 else [])
    if heads is not None:
        bad = [h for h in heads if not (isinstance(h, (tuple, list)) and len(h) == 2 and 0 <= h[0] < shape[0]
                                        and len(shape) > 1 and 0 <= h[1] < shape[1])]
        if bad or "head" not in axes:
            raise MechInterpError("mi_patch_setting_invalid", f"heads={heads!r} does not fit a {preset!r} grid of "
                                  f"shape {tuple(shape)}", remedy="heads=[(layer, head), ...] inside the grid",
                                  setting="heads")
    if positions is not None and ("pos" not in axes or any(not isinstance(p, int) or not 0 <= p < shape[1]
                                                           for p in positions)):
        raise MechInterpError("mi_patch_setting_invalid", f"positions={positions!r} does not fit a {preset!r} grid "
                              f"of shape {tuple(shape)}", remedy="positions=[...] inside the sequence",
                              setting="positions")
    unwritable = [c for c, s in cells if not s.writable]
    if unwritable:
        raise MechInterpError("mi_patch_site_unwritable", f"patch_grid {preset!r}: {len(unwritable)} cell site(s) "
                              f"are read-only ({cells[0][1].capability}), e.g. {unwritable[:3]}",
                              remedy="on grouped-query attention use patch_query_heads_grid; with fused SDPA use "
                              "patch_head or the 'heads' preset", cells=unwritable[:8])
    cost = _cost(corrupt, len(cells))
    if dry_run:
        return cost
    _check_budget(cost, budget, "patch_grid")
    clean_metric = _metric(metric, clean, "clean baseline")
    corrupted_metric = _metric(metric, corrupt, "corrupted baseline")
    values = np.full(tuple(shape), np.nan, dtype=np.float64)
    receipts_cells: dict = {}
    for coord, spec in cells:
        clean_value = spec.read(home_value(clean, spec))
        value, _ = _run_cell(corrupt, model, corrupted_input, spec.home, _facet_write(spec, clean_value),
                             (clean_value,), metric, coord)
        values[coord] = value
        receipts_cells[coord] = {"module": sites[coord[0]][0].label, "facet": sites[coord[0]][1],
                                 "site": spec.home, "region": spec.describe(), "fired": 1, "engine": "rerun"}
    coords = {axes[0]: tuple(c.label for c, _ in sites)}
    if len(axes) > 1:
        coords[axes[1]] = tuple(range(shape[1]))
    receipts = {"preset": preset, "facet": facet, "engine": "rerun", "clean_metric": clean_metric,
                "corrupted_metric": corrupted_metric, "cost": cost, "cells_run": len(cells),
                "convention": "values are metric(corrupted run with the clean site written in)"}
    return PatchGrid(values, axes, coords, receipts, receipts_cells)


# ------------------------------------------------------------------------------ query-head grids
_EXPAND_FUNCS = ("reshape", "view", "flatten", "repeat_interleave")
_PASS_FUNCS = ("transpose", "contiguous", "to", "permute", "view", "reshape", "__getitem__", "clone")


def _expansion_ops(trace: Any, call: Any, n_q: int, n_kv: int) -> list[Any]:
    """Ops of the call that turn a [.., n_kv, ..] tensor into [.., n_q, ..] by repeating it
    (an expand followed by a reshape, or repeat_interleave)."""
    own = [trace._ops[lb] for lb in call.op_labels]
    found = []
    for op in own:
        if op.func_name not in _EXPAND_FUNCS or op.shape is None or len(op.shape) != 4 or op.shape[1] != n_q:
            continue
        if op.func_name == "repeat_interleave":
            found.append(op)
            continue
        parents = [trace._ops[p] for p in op.parents if p in trace._ops]
        if any(p.func_name == "expand" and p.shape is not None and len(p.shape) == 5 and p.shape[1] == n_kv
               and p.shape[1] * p.shape[2] == n_q for p in parents):
            found.append(op)
    return found


def _descendants(trace: Any, op: Any, inside: set[str]) -> set[str]:
    children: dict[str, list[str]] = {}
    for lb in inside:
        for p in trace._ops[lb].parents:
            children.setdefault(p, []).append(lb)
    seen, stack = set(), [op.label]
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return seen


def _expansion_for(trace: Any, call: Any, site: str, function: str) -> tuple[Any, int, int]:
    from torchlens.facets.view import FacetView

    view = FacetView(call)
    n_q = int(view["q"].shape[-2])
    n_kv = int(view[site].shape[-2]) if view._entries.get(site) is not None else n_q
    spec = view._entries.get(site).spec if view._entries.get(site) is not None else None
    if spec is not None and spec.chain and type(spec.chain[-1]).__name__ == "AliasHead":
        n_kv = n_q // spec.chain[-1].group
    if n_q == n_kv:
        raise MechInterpError("mi_kv_heads_not_grouped", f"{function}: {call.label!r} has {n_q} query and {n_kv} "
                              "key/value heads: no grouped K/V to expand", remedy="use patch_grid(preset='heads_"
                              f"{site}') on this model", module=call.label, num_q_heads=n_q, n_kv_heads=n_kv)
    expansions = _expansion_ops(trace, call, n_q, n_kv)
    pattern = view._entries.get("pattern")
    inside = set(call.op_labels)
    softmax = pattern.spec.home if pattern is not None and pattern.spec is not None and \
        pattern.spec.home_kind != "computed" else None
    if softmax is None or not expansions:
        raise MechInterpError("mi_kv_expansion_unavailable", f"{function}: {call.label!r} expands its {n_kv} key/value "
                              f"heads to {n_q} query heads inside a fused kernel (no expansion op in the graph)",
                              remedy='load the model with attn_implementation="eager" (or the "torchlens" attention '
                              "backend) so the group is expanded by an op", module=call.label)
    # the key copy reaches the softmax; the value copy reaches the output without passing it
    chosen = []
    for op in expansions:
        down = _descendants(trace, op, inside)
        is_k = softmax in down
        if (site == "k") == is_k:
            chosen.append(op)
    if len(chosen) != 1:
        raise MechInterpError("mi_kv_expansion_ambiguous" if chosen else "mi_kv_expansion_unavailable",
                              f"{function}: {call.label!r} has {len(chosen)} candidate {site}-expansion ops "
                              f"({', '.join(o.label for o in chosen)})", remedy="patch the whole group with "
                              f"patch_grid(preset='heads_{site}'), or load a model with one repeat_kv per side",
                              module=call.label, expansion_ops=[o.label for o in chosen])
    return chosen[0], n_q, n_kv


def patch_query_heads_grid(model: Any, clean_input: Any, corrupted_input: Any, metric: Callable, site: str = "v",
                           heads: Any = None, budget: int | None = None, trace_kwargs: dict | None = None) -> PatchGrid:
    """[layer, query head]: the metric with one query head's copy of its grouped `site` ("k"
    or "v") patched from clean at the op that expands the group (see the module docstring)."""
    import numpy as np

    if site not in ("k", "v"):
        raise MechInterpError("mi_patch_setting_invalid", f"site={site!r}: patch_query_heads_grid patches 'k' or 'v'",
                              remedy="site='v' (or 'k')", setting="site")
    _check_common(metric, budget, "rerun")
    clean = _trace(model, clean_input, trace_kwargs)
    corrupt = _trace(model, corrupted_input, trace_kwargs)
    _pair(clean, corrupt)
    calls = _sites.attention_calls(corrupt)
    if not calls:
        raise MechInterpError("mi_no_attention", "patch_query_heads_grid: no attention module call",
                              remedy="trace a model whose attention an attention recipe describes",
                              function="patch_query_heads_grid")
    found = [_expansion_for(corrupt, c, site, "patch_query_heads_grid") for c in calls]
    n_q = max(f[1] for f in found)
    wanted = None if heads is None else {tuple(h) for h in heads}
    if wanted is not None and any(len(h) != 2 or not 0 <= h[0] < len(calls) or not 0 <= h[1] < n_q for h in wanted):
        raise MechInterpError("mi_patch_setting_invalid", f"heads={heads!r} outside [{len(calls)} layers, {n_q} query "
                              "heads]", remedy="heads=[(layer, query head), ...]", setting="heads")
    cells = [(layer, h) for layer, (op, nq, _) in enumerate(found) for h in range(nq)
             if wanted is None or (layer, h) in wanted]
    cost = _cost(corrupt, len(cells))
    _check_budget(cost, budget, "patch_query_heads_grid")
    missing = sorted({op.label for op, _, _ in found if not clean._ops[op.label].saved})
    if missing:
        _sites.require_payloads(clean, missing, function="patch_query_heads_grid")
    clean_metric = _metric(metric, clean, "clean baseline")
    corrupted_metric = _metric(metric, corrupt, "corrupted baseline")
    values = np.full((len(calls), n_q), np.nan, dtype=np.float64)
    receipts_cells = {}
    for layer, h in cells:
        op = found[layer][0]
        clean_copy = clean._ops[op.label].outs[0][:, h]

        def write(v: Any, ctx: Any, h: int = h, clean_copy: Any = clean_copy) -> Any:
            out = v.clone()
            out[:, h] = clean_copy.to(dtype=v.dtype, device=v.device)
            return out

        values[layer, h], _ = _run_cell(corrupt, model, corrupted_input, op.label, write, (clean_copy,), metric,
                                        (layer, h))
        receipts_cells[(layer, h)] = {"module": calls[layer].label, "site": op.label, "query_head": h,
                                      "kv_head": h // (found[layer][1] // found[layer][2]), "fired": 1}
    receipts = {"preset": f"query_heads_{site}", "site": site, "engine": "rerun",
                "effect_site": f"the {site} expansion op (repeat_kv) output, one query head's slice per cell",
                "num_q_heads": n_q, "n_kv_heads": max(f[2] for f in found),
                "expansion_ops": tuple(f[0].label for f in found), "clean_metric": clean_metric,
                "corrupted_metric": corrupted_metric, "cost": cost, "cells_run": len(cells),
                "convention": "values are metric(corrupted run with one query head's clean K/V copy written in)"}
    return PatchGrid(values, ("layer", "head"), {"layer": tuple(c.label for c in calls), "head": tuple(range(n_q))},
                     receipts, receipts_cells)


# ------------------------------------------------------------------------------------ patch_head
class PatchedHead:
    """The patched rerun of `patch_head`: `.trace` (the rerun), `.receipt`, `.output`, and
    `.facets(address)`, which refuses the facets the edit invalidated (`mi_facet_invalidated`)."""

    def __init__(self, trace: Any, receipt: dict) -> None:
        self.trace = trace
        self.receipt = receipt

    @property
    def output(self) -> Any:
        return self.trace.output_ops[0].out

    def facets(self, address: str) -> _GuardedFacets:
        return _GuardedFacets(self.trace.modules[address].facets, address, self.receipt)

    def __repr__(self) -> str:
        return f"<PatchedHead {self.receipt['virtual_site']} -> {self.receipt['real_site']}>"


class _GuardedFacets:
    def __init__(self, view: Any, address: str, receipt: dict) -> None:
        self._view, self._address, self._receipt = view, address, receipt

    def __getitem__(self, name: str) -> Any:
        if self._address == self._receipt["module"] and name in self._receipt["invalidated_facets"]:
            raise MechInterpError("mi_facet_invalidated", f"facet {name!r} of {self._address!r} does not hold the "
                                  f"patched run's value: the head edit was lowered to {self._receipt['real_site']!r}",
                                  remedy="read the real site or downstream facets; for the virtual value recompute "
                                  "it from the patch", facet=name, module=self._address,
                                  real_site=self._receipt["real_site"])
        return self._view[name]

    def keys(self) -> list[str]:
        bad = set(self._receipt["invalidated_facets"]) if self._address == self._receipt["module"] else set()
        return [k for k in self._view.keys() if k not in bad]


def _projection(trace: Any, label: str) -> tuple[Any, str]:
    """(W_O as [in, out], weight address) of the projection whose output op is `label`."""
    op = trace._ops[label]
    pop = op if op.params else None
    if pop is None:
        for module in trace._modules.values():
            for call in module.calls:
                if label in call.output_labels:
                    pops = [trace._ops[lb] for lb in call.op_labels if trace._ops[lb].params]
                    if len(pops) == 1:
                        pop = pops[0]
    if pop is None:
        raise MechInterpError("mi_patch_head_unsupported", f"patch_head: no single parameterised op behind {label!r}",
                              remedy="patch the head on an eager-attention model with patch_grid", site=label)
    weights = [a for a in pop.params if trace._params[a].value is not None and trace._params[a].value.ndim == 2]
    if len(weights) != 1:
        raise MechInterpError("mi_patch_head_unsupported", f"patch_head: {pop.label!r} reads {len(weights)} matrices",
                              remedy="patch the head on an eager-attention model with patch_grid", site=label)
    w = trace._params[weights[0]].value
    return (w.t() if pop.func_name == "linear" else w), weights[0]


def patch_head(model: Any, inputs: Any, *, module: str, head: int, source: Any = None, z: Any = None,
               pattern: Any = None, trace_kwargs: dict | None = None) -> PatchedHead:
    """Rerun `inputs` with head `head` of attention `module` given a new z: the source run's
    (`source=` inputs), a given `z=` [batch, pos, d_head], or `pattern=` [batch, q, k] (z =
    pattern @ v of that head). Lowered to an add at the real post-projection op."""
    import torch

    from torchlens.intervention.edits import Edit
    from torchlens.options import InterventionOptions

    given = [n for n, v in (("source", source), ("z", z), ("pattern", pattern)) if v is not None]
    if len(given) != 1:
        raise MechInterpError("mi_patch_setting_invalid", f"patch_head takes exactly one of source=, z=, pattern= "
                              f"(got {given or 'none'})", remedy="patch_head(model, x, module=..., head=h, source=x2)",
                              setting="source/z/pattern")
    target = _trace(model, inputs, trace_kwargs)
    calls = [c for c in _sites.attention_calls(target) if c.address == module or c.label == module]
    if len(calls) != 1:
        raise MechInterpError("mi_no_attention", f"patch_head: {module!r} names {len(calls)} attention calls",
                              remedy="name one attention module (trace.attention_blocks())", function="patch_head",
                              module=module)
    call = calls[0]
    z_spec = _sites.facet_specs(target, [call], "z", function="patch_head")[0]
    r_spec = _sites.facet_specs(target, [call], "result", function="patch_head")[0]
    z_old = _sites.value(target, z_spec)  # [b, pos, H, d]
    n_heads = int(z_old.shape[-2])
    if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < n_heads:
        raise MechInterpError("mi_patch_setting_invalid", f"head={head!r} outside 0..{n_heads - 1}",
                              remedy=f"a head index in 0..{n_heads - 1}", setting="head")
    real_site = r_spec.inputs[-1]
    w_io, w_addr = _projection(target, real_site)
    d_head = int(z_old.shape[-1])
    w_h = w_io[head * d_head:(head + 1) * d_head].detach().to(z_old.dtype)  # [d_head, d_model]
    result = _sites.value(target, r_spec)
    if not torch.allclose(result[..., head, :], z_old[..., head, :] @ w_h, rtol=1e-4, atol=1e-5):
        raise MechInterpError("mi_patch_head_unsupported", f"patch_head: {w_addr} does not reproduce head {head}'s "
                              "validated result facet", remedy="patch the head on an eager-attention model",
                              site=real_site)
    invalidated = ["z", "result"]
    if source is not None:
        src = _trace(model, source, trace_kwargs)
        src_call = [c for c in _sites.attention_calls(src) if c.label == call.label]
        if len(src_call) != 1:
            raise MechInterpError("mi_patch_inputs_mismatched", "patch_head: the source run has no matching attention "
                                  "call", remedy="pass a source input of the same shape", module=call.label)
        z_new = _sites.value(src, _sites.facet_specs(src, src_call, "z", function="patch_head")[0])[..., head, :]
        virtual = f"{call.address}.z[head {head}] <- source run"
    elif z is not None:
        z_new = torch.as_tensor(z)
        virtual = f"{call.address}.z[head {head}] <- given z"
    else:
        v_spec = _sites.facet_specs(target, [call], "v", function="patch_head")[0]
        v = _sites.value(target, v_spec)  # [b, pos, Hkv, d]
        kv = v[..., head // (n_heads // int(v.shape[-2])), :]
        pat = torch.as_tensor(pattern).to(v.dtype)
        if pat.shape != (v.shape[0], v.shape[1], v.shape[1]):
            raise MechInterpError("mi_patch_setting_invalid", f"pattern shape {tuple(pat.shape)} is not [batch, q, k] "
                                  f"= {(v.shape[0], v.shape[1], v.shape[1])}", remedy="pass one head's pattern",
                                  setting="pattern")
        z_new = pat @ kv
        virtual = f"{call.address}.pattern[head {head}] <- given pattern"
        invalidated = ["pattern", "z", "result"]
    if tuple(z_new.shape) != tuple(z_old[..., head, :].shape):
        raise MechInterpError("mi_patch_setting_invalid", f"z shape {tuple(z_new.shape)} is not "
                              f"{tuple(z_old[..., head, :].shape)}", remedy="pass [batch, pos, d_head]", setting="z")
    with torch.no_grad():  # the delta is a value written in, not part of any autograd graph
        delta = ((z_new.to(z_old.dtype) - z_old[..., head, :]) @ w_h).detach()  # [b, pos, d_model]
    fired: list[str] = []

    def fn(v: Any, ctx: Any) -> Any:
        fired.append(ctx.label)
        return v + delta.to(dtype=v.dtype, device=v.device)

    fork = target.fork(f"patch_head {call.address}[{head}]")
    edit = Edit("mi_patch_head", (("head", head),), fn, portability="callable", tensors=(delta,))
    try:
        fork.do({real_site: edit}, model=model, inputs=inputs, intervention=InterventionOptions(on_zero_fire="error"))
    except TorchLensError as exc:
        raise MechInterpError("mi_patch_hook_not_fired", f"patch_head: the add at {real_site!r} did not fire "
                              f"({exc.code})", remedy="patch a site the forward executes once", site=real_site,
                              cause=exc.code) from exc
    if len(fired) != 1:
        raise MechInterpError("mi_patch_hook_not_fired", f"patch_head: the add at {real_site!r} fired {len(fired)} "
                              "times", remedy="patch a site the forward executes once", site=real_site,
                              fires=len(fired))
    receipt = {"module": call.address, "head": head, "virtual_site": virtual, "real_site": real_site,
               "weight": w_addr, "formula_version": FORMULA_VERSION, "invalidated_facets": tuple(invalidated),
               "fired": 1, "engine": "rerun"}
    fork.annotations["mi_invalidated_facets"] = {call.address: tuple(invalidated)}
    return PatchedHead(fork, receipt)


__all__ = ["patch_grid", "patch_query_heads_grid", "patch_head", "PatchGrid", "PatchCost", "PatchedHead", "PRESETS"]
