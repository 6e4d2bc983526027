"""`tl.facets`: named views of what a module computed, and the recipes that declare them.

`trace.modules[addr].facets["q"]` reads a facet; `tl.facets.register(...)` adds a recipe;
`tl.facets.adding(...)` / `tl.trace(..., facets=[...])` add recipes for some traces only.
Importing this package loads no recipe: installed plugins' recipes (the `torchlens` and
`torchlens.recipes` entry-point groups) are asked for on the first facet access.
See docs/guides/facets.md and spec/facets.md.
"""

from __future__ import annotations

from torchlens.facets.aliases import enable_transformer_lens_aliases, transformer_lens_aliases_enabled
from torchlens.facets.authoring import (
    call_output_spec,
    child_output_spec,
    config_value,
    current_call,
    op_home_spec,
    parameter_spec,
)
from torchlens.facets.registry import (
    FacetRecipe,
    RegistrySnapshot,
    adding,
    describe,
    functions,
    recipe,
    register,
    reset,
    stamp,
    state_for,
)
from torchlens.facets.spec import FacetSpec, computed_spec, op_spec
from torchlens.facets.view import (
    Facet,
    FacetView,
    HeadView,
    MissingGrad,
    attention_blocks,
    modules_with_facet,
    value_of,
)

__all__ = [
    "register", "recipe", "adding", "reset", "functions", "describe", "stamp", "config_value", "child_output_spec",
    "parameter_spec", "call_output_spec", "op_home_spec", "current_call", "FacetSpec", "FacetRecipe",
    "RegistrySnapshot", "Facet", "FacetView", "HeadView", "MissingGrad", "op_spec", "computed_spec",
    "modules_with_facet", "attention_blocks", "enable_transformer_lens_aliases", "transformer_lens_aliases_enabled",
    "value_of", "state_for",
]


def __getattr__(name: str):
    if name in ("patching", "coverage"):
        import importlib

        # the function `coverage` lives in `_coverage`: a submodule named like the function would
        # replace it on the package as soon as anything imported that submodule
        mod = importlib.import_module("torchlens.facets.patching" if name == "patching" else "torchlens.facets._coverage")
        value = mod if name == "patching" else mod.coverage
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchlens.facets' has no attribute {name!r}")
