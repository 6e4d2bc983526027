"""Site selectors: pick ops by callable, module, label or predicate, composed with & | - ~."""

from torchlens.select.selection import Selection
from torchlens.select.selectors import (
    Selector,
    all_sites,
    as_selector,
    func,
    grad,
    in_module,
    label,
    label_contains,
    label_matches,
    model_input,
    model_output,
    module,
    where,
)

__all__ = ["Selection", "Selector", "all_sites", "as_selector", "func", "grad", "in_module", "label", "label_contains",
           "label_matches", "model_input", "model_output", "module", "where"]
