"""The `torchlens` entry point of this distribution. Light on purpose: no tinygrad import.

`torchlens_backends()` returns the tinygrad `BackendSpec`; its `protocol` and `zoo` factories
import tinygrad only when a capture (or the conformance suite) needs them.
"""

from __future__ import annotations

from typing import Any

import torchlens
from torchlens.backends.sdk import BackendSpec, FrameworkRequirement

#: Tested on tinygrad 0.14.0 only (CPU device through clang, and the pure-Python device):
#: the preview range is the 0.14 series (the Tensor method surface changes between minors).
FRAMEWORK = FrameworkRequirement(
    distributions=("tinygrad",),
    minimum="0.14.0",
    below="0.15",
    tested_through="0.14.0",
    pinned="0.14.0",
    extra="tinygrad",
)


def _protocol() -> Any:
    from torchlens_tinygrad.backend import TinygradBackend

    return TinygradBackend()


def _zoo() -> Any:
    from torchlens_tinygrad.zoo import zoo

    return zoo()


@torchlens.hookimpl
def torchlens_backends() -> list[BackendSpec]:
    return [BackendSpec(
        name="tinygrad",
        maturity="preview",
        framework=FRAMEWORK,
        protocol=_protocol,
        modules=("tinygrad",),
        zoo=_zoo,
        namespace="torchlens_tinygrad",
        description="tinygrad: wraps the public Tensor methods during capture (outermost call = one op, realized); "
                    "module scopes from the model's attribute tree",
        package="torchlens-tinygrad",
    )]
