"""The `torchlens` entry point of this distribution. Light on purpose: no jax import.

`torchlens_backends()` returns the JAX `BackendSpec`; its `protocol` and `zoo` factories
import jax only when a capture (or the conformance suite) needs them.
"""

from __future__ import annotations

from typing import Any

import torchlens
from torchlens.backends.sdk import BackendSpec, FrameworkRequirement

#: Tested on jax 0.10.2 only, so the preview range is the 0.10 series.
FRAMEWORK = FrameworkRequirement(
    distributions=("jax",),
    minimum="0.10.0",
    below="0.11",
    tested_through="0.10.2",
    pinned="0.10.2",
    extra="jax",
)


def _protocol() -> Any:
    from torchlens_jax.backend import get_backend

    return get_backend()


def _zoo() -> Any:
    from torchlens_jax.zoo import zoo

    return zoo()


@torchlens.hookimpl
def torchlens_backends() -> list[BackendSpec]:
    return [BackendSpec(
        name="jax",
        maturity="preview",
        framework=FRAMEWORK,
        protocol=_protocol,
        modules=("jax",),
        zoo=_zoo,
        namespace="torchlens_jax",
        description="JAX: evaluates the jaxpr one primitive at a time; flax.nnx and equinox module aware",
        package="torchlens-jax",
    )]
