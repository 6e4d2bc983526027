"""`tl.validation`: checks of saved artifacts that need no framework."""

from __future__ import annotations

from typing import Any


def validate_tlspec(path: Any) -> dict[str, Any]:
    """Check a saved directory (a trace `.tlspec`, an intervention spec or a recipe) with
    every check `tl.load` makes: path rules, manifest schema and version, every file's size
    and sha256, every record cell against its schema, blob headers against the payload
    records, each payload and literal through the codec the artifact names. A trace's
    payloads are decoded one at a time and dropped, not kept. Returns the manifest; raises
    the typed error `tl.load` would raise (the code of the first failure), so it refuses
    exactly what `tl.load` refuses."""
    from torchlens.io.artifact import validate_artifact

    return validate_artifact(path)


__all__ = ["validate_tlspec"]
