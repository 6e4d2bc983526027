"""The payload codec of the paddle backend: `paddle.Tensor` payloads are saved through core's
numpy encoding (safetensors on disk) and come back as `paddle.Tensor`s, bit for bit.
`bfloat16` has no numpy dtype: its bits are saved as `uint16` with `paddle_dtype=bfloat16` in
the payload's meta, and viewed back as `bfloat16` on load."""

from __future__ import annotations

from typing import Any

import numpy as np

from torchlens.backends.sdk import NumpyCodec
from torchlens_paddle.patch import TENSOR, paddle


class PaddleCodec:
    name = "paddle"

    def __init__(self) -> None:
        self._numpy = NumpyCodec()

    def can_encode(self, value: Any) -> bool:
        return isinstance(value, TENSOR)

    def encode(self, value: Any) -> Any:
        bf16 = value.dtype == paddle.bfloat16
        host = value.numpy()  # a bfloat16 tensor's numpy() holds its bits as uint16
        enc = self._numpy.encode(np.array(host, copy=True))
        if bf16:
            enc.meta["paddle_dtype"] = "bfloat16"
        return enc

    def encode_literal(self, value: Any) -> tuple[str, Any] | None:
        """Kernel arguments that are framework objects: a dtype (`paddle.float32`) and a
        place (`Place(cpu)`), saved as their names."""
        if isinstance(value, paddle.dtype):
            return ("paddle_dtype", str(value).replace("paddle.", ""))
        if isinstance(value, paddle.CPUPlace):
            return ("paddle_place", "cpu")
        if isinstance(value, paddle.CUDAPlace):
            return ("paddle_place", f"gpu:{value.get_device_id()}")
        if type(value).__name__ == "Place":
            return ("paddle_place", _place_text(value))
        return None

    def decode_literal(self, kind: str, plain: Any) -> Any:
        if kind == "paddle_dtype":
            found = getattr(paddle, str(plain), None)
            if not isinstance(found, paddle.dtype):
                raise ValueError(f"{plain!r} is no paddle dtype")
            return found
        if kind == "paddle_place":
            if plain == "cpu":
                return paddle.CPUPlace()
            if isinstance(plain, str) and plain.startswith("gpu:") and plain[4:].isdigit():
                return paddle.CUDAPlace(int(plain[4:]))
            raise ValueError(f"{plain!r} is no paddle place")
        raise ValueError(f"{kind!r} is no paddle literal")

    def callable_name(self, fn: Any) -> str | None:
        """Recorded kernels and tensor operators are saved by the name the backend's closed
        callable table resolves on load."""
        from torchlens_paddle.patch import callable_name

        return callable_name(fn)

    def decode(self, payload: Any) -> Any:
        host = np.array(self._numpy.decode(payload), copy=True, order="C")  # (ascontiguousarray makes 0-d 1-d)
        if payload.meta.get("paddle_dtype") == "bfloat16":
            out = paddle.to_tensor(host.view(np.uint16)).view(paddle.bfloat16)
        else:
            out = paddle.to_tensor(host)
        if tuple(out.shape) != host.shape:
            out = out.reshape(list(host.shape))
        return out


def _place_text(place: Any) -> str:
    if place.is_cpu_place():
        return "cpu"
    if place.is_gpu_place():
        return f"gpu:{place.gpu_device_id()}"
    return str(place)
