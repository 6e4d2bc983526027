"""Which loader reads a saved directory, and one entry for load and validate over all kinds.

`tl.load` and `tl.validation.validate_tlspec` read the same artifacts (traces, intervention
specs, recipes) and must refuse exactly the same ones, so both go through here: the kind is
read from `manifest.json` with a size bound and strict JSON (no duplicate keys, bounded
nesting, never a raw exception), then the kind's own loader checks everything. Validation
runs the same checks as loading and differs only in what it keeps.
"""

from __future__ import annotations

from typing import Any

SPEC_KINDS = ("recipe", "intervention")


def artifact_kind(path: Any) -> str | None:
    """The manifest's `kind` when it is readable, strict JSON and names one; None otherwise
    (the trace loader then refuses the directory with its own typed code)."""
    from torchlens.io.bundle import _as_path
    from torchlens.io.manifest import MAX_MANIFEST_BYTES, read_bounded, strict_json

    manifest = _as_path(path) / "manifest.json"
    try:
        if manifest.is_symlink() or not manifest.is_file():
            return None
        data = read_bounded(manifest, MAX_MANIFEST_BYTES)
        if data is None:
            return None
        obj = strict_json(data.decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    kind = obj.get("kind") if isinstance(obj, dict) else None
    return kind if type(kind) is str else None


def load_artifact(path: Any, lazy: bool = False) -> Any:
    """`tl.load`: a Trace, an InterventionSpec (kind "intervention"), a Recipe or a Bundle."""
    from torchlens.io.bundle import repair

    repair(path)  # a save killed mid-publish is repaired before the kind is read
    kind = artifact_kind(path)
    if kind in SPEC_KINDS:
        from torchlens.io.intervention import load_intervention_spec

        if not isinstance(lazy, bool):
            from torchlens.io.bundle import _arg

            raise _arg("lazy= takes True or False")
        spec = load_intervention_spec(path)
        return spec.recipe if kind == "recipe" else spec
    if kind == "bundle":  # a tl.Bundle of traces (not the .tlspec trace writer in io/bundle.py)
        from torchlens.bundle.artifact import load_bundle

        return load_bundle(path, lazy=lazy)
    from torchlens.io.bundle import load

    return load(path, lazy=lazy)


def validate_artifact(path: Any) -> dict[str, Any]:
    """Every check `load_artifact` makes; returns the manifest."""
    from torchlens.io.bundle import repair

    repair(path)
    kind = artifact_kind(path)
    if kind in SPEC_KINDS:
        from torchlens.io.bundle import _as_path
        from torchlens.io.intervention import load_intervention_spec, read_intervention_manifest

        load_intervention_spec(path)
        return read_intervention_manifest(_as_path(path))
    if kind == "bundle":
        from torchlens.bundle.artifact import _read_checked_layout, load_bundle
        from torchlens.io.bundle import _as_path

        load_bundle(path)  # every check a load makes
        return _read_checked_layout(_as_path(path))[0]
    from torchlens.io.bundle import validate

    return validate(path)


__all__ = ["artifact_kind", "load_artifact", "validate_artifact"]
