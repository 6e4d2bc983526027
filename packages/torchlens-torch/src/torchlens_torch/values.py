"""Value helpers: dtype names, payload saving, host copies, structure flattening."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"` (cached)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).rpartition(".")[2]
    return name


def host_copy(value: Any) -> Any:
    """A detached NumPy copy with shape and dtype kept (bfloat16 and other dtypes NumPy
    lacks go through float32); a 0-d tensor stays 0-d."""
    if not isinstance(value, torch.Tensor):
        return np.array(value, copy=True)
    t = value.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.cpu()
    try:
        return t.numpy().copy()
    except (TypeError, RuntimeError):
        return t.to(torch.float32).numpy().copy()


def iter_leaves(obj: Any, path: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor leaf of a nested tuple/list/dict (HF ModelOutput
    included) in order; paths read like `x`, `x[0]`, `x['mask']`."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if depth > 16:
        return
    if isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from iter_leaves(item, f"{path}[{i}]", depth + 1)
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from iter_leaves(item, f"{path}[{key!r}]", depth + 1)
