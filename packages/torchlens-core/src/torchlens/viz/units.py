"""Human-readable numbers for the views: bytes, FLOPs, durations, shapes."""

from __future__ import annotations

from typing import Any


def fmt_count(n: float | int | None, unit: str = "") -> str:
    """`1234567` -> `"1.23 M"` (decimal prefixes); None -> `"-"`."""
    if n is None:
        return "-"
    sep = " " if unit else ""
    v = float(n)
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {prefix}{unit}"
    if v == int(v):
        return f"{int(v)}{sep}{unit}"
    return f"{v:.3g}{sep}{unit}"


def fmt_bytes(n: float | int | None) -> str:
    """Bytes with decimal prefixes (`15 KB`, `1.2 MB`)."""
    if n is None:
        return "-"
    v = float(n)
    for prefix, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {prefix}"
    return f"{int(v)} B"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if s >= 1e-6:
        return f"{s * 1e6:.3g} us"
    return f"{s * 1e9:.3g} ns"


def fmt_shape(shape: Any) -> str:
    """`(1, 3, 32, 32)` -> `"1x3x32x32"`; a scalar shape `()` -> `"scalar"`; None -> `"-"`."""
    if shape is None:
        return "-"
    shape = tuple(shape)
    if not shape:
        return "scalar"
    return "x".join(str(d) for d in shape)


def fmt_shapes(shapes: Any, limit: int = 3) -> str:
    """Every output slot's shape, comma-separated, at most `limit` of them."""
    shapes = list(shapes or ())
    if not shapes:
        return "-"
    text = ", ".join(fmt_shape(s) for s in shapes[:limit])
    if len(shapes) > limit:
        text += f", +{len(shapes) - limit}"
    return text


#: How each builtin quantity is written: (label, formatter).
QUANTITY_FORMAT = {
    "time": ("time", fmt_seconds),
    "device_time": ("device time", fmt_seconds),
    "bytes": ("output bytes", fmt_bytes),
    "flops": ("FLOPs", lambda v: fmt_count(v, "FLOP")),
    "macs": ("MACs", lambda v: fmt_count(v, "MAC")),
    "params": ("parameters read", lambda v: fmt_count(v)),
    "dims": ("non-batch elements", lambda v: fmt_count(v)),
}


def fmt_quantity(token: str, value: float) -> str:
    """A value of a named quantity with its units (plain number for other sources)."""
    base = token[6:] if token.startswith("total_") else token
    fmt = QUANTITY_FORMAT.get(base)
    if fmt is None:
        return fmt_count(value)
    return fmt[1](value)


def quantity_label(token: str) -> str:
    base = token[6:] if token.startswith("total_") else token
    fmt = QUANTITY_FORMAT.get(base)
    label = fmt[0] if fmt else token
    return f"total {label}" if token.startswith("total_") else label
