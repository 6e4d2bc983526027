"""Model-input paths: one convention for every backend (issue 14 §3).

An input op's `path` names where its value sat in the call, so `tl.model_input(path=...)`
selects the same input of the same model on any backend:

- the i-th positional argument is `args[i]`, a keyword argument `kwargs['name']`;
- inside a nested value, a sequence item appends `[i]`, a mapping entry `['key']` and a
  dataclass (or other attribute container) field `.name`.

The paths depend only on the call's shape, never on a framework or on the forward's
parameter names (torch's `nn.Sequential.forward(input)` and a JAX `__call__(self, x)`
called the same way get the same paths). Outputs follow the same rule under the root
`output`.
"""

from __future__ import annotations

from typing import Any


def positional_path(index: int) -> str:
    """The path of the `index`-th positional argument."""
    return f"args[{int(index)}]"


def keyword_path(name: str) -> str:
    """The path of keyword argument `name`."""
    return f"kwargs[{str(name)!r}]"


def input_paths(args: tuple, kwargs: dict) -> tuple[list[str], dict[str, str]]:
    """The root path of each positional argument and of each keyword argument."""
    return [positional_path(i) for i in range(len(args))], {k: keyword_path(k) for k in kwargs}


def item_path(path: str, key: Any) -> str:
    """`path` extended by a sequence index or a mapping key."""
    return f"{path}[{key!r}]" if isinstance(key, str) else f"{path}[{key}]"


def field_path(path: str, name: str) -> str:
    """`path` extended by an attribute (dataclass field) name."""
    return f"{path}.{name}"


__all__ = ["positional_path", "keyword_path", "input_paths", "item_path", "field_path"]
