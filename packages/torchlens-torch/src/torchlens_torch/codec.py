"""The torch payload codec: torch tensors <-> core's neutral `EncodedPayload`, bit-exact.

Every dtype travels as its raw bytes in a numpy array of the same item size (bfloat16 and
the float8 types as integers, complex as complex), tagged with the neutral dtype name; the
device, the Parameter subclass and requires_grad are recorded as metadata. Loaded tensors
are on the CPU (the saved device is in `meta["device"]`).

Layout is kept, because kernels take other paths (and round differently) for other strides:
a dense permuted tensor (a transpose) is stored in its memory order with `meta["perm"]`;
any other non-contiguous, non-overlapping view (a slice, a chunk, `.real` of a complex
tensor) is stored compactly with `meta["strides"]` and `meta["offset"]` and loads back as a
view with those strides and that storage offset into a fresh buffer (gaps zero). The buffer
is bounded (`STRIDED_SLACK`): a view that would need more is stored contiguous, and a file
asking for more refuses `payload_meta_invalid`. An offset beyond the bound is reduced to its
alignment class (the offset modulo 64 bytes), which is what kernels can observe.

A packed quantized linear weight (the ScriptObject `quantize_dynamic` passes to
`quantized::linear_dynamic`) is encoded by its content in `codec_packed` (meta `packed`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torchlens.backends.sdk import ArtifactError, EncodedPayload
from torchlens_torch import codec_packed

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
        if isinstance(value, torch.ScriptObject):
            return codec_packed.is_packed_linear(value)
        return (isinstance(value, torch.Tensor) and value.layout == torch.strided and value.dtype in _TO_TAG
                and not value.is_quantized and value.device.type != "meta")

    def encode(self, value: Any) -> EncodedPayload:
        if isinstance(value, torch.ScriptObject):
            arr, shape, meta = codec_packed.encode_packed(value)
            return EncodedPayload(arr, "uint8", shape, meta)
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
        if not t.is_contiguous() and "perm" not in meta:
            layout = strided_layout(t)
            if layout is not None:
                meta["strides"], meta["offset"] = layout
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

    def callable_name(self, fn: Any) -> str | None:
        """The name a save writes for a recorded callable: its entry in the closed callable
        table (`callables.py`), the only names a load re-binds; None when it has none."""
        from torchlens_torch.callables import callable_name

        return callable_name(fn)

    def decode_literal(self, kind: str, plain: Any) -> Any:
        """The literal, or None when `plain` is not one (the loader refuses it, typed)."""
        if kind == "torch.Size" and isinstance(plain, tuple) and all(type(d) is int and -(2**63) <= d < 2**63 for d in plain):
            return torch.Size(plain)
        if kind == "torch.device" and isinstance(plain, str):
            return _device_or_none(plain)
        if kind in ("torch.dtype", "torch.layout", "torch.memory_format") and isinstance(plain, str) and plain.isidentifier():
            value = getattr(torch, plain, None)
            expected = {"torch.dtype": torch.dtype, "torch.layout": torch.layout, "torch.memory_format": torch.memory_format}[kind]
            return value if isinstance(value, expected) else None
        return None

    def decode(self, payload: EncodedPayload) -> Any:
        """The tensor `payload` holds. Its metadata is checked first (known keys, a valid
        permutation, flags "1", a parsable device); anything else refuses `payload_meta_invalid`."""
        if isinstance(payload.meta, dict) and "packed" in payload.meta:
            return codec_packed.decode_packed(payload.dtype, tuple(payload.shape), payload.array, payload.meta)
        dtype = _FROM_TAG.get(payload.dtype)
        if dtype is None:
            raise ArtifactError("payload_codec_unavailable", f"this torch has no dtype {payload.dtype!r}",
                                remedy="load with the torch version that saved it", dtype=payload.dtype)
        order = _check_meta(payload.meta, len(payload.shape), dtype)
        layout = _check_layout(payload.meta, tuple(payload.shape))
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
        if order is not None:
            t = t.permute([order.index(d) for d in range(t.dim())])
        if layout is not None:
            strides, offset, size = layout
            view = torch.zeros(size, dtype=dtype).as_strided(t.shape, strides, offset)
            view.copy_(t)
            t = view
        if payload.meta.get("parameter") == "1":
            return torch.nn.Parameter(t, requires_grad=payload.meta.get("requires_grad") == "1")
        if payload.meta.get("requires_grad") == "1" and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t


_META_KEYS = {"device", "perm", "parameter", "requires_grad", "strides", "offset"}

#: a strided view's buffer may hold at most this many times its elements (plus 64 bytes'
#: worth): the bound on what a load allocates for it.
STRIDED_SLACK = 8


def _extent(shape: tuple, strides: tuple) -> int:
    """Elements from a view's first to its last, plus one (its storage span past the offset)."""
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(n > 0 for n in shape) else 0


