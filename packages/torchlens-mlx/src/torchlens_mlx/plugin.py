"""The `torchlens` entry point of this distribution. Light on purpose: no mlx import.

`torchlens_backends()` returns the MLX `BackendSpec`; its `protocol` and `zoo` factories
import mlx only when a capture (or the conformance suite) needs them.
"""

from __future__ import annotations

from typing import Any

import torchlens
from torchlens.backends.sdk import BackendSpec, FrameworkRequirement

#: Tested on mlx 0.32.4 (the `mlx[cpu]` wheels on Linux) only: the preview range is the 0.32 series.
FRAMEWORK = FrameworkRequirement(
    distributions=("mlx",),
    minimum="0.32.0",
    below="0.33",
    tested_through="0.32.4",
    pinned="0.32.4",
    extra="mlx",
)


def _protocol() -> Any:
    from torchlens_mlx.backend import MLXBackend

    return MLXBackend()


def _zoo() -> Any:
    from torchlens_mlx.zoo import zoo

    return zoo()


@torchlens.hookimpl
def torchlens_backends() -> list[BackendSpec]:
    return [BackendSpec(
        name="mlx",
        maturity="preview",
        framework=FRAMEWORK,
        protocol=_protocol,
        modules=("mlx",),
        zoo=_zoo,
        namespace="torchlens_mlx",
        description="MLX: wraps mlx.core functions and mx.array operators during capture; mlx.nn module aware",
        package="torchlens-mlx",
    )]
