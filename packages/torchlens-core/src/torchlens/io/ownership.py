"""Proof that a path holds an artifact this TorchLens wrote, before `overwrite=True` replaces it.

Why: `overwrite=True` deletes what is at the path. Guessing from marker files (a
`spec.json` with a "kind" key, a `metadata.json` naming a torchlens version) deleted user
directories that merely looked similar. A directory is replaced only when all of this holds:

* its `manifest.json` (a regular file) names saved format 3 and an artifact kind this
  version writes ("trace", "intervention", "recipe") and passes that kind's manifest schema;
* every file the manifest lists exists as a regular file with the listed size; the record
  files (`records/*.json`, `intervention.json`) match their sha256 byte for byte, and every
  blob's safetensors header parses and names the `tlspec-blob` format;
* it holds nothing else (no unlisted file, no symlink, no extra directory).

What proves authorship is the manifest plus byte-exact records and the exact file set.
Blob payload bytes are not hashed: they say whether the old artifact is damaged, not who
wrote it, and hashing them would make every overwrite read the whole old artifact first
(measured here: +1.0 s for a 192 MiB artifact, about 2 ms per MiB), so an artifact whose
payload bytes were damaged can still be replaced by a fresh save, which is what a user
re-saving it wants. Artifacts of torchlens 2.37 and earlier are never replaced. `prove_*`
returns a stat fingerprint; `rechecker` compares it again just before the swap, so a
directory changed while the new artifact was being written is kept.

A one-file export (`tl.export.safetensors`) is replaced only when it is a regular file whose
safetensors header parses and carries the `tl_trace_safetensors_v1` schema.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, Callable

from torchlens.errors import ArtifactError

_CHUNK = 16 * 1024 * 1024
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors header bound blobfile enforces
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_INTERVENTION_FILE_RE = re.compile(r"^(intervention\.json|blobs/recipe-[0-9]{4}\.safetensors)$")

Fingerprint = dict[str, tuple[int, int, int, int]]


def _refuse(target: Path, why: str) -> ArtifactError:
    return ArtifactError("bundle_path_not_artifact",
                         f"{target} {why}; overwrite=True replaces only an intact artifact TorchLens wrote",
                         remedy="choose another path, or remove it yourself if you no longer need it",
                         path=str(target), why=why)


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns)


def _schema(target: Path, manifest: Any) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(files, required directories) of a manifest of a kind this version writes."""
    from torchlens.io.manifest import FORMAT, FORMAT_VERSION, check_manifest

    if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT
            and type(manifest.get("format_version")) is int and manifest["format_version"] == FORMAT_VERSION):
        raise _refuse(target, "holds no manifest of saved format 3")
    kind = manifest.get("kind")
    if kind == "trace":
        runnable = None
        if manifest.get("level") == "runnable" and "runnable" in manifest:  # its runnable/ files, checked apart
            manifest = dict(manifest)
            runnable = manifest.pop("runnable")
        try:
            check_manifest(manifest)
            if runnable is not None:
                from torchlens.io.runnable import check_manifest_object

                runnable = check_manifest_object(runnable)
        except ArtifactError as exc:
            raise _refuse(target, f"has a trace manifest that fails its schema ({exc.code})") from None
        if runnable is not None:
            return {**manifest["files"], **runnable["files"]}, ("records", "blobs", "runnable")
        return manifest["files"], ("records", "blobs")
    if kind in ("intervention", "recipe"):
        from torchlens.io.intervention import _KEYS

        files = manifest.get("files")
        if set(manifest) != _KEYS or not isinstance(files, dict) or "intervention.json" not in files:
            raise _refuse(target, f"has an {kind} manifest that fails its schema")
        for name, entry in files.items():
            if not (_INTERVENTION_FILE_RE.match(name) and isinstance(entry, dict) and set(entry) == {"sha256", "size"}
                    and type(entry["sha256"]) is str and _SHA_RE.match(entry["sha256"])
                    and type(entry["size"]) is int and entry["size"] >= 0):
                raise _refuse(target, f"has an {kind} manifest that fails its schema")
        return files, ("blobs",)
    raise _refuse(target, f"has a manifest of a kind this version does not write ({str(kind)[:40]!r})")


