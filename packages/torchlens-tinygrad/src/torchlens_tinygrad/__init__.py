"""TorchLens backend for tinygrad (`tl.backends.tinygrad`, preview).

Importing this package imports no tinygrad: the public names below resolve lazily (through
the SDK's `lazy_loader`), so the plugin entry point (`torchlens_tinygrad.plugin`) stays light.
"""

from __future__ import annotations

from torchlens.backends.sdk import lazy_loader

__version__ = "0.1.0"

__getattr__, __dir__ = lazy_loader(__name__, {
    "TinygradBackend": "torchlens_tinygrad.backend:TinygradBackend",
    "GradOptions": "torchlens_tinygrad.options:GradOptions",
    "zoo": "torchlens_tinygrad.zoo",
})

__all__ = ["TinygradBackend", "GradOptions", "zoo", "__version__"]
