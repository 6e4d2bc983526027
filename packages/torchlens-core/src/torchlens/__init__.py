"""TorchLens: record every operation a model's forward executes, as one graph of records.

`import torchlens as tl`, then `tl.trace(model, x)`. This package is the framework-neutral
core: it never imports an ML framework. Backends (`torchlens-torch`, ...) plug in through
the `torchlens` entry-point group.
"""

from __future__ import annotations

from typing import Any

from torchlens import errors, options
from torchlens import _wiring  # noqa: F401  (binds the records' ports to the layers above)

from torchlens.capture import trace
from torchlens.check import validate
from torchlens.intervention import (
    Edit,
    Recipe,
    add,
    add_noise,
    clamp,
    clip_norm,
    mean_ablate,
    patch_from,
    project_onto,
    project_out,
    replace_with,
    scale,
    splice_module,
    steer,
    positions,
    subspace,
    swap_with,
    sweep,
    units,
    when,
    zero_ablate,
)
from torchlens.options import CaptureOptions, InterventionOptions
from torchlens.plugins.hookspecs import hookimpl
from torchlens.records import Buffer, Layer, Module, ModuleCall, Op, Param, Trace
from torchlens.select.facet import facet, head
from torchlens.select import (
    Selection,
    Selector,
    all_sites,
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

__version__ = "0.1.0"

_LAZY = {
    "backends": "torchlens.backends",
    "report": "torchlens.report",
    "viz": "torchlens.viz",
    "plugins": "torchlens.plugins",
    "intervention": "torchlens.intervention",
    "build": "torchlens.build",
    "appliances": "torchlens.appliances",
    "mechinterp": "torchlens.mechinterp",
    "io": "torchlens.io",
    "export": "torchlens.export",
    "types": "torchlens.types",
    "validation": "torchlens.validation",
    "facets": "torchlens.facets",
    "lens": "torchlens.lens",
    "bundle": "torchlens.bundle",
    "fingerprint": "torchlens.fingerprint",
    "stats": "torchlens.stats",  # issue 23
    "dataset_extraction": "torchlens.dataset_extraction",  # issue 23
    "recording": "torchlens.recording",  # issue 22
    "distributed": "torchlens.distributed",  # issue 24
}
#: public classes that load their module on first use: name -> (module, attribute)
_LAZY_ATTRS = {"Bundle": ("torchlens.bundle", "Bundle"), "record": ("torchlens.recording", "record")}  # record: issue 22
_LAZY_ATTRS.update({  # issue 23: extraction helpers
    n: ("torchlens.dataset_extraction", n) for n in ("pluck", "extract", "extract_dataset", "LoadedExtraction", "ExtractionReader")})


_LAZY_ATTRS.update({n: ("torchlens.distributed", n) for n in ("merge_ranks", "merge_report")})  # issue 24


def load(path: Any, lazy: bool = False) -> Any:
    """Load a `.tlspec` directory written by `Trace.save` (checked in full before it returns),
    or a saved intervention spec / recipe (`Trace.save_intervention`, `Recipe.save`).
    Payloads are read into memory and verified before it returns (files are never mapped);
    `lazy=True` is accepted for compatibility and loads the same way.
    Every refusal is a typed `TorchLensError`; see `tl.io.artifact`."""
    from torchlens.dataset_extraction.shards import is_extraction_dir

    if is_extraction_dir(path):  # issue 23: an extract_dataset directory -> LoadedExtraction
        from torchlens.dataset_extraction.reader import load_extraction

        return load_extraction(path)
    from torchlens.io.artifact import load_artifact

    return load_artifact(path, lazy=lazy)


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRS:
        import importlib

        mod_name, attr = _LAZY_ATTRS[name]
        value = getattr(importlib.import_module(mod_name), attr)
        globals()[name] = value
        return value
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'torchlens' has no attribute {name!r}")
    import importlib

    mod = importlib.import_module(target)
    globals()[name] = mod
    return mod


__all__ = [
    "trace", "validate", "CaptureOptions", "InterventionOptions", "Recipe", "when", "zero_ablate", "scale", "add",
    "clamp", "add_noise", "mean_ablate", "replace_with", "steer", "project_onto", "project_out", "clip_norm",
    "patch_from", "swap_with", "subspace", "units", "sweep", "positions", "Edit", "splice_module", "errors", "options", "hookimpl",
    "Trace", "Op", "Layer", "Module", "ModuleCall", "Param", "Buffer",
    "Selection", "Selector", "func", "grad", "module", "in_module", "label", "label_contains", "label_matches", "where",
    "model_input", "model_output", "all_sites", "__version__", "facet", "head", "Bundle", "record",
]
