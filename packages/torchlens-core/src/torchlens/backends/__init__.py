"""The backend contract, its shared vocabularies, and the backend registry.

`tl.backends.<name>` (for example `tl.backends.torch`) resolves lazily, through the
registry, to the installed backend package's public namespace.
"""

from __future__ import annotations

from typing import Any

from torchlens.backends.codes import CAPABILITY_REFUSALS, REFUSAL_CODES, VALIDATION_REASONS
from torchlens.backends.protocol import (
    CAPABILITY_PROTOCOLS,
    PROTOCOL_MEMBERS,
    DifferentiableEditOps,
    EditOps,
    REPLAY_OPS_MEMBERS,
    ReplayOps,
    BackendCapabilities,
    BackendProtocol,
    BackendSpec,
    FrameworkRequirement,
    SupportsBackward,
    SupportsCallableTable,
    SupportsHostValues,
    SupportsInterventions,
    SupportsOpRebinding,
    SupportsPersistence,
    SupportsValidation,
    SupportsValidationScopes,
    SupportsValidationSession,
    ValidationStatus,
    edit_ops_of,
    missing_members,
    refusal_codes_for,
    supports,
)
from torchlens.backends.registry import (
    KNOWN_BACKEND_EXTRAS,
    get_protocol,
    get_spec,
    select_backend,
    specs,
)
from torchlens.errors import BackendUnsupportedError

__all__ = [
    "BackendCapabilities", "BackendProtocol", "BackendSpec", "BackendUnsupportedError", "FrameworkRequirement",
    "ValidationStatus", "REFUSAL_CODES", "VALIDATION_REASONS", "CAPABILITY_REFUSALS", "PROTOCOL_MEMBERS",
    "KNOWN_BACKEND_EXTRAS", "get_protocol", "get_spec", "select_backend", "specs", "missing_members",
    "CAPABILITY_PROTOCOLS", "SupportsInterventions", "SupportsBackward", "SupportsValidation",
    "SupportsValidationSession", "SupportsPersistence", "SupportsHostValues", "SupportsCallableTable",
    "SupportsOpRebinding", "SupportsValidationScopes", "EditOps", "DifferentiableEditOps", "ReplayOps", "REPLAY_OPS_MEMBERS", "edit_ops_of", "supports",
    "refusal_codes_for",
]


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(name)
    if name == "sdk":  # the backend SDK module (imported on first use)
        import importlib

        return importlib.import_module("torchlens.backends.sdk")
    from torchlens.backends.registry import namespace

    if name in KNOWN_BACKEND_EXTRAS or name in specs():
        return namespace(name)
    raise AttributeError(f"module 'torchlens.backends' has no attribute {name!r}")