def _non_overlapping(shape: tuple, strides: tuple) -> bool:
    """No two indices of the view address the same element (each stride, in increasing
    order, steps past everything the smaller ones reach)."""
    reach = 0
    for n, s in sorted(((n, s) for n, s in zip(shape, strides) if n > 1), key=lambda p: p[1]):
        if s <= reach:
            return False
        reach += (n - 1) * s
    return True


def _budget(numel: int, itemsize: int) -> int:
    return STRIDED_SLACK * numel + max(1, 64 // itemsize)


def strided_layout(t: torch.Tensor) -> tuple[str, str] | None:
    """`(strides, offset)` metadata keeping a non-contiguous view's layout, or None when it
    overlaps itself, is empty, or would need a buffer beyond the bound (stored contiguous)."""
    shape, strides = tuple(t.shape), tuple(t.stride())
    if t.numel() == 0 or not t.dim() or any(s < 0 for s in strides) or not _non_overlapping(shape, strides):
        return None
    extent, budget = _extent(shape, strides), _budget(t.numel(), t.element_size())
    if extent > budget:
        return None
    offset = t.storage_offset()
    if offset + extent > budget:  # keep the alignment class only
        offset %= max(1, 64 // t.element_size())
    return ",".join(str(s) for s in strides), str(offset)


def _bad_meta(why: str, meta: dict) -> ArtifactError:
    return ArtifactError("payload_meta_invalid", f"torch payload metadata {why}",
                         remedy="the artifact was modified or damaged; save it again", meta=repr(meta)[:200])


def _check_meta(meta: dict, ndim: int, dtype: torch.dtype) -> list[int] | None:
    """Check a payload's metadata against what `encode` writes; return the permutation."""
    if not isinstance(meta, dict) or not set(meta) <= _META_KEYS or not all(type(v) is str for v in meta.values()):
        raise _bad_meta(f"has keys other than {sorted(_META_KEYS)} or non-text values", meta)
    for flag in ("parameter", "requires_grad"):
        if meta.get(flag, "1") != "1":
            raise _bad_meta(f"flag {flag} is not '1'", meta)
    if "requires_grad" in meta and not (dtype.is_floating_point or dtype.is_complex):
        raise _bad_meta(f"asks for gradients on a {dtype} tensor", meta)
    if "device" in meta and _device_or_none(meta["device"]) is None:
        raise _bad_meta(f"names device {meta['device'][:40]!r}, which is not a torch device", meta)
    perm = meta.get("perm")
    if perm is None:
        return None
    parts = perm.split(",")
    order = [int(d) for d in parts if d.isascii() and d.isdigit() and len(d) <= 4]
    if len(order) != len(parts) or sorted(order) != list(range(ndim)) or ndim < 2:
        raise _bad_meta(f"permutation {perm[:40]!r} is not a permutation of a {ndim}-d payload's axes", meta)
    return order


def _check_layout(meta: dict, shape: tuple) -> tuple[tuple[int, ...], int, int] | None:
    """Check `strides`/`offset` metadata against the payload's shape: integers, one stride
    per axis, non-overlapping, and a buffer within the bound. Returns (strides, offset,
    buffer elements) or None when the payload has no saved layout."""
    if "strides" not in meta and "offset" not in meta:
        return None
    if "perm" in meta or "strides" not in meta or "offset" not in meta:
        raise _bad_meta("has a partial or doubled layout (strides with offset, without perm)", meta)
    parts, off = meta["strides"].split(","), meta["offset"]
    nums = [p for p in parts + [off] if p.isascii() and p.isdigit() and len(p) <= 18]
    if len(nums) != len(parts) + 1 or len(parts) != len(shape) or not shape:
        raise _bad_meta(f"strides {meta['strides'][:40]!r} / offset {off[:20]!r} are not one integer per axis", meta)
    strides, offset = tuple(int(p) for p in parts), int(off)
    numel = 1
    for n in shape:
        numel *= int(n)
    extent = _extent(shape, strides)
    if numel == 0 or not _non_overlapping(shape, strides) or offset + extent > _budget(numel, 1):
        raise _bad_meta(f"strides {strides} with offset {offset} overlap or need a buffer beyond "
                        f"{STRIDED_SLACK}x the payload's {numel} elements", meta)
    return strides, offset, offset + extent


def _device_or_none(text: str) -> Any:
    try:
        return torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        return None
