"""TorchLens backend for PyTorch (`tl.backends.torch`).

Importing this package imports no torch: the public names below resolve lazily, so the
plugin entry point (`torchlens_torch.plugin`) stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "TorchBackend": ("torchlens_torch.backend", "TorchBackend"),
    "backend": ("torchlens_torch.backend", "get_backend"),
    "zoo": ("torchlens_torch.zoo", None),
    "COMPOSITES": ("torchlens_torch.composites", "COMPOSITE_NAMES"),
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'torchlens_torch' has no attribute {name!r}")
    import importlib

    mod = importlib.import_module(target[0])
    value = mod if target[1] is None else getattr(mod, target[1])
    globals()[name] = value
    return value


__all__ = ["TorchBackend", "backend", "zoo", "COMPOSITES", "__version__"]
