"""The JAX payload codec: jax.Array <-> core's neutral `EncodedPayload`, bit-exact.

Every dtype travels as its exact bytes in a NumPy array of the same item size, tagged with
the neutral dtype name (bfloat16 and the float8 types as unsigned integers). Typed PRNG key
arrays travel as their raw key data with the key implementation in `meta["prng_impl"]`, and
come back as typed keys. Loaded arrays are placed on JAX's default device (the saved device
is in `meta["device"]`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from torchlens.io.codec import EncodedPayload

_PLAIN = {"bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
          "float64", "complex64", "complex128"}
#: ml_dtypes types carried as same-size unsigned integers.
_VIEWED = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}


def _is_key(value: Any) -> bool:
    return jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


class JaxCodec:
    """`PayloadCodec` for jax.Array payloads (any dtype core has a tag for, and typed keys)."""

    name = "jax"

    def can_encode(self, value: Any) -> bool:
        if not isinstance(value, jax.Array):
            return False
        if _is_key(value):
            return True
        return str(value.dtype) in _PLAIN or str(value.dtype) in _VIEWED

    def encode(self, value: Any) -> EncodedPayload:
        meta = {"device": _device(value)}
        if _is_key(value):
            meta["prng_impl"] = str(jax.random.key_impl(value))
            meta["key_shape"] = ",".join(str(d) for d in value.shape)
            value = jax.random.key_data(value)
        arr = np.asarray(value)
        tag = str(arr.dtype)
        if tag in _VIEWED:
            arr = arr.view(_VIEWED[tag])
        return EncodedPayload(arr, tag, tuple(int(d) for d in arr.shape), meta)

    def decode(self, payload: EncodedPayload) -> Any:
        arr = np.asarray(payload.array)
        if payload.dtype in _VIEWED:
            import ml_dtypes

            arr = arr.view(getattr(ml_dtypes, payload.dtype))
        else:
            arr = arr.view(np.dtype(payload.dtype))
        arr = arr.reshape(payload.shape)
        out = jax.numpy.asarray(arr)
        impl = payload.meta.get("prng_impl")
        if impl:
            out = jax.random.wrap_key_data(out, impl=impl)
        return out


def _device(value: Any) -> str:
    try:
        return str(next(iter(value.devices())))
    except Exception:  # noqa: BLE001 - tracers and deleted arrays have no device
        return "cpu"
