"""Value helpers: dtype names, payload saving, host copies, structure flattening, input copies.

Containers: tuples (namedtuples included), lists, dicts (Hugging Face `ModelOutput` is an
`OrderedDict`) and dataclass instances are walked; a dataclass field reads like an attribute
(`output.logits`), a dict key like `output['logits']`.
"""

from __future__ import annotations

import copy
import dataclasses
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
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_leaves(getattr(obj, f.name, None), f"{path}.{f.name}", depth + 1)


def copy_tensor(t: torch.Tensor) -> torch.Tensor:
    """A copy the forward may write freely: same values, layout, dtype, device and
    `requires_grad`; a leaf stays a leaf (so in-place rules on leaves hold as on the
    original), a non-leaf keeps its autograd history (gradients still reach the caller's graph)."""
    if t.is_leaf:
        c = t.detach().clone()
        return c.requires_grad_(t.requires_grad) if t.requires_grad else c
    return t.clone()


def copy_inputs(obj: Any, depth: int = 0, memo: dict | None = None) -> Any:
    """`obj` with every tensor leaf replaced by `copy_tensor` of it, containers rebuilt
    (tuples, namedtuples, lists, dicts and dict subclasses such as `ModelOutput`, dataclass
    instances). A tensor passed twice is copied once (aliasing kept). Other objects are
    passed as they are."""
    if memo is None:
        memo = {}
    if isinstance(obj, torch.Tensor):
        c = memo.get(id(obj))
        if c is None:
            c = memo[id(obj)] = copy_tensor(obj)
        return c
    if depth > 16:
        return obj
    if isinstance(obj, tuple):
        items = [copy_inputs(v, depth + 1, memo) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else (tuple(items) if type(obj) is tuple else type(obj)(items))
    if isinstance(obj, list):
        items = [copy_inputs(v, depth + 1, memo) for v in obj]
        return items if type(obj) is list else type(obj)(items)
    if isinstance(obj, dict):
        if type(obj) is dict:
            return {k: copy_inputs(v, depth + 1, memo) for k, v in obj.items()}
        new = copy.copy(obj)
        for k, v in obj.items():
            new[k] = copy_inputs(v, depth + 1, memo)
        return new
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                object.__setattr__(new, f.name, copy_inputs(getattr(obj, f.name), depth + 1, memo))
        return new
    return obj
