"""tl.io.detect_tlspec_format: which saved format a directory holds, without loading it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchlens.errors import ArtifactError
from torchlens.io.manifest import FORMAT, FORMAT_VERSION, MANIFEST_NAME, looks_pre_3, read_bounded

_MAX_MARKER_BYTES = 64 * 1024 * 1024
_PRE_3_MARKERS = ("spec.json", "metadata.json", "merged_manifest.json")


def detect_tlspec_format(path: Any) -> str:
    """`"v3"` when the root manifest names saved format 3, `"pre_3"` for save markers of
    torchlens 2.37 and earlier, `"unknown"` when no TorchLens save marker is present.

    Detection reads only the marker files and does not validate the artifact
    (`tl.validation.validate_tlspec` does). A symlinked path or marker file refuses with
    `load_path_symlink_rejected`.
    """
    bundle = Path(os.fspath(path))
    if bundle.is_symlink():
        raise ArtifactError("load_path_symlink_rejected", f"{bundle} is a symlink",
                            remedy="inspect the real path (a symlinked parent directory is fine)", path=str(bundle))
    if not bundle.is_dir():
        return "unknown"
    manifest = _read_marker(bundle / MANIFEST_NAME)
    if isinstance(manifest, dict):
        if manifest.get("format") == FORMAT and type(manifest.get("format_version")) is int:
            return "v3" if manifest["format_version"] == FORMAT_VERSION else ("pre_3" if manifest["format_version"] < 3 else "unknown")
        if looks_pre_3(manifest):
            return "pre_3"
    for name in _PRE_3_MARKERS:
        obj = _read_marker(bundle / name)
        if isinstance(obj, dict) and (looks_pre_3(obj) or "kind" in obj or "torchlens_version" in obj):
            return "pre_3"
    return "unknown"


def _read_marker(p: Path) -> Any:
    import json

    if p.is_symlink():
        raise ArtifactError("load_path_symlink_rejected", f"{p} is a symlink", remedy="artifacts hold no symlinks",
                            path=str(p))
    if not p.is_file():
        return None
    try:
        data = read_bounded(p, _MAX_MARKER_BYTES)
        if data is None:
            return None
        return json.loads(data.decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
