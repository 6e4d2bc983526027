"""The torch payload codec: torch tensors <-> core's neutral `EncodedPayload`, bit-exact.

Every dtype travels as its raw bytes in a numpy array of the same item size (bfloat16 and
the float8 types as integers, complex as complex), tagged with the neutral dtype name; the
device, the Parameter subclass and requires_grad are recorded as metadata. Loaded tensors
are on the CPU (the saved device is in `meta["device"]`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torchlens.io.codec import EncodedPayload

# torch dtype -> (neutral tag, numpy dtype carrying the bytes)
_TO_TAG: dict[torch.dtype, tuple[str, str]] = {
    torch.bool: ("bool", "bool"), torch.uint8: ("uint8", "uint8"), torch.int8: ("int8", "int8"),
    torch.int16: ("int16", "int16"), torch.int32: ("int32", "int32"), torch.int64: ("int64", "int64"),
    torch.float16: ("float16", "float16"), torch.bfloat16: ("bfloat16", "int16"), torch.float32: ("float32", "float32"),
    torch.float64: ("float64", "float64"), torch.complex64: ("complex64", "complex64"),
    torch.complex128: ("complex128", "complex128"),
}
for _name, _tag, _np in (("uint16", "uint16", "uint16"), ("uint32", "uint32", "uint32"), ("uint64", "uint64", "uint64"),
                         ("float8_e4m3fn", "float8_e4m3fn", "uint8"), ("float8_e5m2", "float8_e5m2", "uint8")):
    if hasattr(torch, _name):
        _TO_TAG[getattr(torch, _name)] = (_tag, _np)
_FROM_TAG = {tag: dt for dt, (tag, _) in _TO_TAG.items()}
# numpy dtypes torch.from_numpy reads; the rest travel through a same-size signed view
_VIEW_FOR = {"uint16": (np.int16, "int16"), "uint32": (np.int32, "int32"), "uint64": (np.int64, "int64"),
             "bfloat16": (np.int16, "int16"), "float8_e4m3fn": (np.uint8, "uint8"), "float8_e5m2": (np.uint8, "uint8")}


class TorchCodec:
    """`PayloadCodec` for torch tensors (dense, strided; any device)."""

    name = "torch"

    def can_encode(self, value: Any) -> bool:
        return (isinstance(value, torch.Tensor) and value.layout == torch.strided and value.dtype in _TO_TAG
                and not value.is_quantized and value.device.type != "meta")

    def encode(self, value: Any) -> EncodedPayload:
        tag, np_dtype = _TO_TAG[value.dtype]
        t = value.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        t = t.cpu()  # strided is fine: the blob writer copies to C order in chunks, off the main thread
        meta = {"device": str(value.device)}
        if t.dim() > 1 and not t.is_contiguous():
            # a dense permuted layout (a transpose) is stored in its memory order and permuted
            # back on load, so the loaded tensor has the same strides: kernels such as matmul
            # take other paths (and round differently) for other layouts
            perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))
            p = t.permute(perm)
            if p.is_contiguous():
                t = p
                meta["perm"] = ",".join(str(d) for d in perm)
        if tag in _VIEW_FOR:
            arr = t.view(getattr(torch, _VIEW_FOR[tag][1])).numpy().view(np_dtype if tag not in ("bfloat16",) else np.uint16)
        else:
            arr = t.numpy()
        if isinstance(value, torch.nn.Parameter):
            meta["parameter"] = "1"
        if value.requires_grad:
            meta["requires_grad"] = "1"
        return EncodedPayload(arr, tag, tuple(int(d) for d in t.shape), meta)

    def encode_literal(self, value: Any) -> tuple[str, Any] | None:
        """torch literals that appear in argument templates, as (kind, plain value)."""
        if isinstance(value, torch.Size):
            return "torch.Size", tuple(int(d) for d in value)
        if isinstance(value, torch.dtype):
            return "torch.dtype", str(value).rpartition(".")[2]
        if isinstance(value, torch.device):
            return "torch.device", str(value)
        if isinstance(value, torch.layout):
            return "torch.layout", str(value).rpartition(".")[2]
        if isinstance(value, torch.memory_format):
            return "torch.memory_format", str(value).rpartition(".")[2]
        return None

    def decode_literal(self, kind: str, plain: Any) -> Any:
        if kind == "torch.Size" and isinstance(plain, tuple) and all(type(d) is int for d in plain):
            return torch.Size(plain)
        if kind == "torch.device" and isinstance(plain, str):
            return torch.device(plain)
        if kind in ("torch.dtype", "torch.layout", "torch.memory_format") and isinstance(plain, str) and plain.isidentifier():
            value = getattr(torch, plain, None)
            expected = {"torch.dtype": torch.dtype, "torch.layout": torch.layout, "torch.memory_format": torch.memory_format}[kind]
            return value if isinstance(value, expected) else None
        return None

    def decode(self, payload: EncodedPayload) -> Any:
        dtype = _FROM_TAG[payload.dtype]
        arr = payload.array
        if arr.size and arr.ctypes.data % 64:
            # a view into the blob at an unaligned offset: CPU kernels choose other code paths
            # (and round differently) for unaligned data, and some refuse it outright, so the
            # payload gets its own storage (numpy copies unaligned data safely; torch then
            # re-allocates it on its 64-byte boundary)
            arr = np.array(arr, copy=True)
        if payload.dtype in _VIEW_FOR:
            np_view, torch_view = _VIEW_FOR[payload.dtype]
            t = torch.from_numpy(np.asarray(arr).view(np_view)).view(dtype)
        else:
            t = torch.from_numpy(np.asarray(arr))
        t = t.reshape(payload.shape)
        if t.numel() and t.data_ptr() % 64:
            t = t.clone()
        perm = payload.meta.get("perm")
        if perm:
            order = [int(d) for d in perm.split(",")]
            if sorted(order) != list(range(t.dim())):
                raise ValueError(f"bad permutation {perm!r} for a {t.dim()}-d payload")
            t = t.permute([order.index(d) for d in range(t.dim())])
        if payload.meta.get("parameter") == "1":
            return torch.nn.Parameter(t, requires_grad=payload.meta.get("requires_grad") == "1")
        if payload.meta.get("requires_grad") == "1" and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t
