"""The payload codec of the TensorFlow backend: `tf.Tensor` payloads are saved through core's
numpy encoding (safetensors on disk) and come back as `tf.Tensor`s, bit for bit. `bfloat16`
has no numpy dtype of its own here: its bits are saved as `uint16` (`tf.bitcast`) with
`tf_dtype=bfloat16` in the payload's meta and bit-cast back on load. Op callables are saved
under their op type (`raw_op.MatMul`), which `TFBackend.resolve_callable` maps back through
TensorFlow's op registry only."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from torchlens.backends.sdk import NumpyCodec
from torchlens_tf.ops import RawOp


class TFCodec:
    name = "tf"

    def __init__(self) -> None:
        self._numpy = NumpyCodec()

    def can_encode(self, value: Any) -> bool:
        return isinstance(value, tf.Tensor)

    def encode(self, value: Any) -> Any:
        if value.dtype == tf.bfloat16:
            enc = self._numpy.encode(np.array(tf.bitcast(value, tf.uint16), copy=True))
            enc.meta["tf_dtype"] = "bfloat16"
            return enc
        return self._numpy.encode(np.array(value, copy=True))

    def decode(self, payload: Any) -> Any:
        arr = tf.constant(self._numpy.decode(payload))
        if payload.meta.get("tf_dtype") == "bfloat16":
            arr = tf.bitcast(arr, tf.bfloat16)
        return arr

    def callable_name(self, fn: Any) -> str | None:
        return fn.__qualname__ if isinstance(fn, RawOp) else None
