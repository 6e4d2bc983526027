"""TorchLens backend for JAX (`tl.backends.jax`, preview).

Importing this package imports no jax: the public names below resolve lazily, so the
plugin entry point (`torchlens_jax.plugin`) stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "JAXBackend": ("torchlens_jax.backend", "JAXBackend"),
    "backend": ("torchlens_jax.backend", "get_backend"),
    "GradOptions": ("torchlens_jax.options", "GradOptions"),
    "zoo": ("torchlens_jax.zoo", None),
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'torchlens_jax' has no attribute {name!r}")
    import importlib

    mod = importlib.import_module(target[0])
    value = mod if target[1] is None else getattr(mod, target[1])
    globals()[name] = value
    return value


__all__ = ["JAXBackend", "GradOptions", "backend", "zoo", "__version__"]