def _sha256(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(min(_CHUNK, size + 1) or 1):
            h.update(chunk)
    return h.hexdigest()


def _blob_meta(path: Path, size: int) -> dict[str, str]:
    """The `__metadata__` of a safetensors file, reading only its header ({} if malformed)."""
    from torchlens.io import blobfile

    with open(path, "rb") as f:
        first = f.read(8)
        n = int.from_bytes(first, "little") if len(first) == 8 else -1
        if n < 0 or n > _MAX_HEADER or n + 8 > size:
            return {}
        head = first + f.read(n)
    try:
        return blobfile.parse_header(path.name, head, size)[1]
    except ArtifactError:
        return {}


def prove_artifact(target: Path) -> Fingerprint:
    """The fingerprint of the intact TorchLens artifact directory at `target`, or
    `bundle_path_not_artifact` naming what is wrong."""
    from torchlens.io.manifest import MAX_MANIFEST_BYTES

    try:
        top = os.lstat(target)
        if not stat.S_ISDIR(top.st_mode):
            raise _refuse(target, "is not a directory")
        print_: Fingerprint = {".": _stamp(top)}
        mpath = target / "manifest.json"
        try:
            mst = os.lstat(mpath)
        except FileNotFoundError:
            raise _refuse(target, "has no manifest.json") from None
        if not stat.S_ISREG(mst.st_mode) or mst.st_size > MAX_MANIFEST_BYTES:
            raise _refuse(target, "has a manifest.json that is not a regular file of plausible size")
        with open(mpath, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        try:
            manifest = json.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise _refuse(target, "has a manifest.json that is not JSON") from None
        files, dirs = _schema(target, manifest)
        print_["manifest.json"] = _stamp(mst)
        for entry in os.scandir(target):
            if entry.name == "manifest.json":
                continue
            if entry.name in dirs and entry.is_dir(follow_symlinks=False):
                print_[entry.name] = _stamp(entry.stat(follow_symlinks=False))
                for sub in os.scandir(entry.path):
                    if f"{entry.name}/{sub.name}" not in files:
                        raise _refuse(target, f"holds {entry.name}/{sub.name}, which its manifest does not list")
                continue
            if entry.name not in files:
                raise _refuse(target, f"holds {entry.name}, which its manifest does not list")
        for name, entry in files.items():
            p = target / name
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                raise _refuse(target, f"lacks {name}, which its manifest lists") from None
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry["size"]:
                raise _refuse(target, f"has a {name} that is not the file its manifest lists")
            if name.endswith(".json") or name.startswith("runnable/"):  # (runnable state: safetensors, no blob header)
                if _sha256(p, st.st_size) != entry["sha256"]:
                    raise _refuse(target, f"has a {name} whose sha256 differs from its manifest")
            elif _blob_meta(p, st.st_size).get("format") != "tlspec-blob":
                raise _refuse(target, f"has a {name} that is not a TorchLens payload blob")
            print_[name] = _stamp(st)
    except OSError as exc:
        raise _refuse(target, f"could not be inspected ({exc.strerror or exc})") from exc
    return print_


def prove_export(target: Path) -> Fingerprint:
    """The fingerprint of the `tl.export.safetensors` file at `target`, or `bundle_path_not_artifact`."""
    from torchlens.io.trace_safetensors import SCHEMA

    try:
        st = os.lstat(target)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(target, "is not a regular file")
        if SCHEMA not in _blob_meta(target, st.st_size):
            raise _refuse(target, f"is a safetensors file without the {SCHEMA} header")
    except OSError as exc:
        raise _refuse(target, f"could not be inspected ({exc.strerror or exc})") from exc
    return {".": _stamp(st)}


def rechecker(target: Path, fingerprint: Fingerprint) -> Callable[[], None]:
    """A check to run just before the swap: the target still has the proven fingerprint."""

    def recheck() -> None:
        try:
            now = _restamp(target, fingerprint)
        except OSError:
            now = None
        if now != fingerprint:
            raise _refuse(target, "changed while the new artifact was being written")

    return recheck


def _restamp(target: Path, fingerprint: Fingerprint) -> Fingerprint | None:
    out: Fingerprint = {}
    for rel in fingerprint:
        out[rel] = _stamp(os.lstat(target if rel == "." else target / rel))
    if os.path.isdir(target) and not os.path.islink(target):
        seen = {"."}
        for entry in os.scandir(target):
            seen.add(entry.name)
            if entry.is_dir(follow_symlinks=False):
                seen.update(f"{entry.name}/{s.name}" for s in os.scandir(entry.path))
        if seen != set(fingerprint):
            return None
    return out
