"""The `torchlens` entry point of this distribution. Light on purpose: no tensorflow import.

`torchlens_backends()` returns the TensorFlow `BackendSpec`; its `protocol` and `zoo`
factories import tensorflow only when a capture (or the conformance suite) needs them.
"""

from __future__ import annotations

from typing import Any

import torchlens
from torchlens.backends.sdk import BackendSpec, FrameworkRequirement

#: Tested on tensorflow-cpu 2.21.0 with Keras 3.15.1 only: the preview range is the 2.21 series.
FRAMEWORK = FrameworkRequirement(
    distributions=("tensorflow-cpu", "tensorflow"),
    minimum="2.21.0",
    below="2.22",
    tested_through="2.21.0",
    pinned="2.21.0",
    extra="tf",
)


def _protocol() -> Any:
    from torchlens_tf.backend import TFBackend

    return TFBackend()


def _zoo() -> Any:
    from torchlens_tf.zoo import zoo

    return zoo()


@torchlens.hookimpl
def torchlens_backends() -> list[BackendSpec]:
    return [BackendSpec(
        name="tf",
        maturity="preview",
        framework=FRAMEWORK,
        protocol=_protocol,
        modules=("tensorflow",),
        zoo=_zoo,
        namespace="torchlens_tf",
        description="TensorFlow / Keras 3: eager op callbacks see every executed TF op; Keras layer aware",
        package="torchlens-tf",
    )]
