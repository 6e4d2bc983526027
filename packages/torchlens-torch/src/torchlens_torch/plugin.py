"""The `torchlens` entry point of this distribution. Light on purpose: no torch import.

`torchlens_backends()` returns the torch `BackendSpec`; its `protocol` and `zoo` factories
import torch only when a capture (or the conformance suite) needs them.
"""

from __future__ import annotations

from typing import Any

import torchlens
from torchlens.backends.sdk import BackendSpec, FrameworkRequirement

FRAMEWORK = FrameworkRequirement(
    distributions=("torch",),
    minimum="2.1",
    below="3",
    tested_through="2.13.0",
    pinned="2.13.0",
    extra="torch",
)


def _protocol() -> Any:
    try:
        from torchlens_torch.backend import get_backend
    except ImportError as exc:  # torch itself is missing or broken
        from torchlens.backends.sdk import install_hint, BackendUnsupportedError

        raise BackendUnsupportedError("runtime_missing", f"the torch backend cannot import torch: {exc}",
                                      remedy=install_hint("torch"), backend="torch", extra="torch") from exc
    return get_backend()


def _zoo() -> Any:
    from torchlens_torch.zoo import conformance_zoo

    return conformance_zoo()


def _distributed_group() -> Any:
    """The data-parallel group provider `tl.extract_dataset` / `tl.stats.aggregate` ask (issue 23):
    None until the program itself has imported torch.distributed, then the initialised default
    group (torchlens_torch.distributed_data), so no user import is needed."""
    import sys

    if "torch.distributed" not in sys.modules:
        return None
    from torchlens_torch.distributed_data import default_group

    return default_group()


torchlens.dataset_extraction.register_group_provider(_distributed_group)


@torchlens.hookimpl
def torchlens_backends() -> list[BackendSpec]:
    return [BackendSpec(
        name="torch",
        maturity="stable",
        framework=FRAMEWORK,
        protocol=_protocol,
        modules=("torch",),
        zoo=_zoo,
        namespace="torchlens_torch",
        description="PyTorch eager capture through TorchFunctionMode and module forward hooks",
        package="torchlens-torch",
    )]


@torchlens.hookimpl
def torchlens_facet_recipes() -> list[Any]:
    """The built-in torch facet recipes (attention, residual block, MLP, LM and classifier heads); imported only when
    TorchLens first asks for facet recipes (the first facet access); torch-free to import."""
    from torchlens_torch.recipes import RECIPES

    return list(RECIPES)
