"""Views of a Trace: drawings (Graphviz DOT), summaries, tables and notebook reprs.

Nothing here imports an ML framework; graphviz (the `dot` program), pandas and tqdm are
optional and looked up only when a view needs them.
"""

from torchlens.viz.collapse import COLLAPSE_OPTIMIZER_MAX_OPS, collapse_score, collapse_scores, module_collapse_order
from torchlens.viz.contact_sheet import ContactSheet, contact_sheet
from torchlens.viz.cost import LAYOUT_WARN_SECONDS, estimate_dot_seconds, layout_units
from torchlens.viz.draw import Drawing, draw_trace
from torchlens.viz.progress import progress, set_progress
from torchlens.viz.summary import trace_summary
from torchlens.viz.tables import collection_dataframe, op_html, layer_html, module_html, ops_dataframe, trace_html
from torchlens.viz.themes import THEMES

__all__ = [
    "Drawing", "draw_trace", "contact_sheet", "ContactSheet", "trace_summary", "ops_dataframe", "collection_dataframe", "trace_html",
    "op_html", "layer_html", "module_html", "progress", "set_progress", "THEMES",
    "COLLAPSE_OPTIMIZER_MAX_OPS", "LAYOUT_WARN_SECONDS", "layout_units", "estimate_dot_seconds", "collapse_score", "collapse_scores", "module_collapse_order",
]
