"""The payload codec of the tinygrad backend: `Tensor` payloads are saved through core's numpy
encoding (safetensors on disk) and come back as realized `Tensor`s of the same dtype, bit for
bit. A dtype numpy cannot hold (`bfloat16`, the fp8 types) is refused by `can_encode`, so the
save names it instead of writing wrong bits.

A payload that is a view of a realized buffer (`w.transpose()` in `nn.Linear`: a realized
movement op copies nothing) is saved as its buffer plus the movement ops on top of it
(`tinygrad_view` in the payload's meta), and loads as the same view: ops replayed on a
loaded payload then read the layout the capture read, which decides the bits of a kernel
(a contiguous copy of a transposed weight gives a `linear` with other rounding)."""

from __future__ import annotations

import json
from typing import Any

from tinygrad import Tensor, dtypes

from torchlens.backends.sdk import NumpyCodec
from torchlens_tinygrad.backend import host, realize

_MOVES = ("RESHAPE", "PERMUTE", "EXPAND", "SHRINK", "FLIP", "PAD")


def _view_chain(t: Any) -> tuple[Any, list] | None:
    """(base tensor, [(movement op, argument), ...] from the base up) when `t` is a chain of
    movement ops over a buffer, else None."""
    u = t.uop
    chain = []
    for _ in range(32):
        if u.has_buffer_identity():
            break
        name = getattr(u.op, "name", str(u.op))
        if name not in _MOVES or not u.src:
            return None
        arg = u.marg
        try:
            json.dumps(arg)
        except TypeError:
            return None
        chain.append((name, arg))
        u = u.src[0]
    else:
        return None
    if not chain:
        return None
    return Tensor(u), chain[::-1]


def _apply(t: Any, name: str, arg: Any) -> Any:
    if name == "RESHAPE":
        return t.reshape(tuple(arg))
    if name == "PERMUTE":
        return t.permute(tuple(arg))
    if name == "EXPAND":
        return t.expand(tuple(arg))
    if name == "SHRINK":
        return t.shrink(tuple(tuple(a) for a in arg))
    if name == "FLIP":
        return t.flip(tuple(i for i, f in enumerate(arg) if f) if arg and isinstance(arg[0], bool) else tuple(arg))
    return t.pad(tuple(tuple(a) for a in arg))


class TinygradCodec:
    name = "tinygrad"

    def __init__(self) -> None:
        self._numpy = NumpyCodec()

    def can_encode(self, value: Any) -> bool:
        return isinstance(value, Tensor) and value.dtype not in (dtypes.bfloat16,) and "fp8" not in str(value.dtype)

    def encode(self, value: Any) -> Any:
        view = _view_chain(value)
        if view is not None:
            base, chain = view
            try:
                rebuilt = self._rebuild(base, chain)
                same = tuple(rebuilt.shape) == tuple(value.shape) and (host(rebuilt) == host(value)).all()
            except Exception:  # a movement argument this codec cannot re-apply: save the values
                same = False
            if same:
                enc = self._numpy.encode(host(base))
                enc.meta["tinygrad_view"] = json.dumps(chain)
                return enc
        return self._numpy.encode(host(value))

    @staticmethod
    def _rebuild(base: Any, chain: list) -> Any:
        t = base
        for name, arg in chain:
            t = _apply(t, name, arg)
        return t

    def decode(self, payload: Any) -> Any:
        t = Tensor(self._numpy.decode(payload))
        realize(t)
        chain = payload.meta.get("tinygrad_view")
        if chain:
            t = self._rebuild(t, json.loads(chain))
            realize(t)
        return t
