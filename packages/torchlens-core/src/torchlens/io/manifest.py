"""manifest.json of a `.tlspec` directory: what the artifact is and every file it holds.

The manifest names the format and its version, the torchlens and backend versions, the
payload codec, the record counts, the disclosures (values written as text, callables kept as
placeholders) and the sha256 and size of every file. Load checks it strictly before it
reads anything else.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from torchlens.errors import ArtifactError

FORMAT = "tlspec"
FORMAT_VERSION = 3
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
_FILE_RE = re.compile(r"^(records/[a-z_]+\.json|intervention\.json|blobs/[A-Za-z0-9_-]+\.safetensors)$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_KEYS = {"format", "format_version", "kind", "level", "schema_digest", "torchlens_version", "backend", "codec",
         "counts", "disclosures", "files"}
_DISCLOSURE_KEYS = {"unencodable_values", "unencodable_types", "callable_placeholders", "output_not_stored"}


def malformed(why: str) -> ArtifactError:
    return ArtifactError("manifest_malformed", f"manifest.json {why}",
                         remedy="the manifest is damaged; save the trace again", why=why)


def _no_dup_keys(items: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in items:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str) -> Any:
    """Parse JSON with no duplicate keys and no NaN/Infinity literals (ValueError otherwise)."""
    return json.loads(text, object_pairs_hook=_no_dup_keys, parse_constant=_no_constant)


def read_bounded(path: Any, limit: int) -> bytes | None:
    """The file's bytes, or None when it is larger than `limit`. Only what the file holds is
    allocated (`f.read(limit + 1)` would allocate `limit` bytes for a one-byte file). Raises
    OSError as `open` does."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            return None
        data = f.read(size + 1)  # one byte more: a file that grew since the stat shows up
    return data if len(data) <= limit else None


def parse_json(data: bytes, what: str, code: str) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity literals; typed refusal otherwise."""
    try:
        return strict_json(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ArtifactError(code, f"{what} is not valid JSON ({type(exc).__name__})",
                            remedy="the file is truncated or damaged; save the trace again", file=what) from None


def looks_pre_3(obj: Any) -> bool:
    """Save markers of torchlens 2.37 and earlier."""
    if not isinstance(obj, dict):
        return False
    if "tlspec_version" in obj or "bundle_format" in obj:
        return True
    fv = obj.get("format_version")
    return "kind" in obj and fv is not None and obj.get("format") != FORMAT


def check_manifest(obj: Any) -> dict[str, Any]:
    """Check a parsed manifest against saved format 3's manifest schema."""
    if not isinstance(obj, dict):
        raise malformed("is not a JSON object")
    if looks_pre_3(obj):
        raise ArtifactError("manifest_version_unsupported", "this artifact was saved by torchlens 2.37 or earlier",
                            remedy="load it with the torchlens version that wrote it, then save it again",
                            found=str(obj.get("tlspec_version", obj.get("format_version"))))
    if obj.get("format") != FORMAT:
        raise malformed("does not name the tlspec format")
    fv = obj.get("format_version")
    if type(fv) is not int:
        raise malformed("format_version is not an integer")
    if fv != FORMAT_VERSION:
        raise ArtifactError("manifest_version_unsupported", f"saved format {fv} is not {FORMAT_VERSION}",
                            remedy="load it with the torchlens version that wrote it", found=fv)
    if set(obj) != _KEYS:
        raise malformed(f"has keys {sorted(set(obj) ^ _KEYS)} it should not have or lacks")
    for key in ("kind", "level", "schema_digest", "torchlens_version", "codec"):
        if type(obj[key]) is not str:
            raise malformed(f"{key} is not a string")
    backend = obj["backend"]
    if not (isinstance(backend, dict) and set(backend) == {"name", "version", "framework_version"}
            and type(backend["name"]) is str and all(v is None or type(v) is str for v in backend.values())):
        raise malformed("backend is malformed")
    counts = obj["counts"]
    if not (isinstance(counts, dict) and all(type(v) is int and v >= 0 for v in counts.values())):
        raise malformed("counts is malformed")
    d = obj["disclosures"]
    if not (isinstance(d, dict) and set(d) == _DISCLOSURE_KEYS and type(d["unencodable_values"]) is int
            and type(d["callable_placeholders"]) is int and type(d["output_not_stored"]) is bool
            and isinstance(d["unencodable_types"], dict)
            and all(type(v) is int for v in d["unencodable_types"].values())):
        raise malformed("disclosures is malformed")
    files = obj["files"]
    if not isinstance(files, dict):
        raise malformed("files is not a map")
    for name, entry in files.items():
        if not _FILE_RE.match(name):
            raise malformed(f"lists a file outside the artifact layout: {name[:80]!r}")
        if not (isinstance(entry, dict) and set(entry) == {"sha256", "size"} and type(entry["sha256"]) is str
                and _SHA_RE.match(entry["sha256"]) and type(entry["size"]) is int and entry["size"] >= 0):
            raise malformed(f"entry for {name} is malformed")
    return obj


def render(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=False, allow_nan=False) + "\n").encode("utf-8")
