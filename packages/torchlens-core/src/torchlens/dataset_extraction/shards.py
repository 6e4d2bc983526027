"""The disk format of a dataset extraction: `batch_XXXXX.safetensors` shards and `manifest.json`.

A shard is written whole to a temporary name, flushed and renamed, so a killed run leaves
only complete shards. Each shard's safetensors metadata names the run digest, its batch
index, its rows and the digest of its inputs; the manifest lists every shard with its file
digest once the run completes. Reading checks all of it before a value is returned, and
nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from torchlens.errors import ArtifactError

MANIFEST = "manifest.json"
FORMAT = "tl_extraction_v1"
SHARD_FORMAT = "tl_extraction_shard_v1"
SHARD_NAME = re.compile(r"batch_(\d{5,9})\.safetensors")
MAX_MANIFEST_BYTES = 64 << 20


def shard_name(index: int) -> str:
    return f"batch_{index:05d}.safetensors"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32", "int16": "I16",
              "int8": "I8", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL"}


def encode_safetensors(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """Safetensors bytes with a deterministic layout (sorted metadata and tensor names), so
    the same values always give the same file: a resumed run's shards equal an uninterrupted
    run's byte for byte. (The safetensors writer orders its header by hash.)"""
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, off = [], 0
    for name in sorted(arrays):
        a = np.asarray(arrays[name])
        code = _ST_DTYPES.get(a.dtype.name)
        if code is None:
            raise ArtifactError("extraction_shard_invalid", f"{name!r} has dtype {a.dtype}, which a shard cannot hold",
                                remedy="extract float, int or bool values")
        raw = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def encode_shard(values: dict[str, np.ndarray], meta: dict[str, str]) -> bytes:
    return encode_safetensors(values, {"format": SHARD_FORMAT, **meta})


def _bad(code: str, path: Path, why: str) -> ArtifactError:
    return ArtifactError(code, f"{path}: {why}", path=str(path),
                         remedy="re-run the extraction (resume=True keeps the shards that check out), "
                                "or load a directory written by tl.extract_dataset")


def decode_shard(path: Path, *, run: str | None = None, index: int | None = None,
                 sha256: str | None = None) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """Metadata and arrays of one shard, checked against what the caller expects."""
    from torchlens.stats.state import read_safetensors

    try:
        data = path.read_bytes()
    except OSError as e:
        raise _bad("extraction_shard_invalid", path, f"unreadable ({e.strerror})") from None
    if sha256 is not None and digest(data) != sha256:
        raise _bad("extraction_shard_invalid", path, "file digest differs from the manifest (changed or corrupt)")
    try:
        meta, arrays = read_safetensors(data, str(path), "extraction_shard_invalid")
    except ArtifactError as e:
        raise _bad("extraction_shard_invalid", path, e.message) from None
    if meta.get("format") != SHARD_FORMAT:
        raise _bad("extraction_shard_foreign", path, f"format tag {meta.get('format')!r} is not {SHARD_FORMAT!r}")
    if run is not None and meta.get("run") != run:
        raise _bad("extraction_shard_foreign", path, "the shard belongs to another extraction run")
    if index is not None and meta.get("index") != str(index):
        raise _bad("extraction_shard_invalid", path, f"shard says batch {meta.get('index')!r}, expected {index}")
    return meta, arrays


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    atomic_write(root / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    try:
        size = path.stat().st_size
    except OSError:
        raise _bad("extraction_manifest_invalid", root, "no manifest.json") from None
    if size > MAX_MANIFEST_BYTES:
        raise _bad("extraction_manifest_invalid", path, f"{size} bytes is more than a manifest may hold")
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise _bad("extraction_manifest_invalid", path, f"not JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _bad("extraction_manifest_invalid", path, f"format is not {FORMAT!r}")
    for field, kind in (("run", str), ("signature", dict), ("sites", list), ("shards", list), ("status", str)):
        if not isinstance(manifest.get(field), kind):
            raise _bad("extraction_manifest_invalid", path, f"field {field!r} is missing or not a {kind.__name__}")
    for entry in manifest["shards"]:
        if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and SHARD_NAME.fullmatch(entry["file"])
                and isinstance(entry.get("index"), int) and entry["file"] == shard_name(entry["index"])
                and isinstance(entry.get("rows"), list) and len(entry["rows"]) == 2
                and all(isinstance(r, int) and r >= 0 for r in entry["rows"]) and entry["rows"][0] <= entry["rows"][1]
                and isinstance(entry.get("sha256"), str)):
            raise _bad("extraction_manifest_invalid", path, f"shard entry {str(entry)[:200]} is malformed")
    return manifest


def is_extraction_dir(path: Any) -> bool:
    """Whether `path` is a directory whose manifest claims the extraction format (cheap)."""
    p = Path(path)
    m = p / MANIFEST
    if not (p.is_dir() and m.is_file()):
        return False
    try:
        with open(m, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return FORMAT.encode() in head
