"""TorchLens backend for TensorFlow / Keras 3 (`tl.backends.tf`, preview).

Importing this package imports no tensorflow: the public names below resolve lazily (through
the SDK's `lazy_loader`), so the plugin entry point (`torchlens_tf.plugin`) stays light.
"""

from __future__ import annotations

from torchlens.backends.sdk import lazy_loader

__version__ = "0.1.0"

__getattr__, __dir__ = lazy_loader(__name__, {
    "TFBackend": "torchlens_tf.backend:TFBackend",
    "GradOptions": "torchlens_tf.options:GradOptions",
    "zoo": "torchlens_tf.zoo",
})

__all__ = ["TFBackend", "GradOptions", "zoo", "__version__"]
