"""The `custom_attributes` snapshot of each captured module (facets spec: "snapshotted into
module.custom_attributes"): its own atomic attributes and, where it holds a `config` (Hugging
Face), that config's scalars, kept in `trace.annotations["module_custom_attributes"]` (saved
with the trace) so recipes read head counts and dims from the record, never the live module."""

from __future__ import annotations

from typing import Any

_ATOMIC = (bool, int, float, str)


_EXACT = frozenset((bool, int, float, str, type(None)))
_EXACT_ITEMS = frozenset((bool, int, float, str))  # (None is atomic alone, not in a tuple)


def _atomic(value: Any) -> bool:
    t = type(value)
    if t in _EXACT:
        return True
    if t is tuple:
        return len(value) <= 8 and (_EXACT_ITEMS.issuperset(map(type, value)) or all(isinstance(v, _ATOMIC) for v in value))
    if isinstance(value, _ATOMIC):
        return True
    return type(value) is tuple and len(value) <= 8 and all(isinstance(v, _ATOMIC) for v in value)


def _plain(value: Any) -> Any:
    """Subclasses (IntEnum, numpy-free str subclasses) as their plain base value."""
    t = type(value)
    if t in _EXACT:
        return value
    if t is tuple and _EXACT_ITEMS.issuperset(map(type, value)):
        return value
    if isinstance(value, bool) or value is None:
        return value
    for base in (int, float, str):
        if isinstance(value, base):
            return base(value)
    return tuple(_plain(v) for v in value)


def config_scalars(config: Any) -> dict[str, Any]:
    """Scalar fields of a config object, with its `attribute_map` aliases resolved
    (GPT-2's `num_attention_heads` -> `n_head`)."""
    out: dict[str, Any] = {}
    for k, v in vars(config).items():
        if not k.startswith("_") and _atomic(v):
            out[k] = _plain(v)
    amap = getattr(type(config), "attribute_map", None) or getattr(config, "attribute_map", None)
    if isinstance(amap, dict):
        for alias, target in amap.items():
            if isinstance(alias, str) and target in out and alias not in out:
                out[alias] = out[target]
    return out


def snapshot(trace: Any, modules: Any) -> None:
    """Record the attributes of each (address, live module) pair that has a Module record."""
    records = trace._modules
    configs: dict[int, dict[str, Any]] = {}
    out: dict[str, dict[str, Any]] = {}
    for address, module in modules:
        if address not in records:
            continue
        attrs: dict[str, Any] = {}
        config = None
        for k, v in vars(module).items():
            if k.startswith("_"):
                continue
            if k == "config" and not _atomic(v) and hasattr(v, "__dict__"):
                config = v
            elif _atomic(v):
                attrs[k] = _plain(v)
        if config is not None:
            scalars = configs.get(id(config))
            if scalars is None:
                scalars = configs[id(config)] = config_scalars(config)
            for k, v in scalars.items():
                attrs.setdefault(k, v)  # the module's own attribute wins over its config's
                attrs[f"config.{k}"] = v
        if attrs:
            out[address] = attrs
    if out:
        trace.annotations["module_custom_attributes"] = out


__all__ = ["snapshot", "config_scalars"]
