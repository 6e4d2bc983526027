"""TorchLens backend for JAX (`tl.backends.jax`, preview).

Importing this package imports no jax: the public names below resolve lazily (through the
SDK's `lazy_loader`), so the plugin entry point (`torchlens_jax.plugin`) stays light.
"""

from __future__ import annotations

from torchlens.backends.sdk import lazy_loader

__version__ = "0.1.0"

__getattr__, __dir__ = lazy_loader(__name__, {
    "JAXBackend": "torchlens_jax.backend:JAXBackend",
    "backend": "torchlens_jax.backend:get_backend",
    "GradOptions": "torchlens_jax.options:GradOptions",
    "zoo": "torchlens_jax.zoo",
})

__all__ = ["JAXBackend", "GradOptions", "backend", "zoo", "__version__"]
