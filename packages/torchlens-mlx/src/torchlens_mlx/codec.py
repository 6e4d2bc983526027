"""The payload codec of the MLX backend: `mx.array` payloads are saved through core's numpy
encoding (safetensors on disk) and come back as `mx.array`s, bit for bit. `bfloat16` has no
numpy dtype: its bits are saved as `uint16` (`mx.view`) with `mlx_dtype=bfloat16` in the
payload's meta, and viewed back as `bfloat16` on load."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from torchlens.backends.sdk import NumpyCodec

_VIEW = mx.view  # bound at import: never a wrapped (recorded) call


class MLXCodec:
    name = "mlx"

    def __init__(self) -> None:
        self._numpy = NumpyCodec()

    def can_encode(self, value: Any) -> bool:
        return isinstance(value, mx.array)

    def encode(self, value: Any) -> Any:
        """A transposed view (`w.T`) is saved in its memory order with the axes that restore
        it: ops replayed on a loaded payload see the layout the capture saw, which decides
        the bits of a matmul."""
        mx.eval(value)
        bf16 = value.dtype == mx.bfloat16
        h = np.asarray(_VIEW(value, mx.uint16) if bf16 else value)  # a view keeps the layout
        order = _memory_order(h)
        if order is None:
            enc = self._numpy.encode(np.array(h, copy=True))
        else:
            enc = self._numpy.encode(np.ascontiguousarray(np.transpose(h, order)))
            enc.meta["mlx_axes"] = ",".join(str(int(a)) for a in np.argsort(order))
        if bf16:
            enc.meta["mlx_dtype"] = "bfloat16"
        return enc

    def decode(self, payload: Any) -> Any:
        arr = mx.array(self._numpy.decode(payload))
        axes = payload.meta.get("mlx_axes")
        if axes:
            arr = arr.transpose([int(a) for a in axes.split(",")])
        if payload.meta.get("mlx_dtype") == "bfloat16":
            arr = _VIEW(arr, mx.bfloat16)
        return arr


def _memory_order(h: np.ndarray) -> list[int] | None:
    """The axis order of a dense, permuted (not C-contiguous) layout, else None."""
    if h.ndim < 2 or h.flags.c_contiguous or any(s <= 0 for s in h.strides):
        return None
    order = sorted(range(h.ndim), key=lambda a: -h.strides[a])
    if not np.transpose(h, order).flags.c_contiguous:
        return None
    return order
