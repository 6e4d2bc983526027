"""Packed quantized linear weights (`quantize_dynamic`'s int8 Linear) as a codec payload.

A dynamically quantized `nn.Linear` calls `torch.ops.quantized.linear_dynamic(x, packed, ...)`
where `packed` is a torch ScriptObject (`LinearPackedParamsBase`): an opaque C++ object with
no tensor layout. Without an encoding a saved trace holds it as text and a loaded trace
cannot replay the call (issue 12: int8 dynamic quantization, save/load then validate).

What is written is the object's content, never the object: `linear_unpack` gives the qint8
weight (its integer values, scale(s) and zero point(s)) and the float32 bias; they travel as
one byte payload (tag `uint8`, 1-d) with text metadata. A load checks the metadata strictly
(exact keys, bounded integers, finite positive scales, zero points in the int8 range, the
exact byte count) before it allocates anything, then rebuilds the weight and calls
`linear_prepack`, the backend's own op. Anything else refuses `payload_meta_invalid`.

Only qint8 weights with a per-tensor or per-channel (axis 0) affine scheme are encoded;
other packed objects (fp16, conv) stay unencodable (saved as text, refused on replay).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from torchlens.backends.sdk import ArtifactError

KIND = "quantized.linear"
_TYPE = "LinearPackedParamsBase"
#: the largest weight (elements) a file may ask for: a bound on what a load allocates
MAX_WEIGHT = 1 << 31
_BASE = {"packed", "weight"}
_KEYS = {"per_tensor_affine": _BASE | {"qscheme", "scale", "zero_point"},
         "per_channel_affine": _BASE | {"qscheme", "axis"}}


def is_packed_linear(value: Any) -> bool:
    """A `LinearPackedParamsBase` holding a qint8 weight of an encodable scheme."""
    if not isinstance(value, torch.ScriptObject):
        return False
    try:
        if not value._type().qualified_name().endswith(_TYPE):
            return False
        w, _ = torch.ops.quantized.linear_unpack(value)
    except (RuntimeError, AttributeError, TypeError):
        return False
    return w.dtype == torch.qint8 and w.dim() == 2 and w.qscheme() in (torch.per_tensor_affine,
                                                                      torch.per_channel_affine) \
        and (w.qscheme() == torch.per_tensor_affine or w.q_per_channel_axis() == 0)


def encode_packed(value: Any) -> tuple[np.ndarray, tuple[int, ...], dict[str, str]]:
    """`(bytes, shape, meta)`: weight int8 values, then (per channel) float64 scales and
    int64 zero points, then (when there is a bias) float32 bias, all little-endian C order."""
    w, bias = torch.ops.quantized.linear_unpack(value)
    out_f, in_f = (int(d) for d in w.shape)
    parts = [w.int_repr().contiguous().numpy().astype("<i1").tobytes()]
    meta = {"packed": KIND, "weight": f"{out_f},{in_f}"}
    if w.qscheme() == torch.per_tensor_affine:
        meta.update(qscheme="per_tensor_affine", scale=repr(float(w.q_scale())), zero_point=str(int(w.q_zero_point())))
    else:
        meta.update(qscheme="per_channel_affine", axis="0")
        parts.append(w.q_per_channel_scales().double().numpy().astype("<f8").tobytes())
        parts.append(w.q_per_channel_zero_points().long().numpy().astype("<i8").tobytes())
    if bias is not None:
        meta["bias"] = "1"
        parts.append(bias.detach().float().contiguous().cpu().numpy().astype("<f4").tobytes())
    arr = np.frombuffer(b"".join(parts), dtype=np.uint8).copy()
    return arr, (int(arr.size),), meta


def _bad(why: str, meta: Any) -> ArtifactError:
    return ArtifactError("payload_meta_invalid", f"packed quantized linear payload {why}",
                         remedy="the artifact was modified or damaged; save it again", meta=repr(meta)[:200])


def _int(text: str, lo: int, hi: int, what: str, meta: dict) -> int:
    body = text[1:] if text.startswith("-") else text
    if not (body.isascii() and body.isdigit() and len(body) <= 12) or not lo <= int(text) <= hi:
        raise _bad(f"{what} {text[:20]!r} is not an integer in [{lo}, {hi}]", meta)
    return int(text)


def _scale(text: str, meta: dict) -> float:
    try:
        s = float(text) if len(text) <= 40 else math.nan
    except ValueError:
        s = math.nan
    if not (math.isfinite(s) and s > 0):
        raise _bad(f"scale {text[:40]!r} is not a finite positive number", meta)
    return s


def decode_packed(dtype_tag: str, shape: tuple, arr: np.ndarray, meta: dict) -> Any:
    """The packed object a payload holds, after every check; else `payload_meta_invalid`."""
    if not isinstance(meta, dict) or not all(type(v) is str for v in meta.values()) or meta.get("packed") != KIND:
        raise _bad("is not a packed quantized linear", meta)
    scheme = meta.get("qscheme")
    if scheme not in _KEYS or set(meta) not in (_KEYS[scheme], _KEYS[scheme] | {"bias"}):
        raise _bad(f"has keys {sorted(meta)[:12]}, not those of a {str(scheme)[:30]!r} weight", meta)
    if meta.get("bias", "1") != "1" or dtype_tag != "uint8" or len(shape) != 1:
        raise _bad("is not a 1-d uint8 byte payload with flag bias '1'", meta)
    dims = meta["weight"].split(",")
    if len(dims) != 2:
        raise _bad(f"weight shape {meta['weight'][:40]!r} is not 'out,in'", meta)
    out_f, in_f = (_int(d, 1, MAX_WEIGHT, "weight dimension", meta) for d in dims)
    if out_f * in_f > MAX_WEIGHT:
        raise _bad(f"weight {out_f}x{in_f} is beyond {MAX_WEIGHT} elements", meta)
    per_channel = scheme == "per_channel_affine"
    if per_channel and meta["axis"] != "0":
        raise _bad(f"axis {meta['axis'][:10]!r} is not '0'", meta)
    want = out_f * in_f + (16 * out_f if per_channel else 0) + (4 * out_f if "bias" in meta else 0)
    if int(shape[0]) != want or arr.size != want:
        raise _bad(f"holds {int(shape[0])} bytes; a {out_f}x{in_f} weight of this scheme needs {want}", meta)
    raw = np.ascontiguousarray(arr).view(np.uint8).tobytes()
    pos = out_f * in_f
    ints = torch.from_numpy(np.frombuffer(raw[:pos], dtype="<i1").astype(np.int8).reshape(out_f, in_f).copy())
    if per_channel:
        scales = np.frombuffer(raw[pos:pos + 8 * out_f], dtype="<f8").astype(np.float64)
        zps = np.frombuffer(raw[pos + 8 * out_f:pos + 16 * out_f], dtype="<i8").astype(np.int64)
        pos += 16 * out_f
        if not (np.isfinite(scales).all() and (scales > 0).all()) or not ((zps >= -128) & (zps <= 127)).all():
            raise _bad("has a per-channel scale that is not finite positive or a zero point outside int8", meta)
        weight = torch._make_per_channel_quantized_tensor(ints, torch.from_numpy(scales.copy()),
                                                          torch.from_numpy(zps.copy()), 0)
    else:
        weight = torch._make_per_tensor_quantized_tensor(ints, _scale(meta["scale"], meta),
                                                         _int(meta["zero_point"], -128, 127, "zero point", meta))
    bias = None
    if "bias" in meta:
        bias = torch.from_numpy(np.frombuffer(raw[pos:pos + 4 * out_f], dtype="<f4").astype(np.float32).copy())
    return torch.ops.quantized.linear_prepack(weight, bias)


__all__ = ["KIND", "MAX_WEIGHT", "is_packed_linear", "encode_packed", "decode_packed"]
