"""TorchLens backend for MLX (`tl.backends.mlx`, preview).

Importing this package imports no framework: the public names below resolve lazily (through the
SDK's `lazy_loader`); the backend object (`torchlens_mlx.backend`) imports `mlx` when a capture
needs it.
"""

from __future__ import annotations

from torchlens.backends.sdk import lazy_loader

__version__ = "0.1.0"

__getattr__, __dir__ = lazy_loader(__name__, {
    "MLXBackend": "torchlens_mlx.backend:MLXBackend",
    "GradOptions": "torchlens.backends.sdk:GradOptions",
    "zoo": "torchlens_mlx.zoo",
})

__all__ = ["MLXBackend", "GradOptions", "zoo", "__version__"]
