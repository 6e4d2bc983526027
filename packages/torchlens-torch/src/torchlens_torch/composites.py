"""Composite expansion (ARCHITECTURE §7).

A `TorchFunctionMode` handler runs with the mode popped, so a Python composite such as
`F.multi_head_attention_forward` would be one opaque op. For the callables registered
here the handler instead runs a clone of the function whose `has_torch_function*`
prologue is bypassed, with the mode re-entered, so its inner `linear`, `view`, `softmax`,
`bmm`, ... calls are recorded as the leaves they are. The clone shares the original's code
object, defaults and closure; only the prologue's globals differ, so the outputs are
bit-identical to the original.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch.nn.functional as F

#: Qualified names of the composites expanded into their torch-level leaves.
COMPOSITE_NAMES: tuple[str, ...] = (
    "torch.nn.functional.multi_head_attention_forward",
    "torch.nn.functional.normalize",
    "torch.nn.functional.interpolate",
    "torch.nn.functional.local_response_norm",
)


def _false(*args: Any, **kwargs: Any) -> bool:
    return False


def _bypass_clone(fn: Callable[..., Any]) -> Callable[..., Any]:
    g = dict(fn.__globals__)
    for name in ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"):
        if name in g:
            g[name] = _false
    clone = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = fn.__kwdefaults__
    clone.__qualname__ = fn.__qualname__
    return clone


def composite_table() -> dict[Any, tuple[str, Callable[..., Any]]]:
    """original function -> (short name, prologue-bypassing clone)."""
    table: dict[Any, tuple[str, Callable[..., Any]]] = {}
    for qual in COMPOSITE_NAMES:
        fn = getattr(F, qual.rpartition(".")[2], None)
        if isinstance(fn, types.FunctionType):
            table[fn] = (fn.__name__, _bypass_clone(fn))
    return table
