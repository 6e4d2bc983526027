"""TorchLens backend for PaddlePaddle (`tl.backends.paddle`, preview).

Importing this package imports no paddle: the public names below resolve lazily (through the
SDK's `lazy_loader`), so the plugin entry point (`torchlens_paddle.plugin`) stays light.
"""

from __future__ import annotations

from torchlens.backends.sdk import lazy_loader

__version__ = "0.1.0"

__getattr__, __dir__ = lazy_loader(__name__, {
    "PaddleBackend": "torchlens_paddle.backend:PaddleBackend",
    "GradOptions": "torchlens_paddle.options:GradOptions",
    "zoo": "torchlens_paddle.zoo",
})

__all__ = ["PaddleBackend", "GradOptions", "zoo", "__version__"]
