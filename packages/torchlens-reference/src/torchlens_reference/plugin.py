"""Entry point `torchlens = reference`: registers the backend. Imports no framework."""

from __future__ import annotations

import torchlens
from torchlens.backends.sdk import BackendSpec, FrameworkRequirement


def _protocol():
    from torchlens_reference.backend import ReferenceBackend

    return ReferenceBackend()


def _zoo():
    from torchlens_reference.zoo import zoo

    return zoo()


FRAMEWORK = FrameworkRequirement(distributions=("numpy",), minimum="1.24", below="3", tested_through="2.4", extra="")


@torchlens.hookimpl
def torchlens_backends():
    return [BackendSpec(name="reference", maturity="preview", framework=FRAMEWORK, protocol=_protocol,
                        modules=("torchlens_reference.nn",), zoo=_zoo, namespace="torchlens_reference.nn",
                        description="toy numpy backend (tests and documentation)", package="torchlens-reference")]
