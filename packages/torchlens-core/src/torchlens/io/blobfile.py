"""Payload blobs: safetensors files written and parsed here, strictly.

The layout is the safetensors one (8-byte little-endian header length, a JSON header of
`name -> {dtype, shape, data_offsets}` plus `__metadata__`, then the raw bytes), so any
safetensors reader opens our blobs. We write and parse it ourselves to stream the sha256
while writing, to read files into aligned buffers, and to turn every malformed byte into a typed refusal.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchlens.errors import ArtifactError
from torchlens.io.codec import DTYPE_ITEMSIZE, EncodedPayload
from torchlens.io.manifest import strict_json

#: neutral dtype tag -> (safetensors dtype, numpy storage dtype, trailing real axis for complex)
STORAGE: dict[str, tuple[str, str, bool]] = {
    "bool": ("BOOL", "bool", False), "uint8": ("U8", "uint8", False), "int8": ("I8", "int8", False),
    "int16": ("I16", "int16", False), "uint16": ("U16", "uint16", False), "int32": ("I32", "int32", False),
    "uint32": ("U32", "uint32", False), "int64": ("I64", "int64", False), "uint64": ("U64", "uint64", False),
    "float16": ("F16", "float16", False), "bfloat16": ("BF16", "uint16", False), "float32": ("F32", "float32", False),
    "float64": ("F64", "float64", False), "complex64": ("F32", "float32", True), "complex128": ("F64", "float64", True),
    "float8_e4m3fn": ("F8_E4M3", "uint8", False), "float8_e5m2": ("F8_E5M2", "uint8", False),
}
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "F16": 2,
                "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 100 * 1024 * 1024
_CHUNK = 16 * 1024 * 1024


def storage_shape(payload: EncodedPayload) -> list[int]:
    _, _, real_axis = STORAGE[payload.dtype]
    return [*payload.shape, 2] if real_axis else list(payload.shape)


def check_encoded(payload: EncodedPayload, where: str) -> None:
    """Refuse a codec's output that would not round-trip (wrong item size, wrong byte count)."""
    if payload.dtype not in STORAGE:
        raise ArtifactError("record_field_unencodable", f"{where}: codec produced unknown dtype tag {payload.dtype!r}",
                            remedy=f"use one of {sorted(STORAGE)}", at=where)
    arr = payload.array
    n = 1
    for d in payload.shape:
        n *= d
    if not isinstance(arr, np.ndarray) or arr.nbytes != n * DTYPE_ITEMSIZE[payload.dtype]:
        raise ArtifactError("record_field_unencodable", f"{where}: codec output holds the wrong number of bytes",
                            remedy="fix the backend's payload codec", at=where)


#: Tensors start on this boundary (in the file and in the read buffer), so a loaded payload
#: is as aligned as a freshly allocated one: CPU kernels pick code paths (and round) by it.
ALIGN = 64
PAD_PREFIX = "__tlpad_"


def write_blob(path: str, entries: list[tuple[str, EncodedPayload]], metadata: dict[str, str],
               digest_key: str | None = None) -> tuple[int, str]:
    """Write `entries` as one safetensors file; return (size, sha256 hex).

    With `digest_key`, `__metadata__[digest_key]` holds `content_digest` of the file (every
    other metadata entry and the data section), so a file that has no manifest (the
    safetensors export) still detects damage on read.

    Every tensor starts on an `ALIGN`-byte boundary: the header is padded with spaces and the
    gaps between tensors are filled by uint8 padding entries named `__tlpad_<n>` (the format
    allows no holes), which readers of ours skip."""
    order = sorted(entries, key=lambda e: -_ST_ITEMSIZE[STORAGE[e[1].dtype][0]])
    layout: list[tuple[str, Any]] = []
    offset = 0
    for name, p in order:
        gap = -offset % ALIGN
        if gap:
            layout.append((f"{PAD_PREFIX}{len(layout)}", gap))
            offset += gap
        layout.append((name, p))
        offset += p.array.nbytes
    meta = {**metadata, "align": str(ALIGN)}
    if digest_key is not None:
        h = _meta_digest(meta)
        for _, p in layout:
            for part in ((bytes(p),) if isinstance(p, int) else _byte_chunks(p.array)):
                h.update(part)
        meta[digest_key] = h.hexdigest()
    header: dict[str, Any] = {"__metadata__": meta}
    pos = 0
    for name, p in layout:
        if isinstance(p, int):
            header[name] = {"dtype": "U8", "shape": [p], "data_offsets": [pos, pos + p]}
            pos += p
        else:
            n = p.array.nbytes
            header[name] = {"dtype": STORAGE[p.dtype][0], "shape": storage_shape(p), "data_offsets": [pos, pos + n]}
            pos += n
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-(len(head) + 8) % ALIGN)
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(head).to_bytes(8, "little"), head):
            f.write(chunk)
            h.update(chunk)
        for _, p in layout:
            parts = (bytes(p),) if isinstance(p, int) else _byte_chunks(p.array)
            for part in parts:
                f.write(part)
                h.update(part)
    return 8 + len(head) + offset, h.hexdigest()


