"""`tl.validation`: checks of saved artifacts that need no framework."""

from __future__ import annotations

from typing import Any


def validate_tlspec(path: Any) -> dict[str, Any]:
    """Check a `.tlspec` directory without building the trace: path rules, manifest schema
    and version, every file's size and sha256, every record cell against its schema, blob
    headers against the payload records. Returns the manifest; raises `ArtifactError` with
    the code of the first failure."""
    from torchlens.io.bundle import validate

    return validate(path)


__all__ = ["validate_tlspec"]
