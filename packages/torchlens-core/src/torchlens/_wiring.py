"""Binds the records' ports (`torchlens.records.ports`) to the layers above them.

`import torchlens` runs this module, so every port is bound before any record exists. Each
binding is lazy (the implementation's module is imported on the port's first call), so
importing torchlens imports no more than before. This table is the one place that knows
which upper-layer function serves which record method; records name only the port.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from torchlens.records.ports import bind

#: port name -> "module:attribute" of its implementation
PORTS: dict[str, str] = {
    "Selection": "torchlens.select.selection:Selection",
    "Selector": "torchlens.select.selectors:Selector",
    "attention_blocks": "torchlens.facets.view:attention_blocks",
    "as_selector": "torchlens.select.selectors:as_selector",
    "bind_appliance": "torchlens.appliances:bind",
    "buffer_html": "torchlens.viz.tables:buffer_html",
    "call_facets": "torchlens.facets.view:call_facets",
    "call_html": "torchlens.viz.tables:call_html",
    "param_snapshot_of": "torchlens.bundle.guard:snapshot_of",
    "clear_edits": "torchlens.intervention.verbs:clear_edits",
    "collapse_score": "torchlens.viz.collapse:collapse_score",
    "collection_dataframe": "torchlens.viz.tables:collection_dataframe",
    "collection_html": "torchlens.viz.tables:collection_html",
    "do": "torchlens.intervention.verbs:do",
    "draw_trace": "torchlens.viz.draw:draw_trace",
    "fork": "torchlens.intervention.verbs:fork",
    "intervention_state": "torchlens.intervention.verbs:_state",
    "is_pristine": "torchlens.intervention.verbs:is_pristine",
    "layer_html": "torchlens.viz.tables:layer_html",
    "module_facets": "torchlens.facets.view:module_facets",
    "module_collapse_order": "torchlens.viz.collapse:module_collapse_order",
    "module_html": "torchlens.viz.tables:module_html",
    "modules_with_facet": "torchlens.facets.view:modules_with_facet",
    "normalize_type": "torchlens.build.builder:normalize_type",
    "note_direct_write": "torchlens.intervention.verbs:note_direct_write",
    "op_html": "torchlens.viz.tables:op_html",
    "ops_dataframe": "torchlens.viz.tables:ops_dataframe",
    "param_html": "torchlens.viz.tables:param_html",
    "refuse_opaque": "torchlens.io.opaque:refuse_opaque",
    "run_trace": "torchlens.intervention.verbs:run",
    "save_intervention": "torchlens.io.intervention:save_intervention",
    "save_trace": "torchlens.io.bundle:save",
    "stamp_params": "torchlens.replay.params:stamp_params",
    "trace_html": "torchlens.viz.tables:trace_html",
    "trace_recipe": "torchlens.intervention.verbs:recipe",
    "trace_summary": "torchlens.viz.summary:trace_summary",
    "unapplied_gradient_rules": "torchlens.intervention.verbs:unapplied_gradient_rules",
}


def _loader(path: str) -> Callable[[], Any]:
    module, attr = path.split(":")
    return lambda: getattr(importlib.import_module(module), attr)


def wire() -> None:
    for name, path in PORTS.items():
        bind(name, _loader(path))


wire()