def _meta_digest(meta: dict[str, str]) -> Any:
    h = hashlib.sha256()
    for k in sorted(meta):
        h.update(k.encode("utf-8", "surrogatepass") + b"\0" + meta[k].encode("utf-8", "surrogatepass") + b"\0")
    return h


def content_digest(blob: "Blob", digest_key: str, data_start: int) -> str:
    """The sha256 `write_blob(..., digest_key=...)` stored: metadata (less the digest entry)
    then the data section, read from the blob's buffer."""
    h = _meta_digest({k: v for k, v in blob.metadata.items() if k != digest_key})
    view = memoryview(blob.buffer)
    for i in range(data_start, len(view), _CHUNK):
        h.update(view[i:i + _CHUNK])
    return h.hexdigest()


def aligned_buffer(size: int) -> np.ndarray:
    """A writable byte buffer whose first byte sits on an `ALIGN`-byte boundary."""
    raw = np.empty(size + ALIGN, dtype=np.uint8)
    off = -raw.ctypes.data % ALIGN
    return raw[off:off + size]


def _byte_chunks(arr: np.ndarray) -> Any:
    """The array's bytes in C order, in chunks of about `_CHUNK`; a strided array is copied
    one block of rows at a time (in the writer thread, never whole)."""
    if arr.nbytes == 0:
        return
    if arr.flags.c_contiguous:
        mv = memoryview(arr.reshape(-1).view(np.uint8))
        for i in range(0, len(mv), _CHUNK):
            yield mv[i:i + _CHUNK]
        return
    if arr.ndim <= 1:
        yield memoryview(np.ascontiguousarray(arr).view(np.uint8))
        return
    rows = max(1, _CHUNK // max(1, arr[0].nbytes))
    for i in range(0, arr.shape[0], rows):
        yield memoryview(np.ascontiguousarray(arr[i:i + rows]).reshape(-1).view(np.uint8))


@dataclass
class Blob:
    """A parsed blob: its header entries and a buffer (bytes in memory, or a mapping)."""

    name: str
    entries: dict[str, tuple[str, list[int], int, int]]  # tensor -> (st dtype, shape, start, end) in file
    metadata: dict[str, str]
    buffer: Any

    def storage(self, tensor: str) -> np.ndarray:
        st, _, start, end = self.entries[tensor]
        return np.frombuffer(self.buffer, dtype=np.uint8, count=end - start, offset=start)


def _bad(name: str, why: str) -> ArtifactError:
    return ArtifactError("blob_malformed", f"{name}: {why}", remedy="the blob is damaged; save the trace again", blob=name)


def parse_header(name: str, head: bytes, size: int) -> tuple[dict, dict, int]:
    """Parse and check a safetensors header; return (entries, metadata, data start)."""
    if size < 8 or len(head) < 8:
        raise _bad(name, "shorter than a safetensors header")
    n = int.from_bytes(bytes(head[:8]), "little")
    if n > _MAX_HEADER or n + 8 > size:
        raise _bad(name, "header length exceeds the file")
    if len(head) < 8 + n:
        raise _bad(name, "header truncated")
    try:
        obj = strict_json(bytes(head[8:8 + n]).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _bad(name, f"header is not JSON ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise _bad(name, "header is not a JSON object")
    meta = obj.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _bad(name, "__metadata__ is not a map of strings")
    start = 8 + n
    data_len = size - start
    entries: dict[str, tuple[str, list[int], int, int]] = {}
    spans = []
    for tname, e in obj.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise _bad(name, f"entry {tname!r} is malformed")
        st, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if (type(st) is not str or st not in _ST_ITEMSIZE or not isinstance(shape, list)
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise _bad(name, f"entry {tname!r} has a bad dtype or shape")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1] <= data_len):
            raise _bad(name, f"entry {tname!r} has bad data offsets")
        count = 1
        for d in shape:
            count *= d
        if count * _ST_ITEMSIZE[st] != offs[1] - offs[0]:
            raise _bad(name, f"entry {tname!r}: shape and byte span disagree")
        entries[tname] = (st, shape, start + offs[0], start + offs[1])
        spans.append((offs[0], offs[1]))
    pos = 0
    for a, b in sorted(spans):
        if a != pos:
            raise _bad(name, "data section has gaps or overlaps")
        pos = b
    if pos != data_len:
        raise _bad(name, "data section length disagrees with the header")
    return entries, meta, start


def read_blob(path: str, name: str, size: int, sha256: str | None, lazy: bool = False) -> Blob:
    """Read one blob into an aligned in-memory buffer and check its size and sha256.

    The digest is computed over the very bytes the returned `Blob` holds ("copy on
    verification"), and the file is never memory-mapped: a mapping would turn a later
    truncation of the file into SIGBUS and let bytes changed after the check through. `lazy`
    is accepted for compatibility and changes nothing."""
    check_size_on_disk(path, name, size)  # the declared size sizes the buffer: check it against the file first
    buffer = aligned_buffer(size)
    with open(path, "rb") as f:
        got = f.readinto(buffer)
        extra = f.read(1)
    _check_digest(name, got + len(extra), size, hashlib.sha256(buffer).hexdigest(), sha256)
    entries, meta, _ = parse_header(name, buffer, size)
    return Blob(name, entries, meta, buffer)


def check_size_on_disk(path: str, name: str, size: Any) -> None:
    """Refuse a declared size that is not a non-negative int or differs from the file's real
    size, before anything is allocated from it (a hostile manifest can declare any number)."""
    if type(size) is not int or size < 0:
        raise ArtifactError("manifest_malformed", f"the manifest gives {name} a size that is not a byte count",
                            remedy="the manifest is damaged; save the artifact again", file=name)
    try:
        real = os.stat(path).st_size
    except OSError as exc:
        raise ArtifactError("artifact_read_failed", f"could not stat {name}: {exc}", remedy="check permissions",
                            file=name) from None
    if real != size:
        raise ArtifactError("artifact_size_mismatch", f"{name} is {real} bytes, the manifest says {size}",
                            remedy="the file was truncated or modified; save the artifact again", file=name)


def _check_digest(name: str, got_size: int, size: int, digest: str, expected: str | None) -> None:
    if got_size != size:
        raise ArtifactError("artifact_size_mismatch", f"{name} changed size while being read",
                            remedy="do not modify an artifact while loading it", file=name)
    if expected is not None and digest != expected:
        raise ArtifactError("artifact_digest_mismatch", f"{name}: sha256 {digest[:12]}... differs from the manifest",
                            remedy="the file was modified or damaged; save the trace again", file=name)


def payload_from_storage(blob: Blob, tensor: str, dtype: str, shape: tuple[int, ...], meta: dict[str, str]) -> EncodedPayload:
    """The `EncodedPayload` a payload record and its blob entry describe (checked to agree)."""
    if type(tensor) is not str or tensor not in blob.entries:
        raise _bad(blob.name, f"holds no tensor {tensor!r:.80}")
    if type(dtype) is not str or dtype not in STORAGE:
        raise _bad(blob.name, f"unknown dtype tag {dtype!r} for {tensor!r}")
    st_expected, np_storage, real_axis = STORAGE[dtype]
    st, st_shape, _, _ = blob.entries[tensor]
    want_shape = [*shape, 2] if real_axis else list(shape)
    if st != st_expected or st_shape != want_shape:
        raise _bad(blob.name, f"tensor {tensor!r} is {st}{st_shape}, its record says {dtype}{list(shape)}")
    raw = blob.storage(tensor).view(np_storage)
    if real_axis:
        raw = raw.view(dtype)
    return EncodedPayload(raw, dtype, tuple(shape), dict(meta))


def fsize(path: str) -> int:
    return os.stat(path).st_size
