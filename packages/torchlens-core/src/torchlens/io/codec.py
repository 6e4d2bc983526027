"""Payload codecs: how a backend's framework-native values become bytes on disk and back.

Core never looks inside a payload. A backend offers a `PayloadCodec` through the capability
protocol `tl.backends.SupportsPersistence` (`payload_codec()`); the codec turns a value into an `EncodedPayload` (a
numpy array holding the value's exact bytes plus a neutral dtype tag and string metadata)
and back. Core's `NumpyCodec` serves numpy payloads (the reference backend uses it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from torchlens.errors import ArtifactError

#: Neutral dtype tags and their item sizes in bytes.
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}


@dataclass(frozen=True)
class EncodedPayload:
    """One payload as bytes: `array` holds the value's exact elements (native little-endian,
    any numpy dtype whose item size equals the tag's, any strides: the writer copies a
    strided array to C order in chunks); `dtype` is the neutral
    tag from `DTYPE_ITEMSIZE`; `shape` the value's shape; `meta` string facts the codec needs
    to rebuild the value (device, subclass, byte order)."""

    array: np.ndarray
    dtype: str
    shape: tuple[int, ...]
    meta: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class PayloadCodec(Protocol):
    """What a backend's `payload_codec()` returns. `name` is written into the artifact and
    must name the same codec on load."""

    name: str

    def can_encode(self, value: Any) -> bool: ...
    def encode(self, value: Any) -> EncodedPayload: ...
    def decode(self, payload: EncodedPayload) -> Any: ...


_NUMPY_TAGS = {"bool": "bool", "uint8": "uint8", "int8": "int8", "int16": "int16", "uint16": "uint16",
               "int32": "int32", "uint32": "uint32", "int64": "int64", "uint64": "uint64", "float16": "float16",
               "float32": "float32", "float64": "float64", "complex64": "complex64", "complex128": "complex128"}


class NumpyCodec:
    """Codec for numpy arrays (and the reference backend). Bit-exact for every dtype in
    `DTYPE_ITEMSIZE` numpy has; big-endian arrays come back big-endian."""

    name = "numpy"

    def can_encode(self, value: Any) -> bool:
        return (isinstance(value, np.ndarray) and type(value) in (np.ndarray, np.memmap)
                and value.dtype.name in _NUMPY_TAGS and value.dtype.fields is None)

    def encode(self, value: Any) -> EncodedPayload:
        arr = value
        meta: dict[str, str] = {}
        if arr.dtype.byteorder == ">":
            meta["byteorder"] = ">"
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        return EncodedPayload(arr, arr.dtype.name, tuple(int(d) for d in arr.shape), meta)

    def decode(self, payload: EncodedPayload) -> Any:
        np_name = _NUMPY_TAGS.get(payload.dtype)
        if np_name is None:
            raise ArtifactError("payload_codec_unavailable", f"numpy has no dtype {payload.dtype!r}",
                                remedy="load with the backend that saved this artifact installed", dtype=payload.dtype)
        arr = payload.array.view(np.dtype(np_name).newbyteorder("<")).reshape(payload.shape)
        if payload.meta.get("byteorder") == ">":
            return arr.astype(arr.dtype.newbyteorder(">"))
        if arr.dtype.byteorder not in ("=", "|"):
            arr = arr.view(np.dtype(np_name))
        return arr


def backend_codec(backend: Any) -> PayloadCodec:
    """The codec a backend protocol object offers (`SupportsPersistence`), or core's
    `NumpyCodec` when it offers none."""
    from torchlens.backends.protocol import SupportsPersistence, supports

    if not supports(backend, SupportsPersistence):
        return NumpyCodec()
    return backend.payload_codec()


def codec_named(name: str, backend_name: str) -> PayloadCodec:
    """The codec an artifact names: core's own for `"numpy"`, else the installed backend's."""
    if name == NumpyCodec.name:
        return NumpyCodec()
    from torchlens.backends.registry import get_protocol

    codec = backend_codec(get_protocol(backend_name))
    if codec.name != name:
        raise ArtifactError("payload_codec_unavailable",
                            f"the artifact's payloads use codec {name!r}; the {backend_name} backend offers {codec.name!r}",
                            remedy=f"install the backend that wrote it (torchlens[{backend_name}])", codec=name)
    return codec


__all__ = ["PayloadCodec", "EncodedPayload", "NumpyCodec", "DTYPE_ITEMSIZE", "backend_codec", "codec_named"]
