"""The `custom_attributes` snapshot of each captured module (facets spec: "snapshotted into
module.custom_attributes"): its own atomic attributes and, where it holds a `config` (Hugging
Face), that config's scalars, kept in `trace.annotations["module_custom_attributes"]` (saved
with the trace) so recipes read head counts and dims from the record, never the live module."""

from __future__ import annotations

import operator
from itertools import chain
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


#: id(module) -> (attribute names, their values, the attributes recorded from them), for modules
#: whose attributes are all plain values: the record is a function of those names and (immutable)
#: values, so a module holding the same objects under the same names gets it again without the walk
_MEMO: dict[int, tuple[tuple, tuple, dict[str, Any]]] = {}
_MEMO_MAX = 4096
#: id(root module) -> (each module's attribute names, each module's address and whether it has a record, every module's
#: attribute values in order, the records made from them): the same for a whole model whose
#: attributes are all plain values and whose modules the forward left untouched
_WHOLE: dict[int, tuple[list, list, list, dict[str, dict[str, Any]]]] = {}


def snapshot(trace: Any, modules: Any, state: Any = None) -> None:
    """Record the attributes of each (address, live module) pair that has a Module record.
    `state` (the capture's `ModelStateSnapshot` of the same modules, in the same order) lets a
    module whose `__dict__` is as the snapshot saw it reuse its last record (`_MEMO`)."""
    records = trace._modules
    exact, exact_items = _EXACT, _EXACT_ITEMS
    configs: dict[int, dict[str, Any]] = {}
    out: dict[str, dict[str, Any]] = {}
    shapes = None
    whole = None
    if state is not None and len(state.mods) == len(modules) and False not in state.untouched_flags():
        # the whole model at once: the same attribute names and the same (plain) value objects in
        # every module, and the same modules with records, as at a capture whose result is kept
        whole = (state.plans, [(a, a in records) for a, _ in modules])
        last = _WHOLE.get(id(modules[0][1])) if modules else None
        if (last is not None and last[0] == whole[0] and last[1] == whole[1]
                and all(map(operator.is_, chain.from_iterable(state.rows), last[2]))):
            if last[3]:
                trace.annotations["module_custom_attributes"] = {a: dict(v) for a, v in last[3].items()}
            return
    if state is not None and len(state.mods) == len(modules):
        # per module: (untouched, the snapshot's attribute names, their values)
        shapes = zip(state.untouched_flags(), state.plans, state.rows)
        if len(_MEMO) > _MEMO_MAX:
            _MEMO.clear()
    for address, module in modules:
        shape = next(shapes) if shapes is not None else None
        if address not in records:
            continue
        if shape is not None and shape[0]:
            _, names, values = shape
            hit = _MEMO.get(id(module))
            if hit is not None and hit[0] == names and all(map(operator.is_, hit[1], values)):
                if hit[2]:
                    out[address] = dict(hit[2])
                continue
        attrs: dict[str, Any] = {}
        config = None
        plain = True  # every attribute a plain value (memoisable)
        for k, v in vars(module).items():
            if k[:1] == "_":
                continue
            t = type(v)
            if t in exact or (t is tuple and len(v) <= 8 and exact_items.issuperset(map(type, v))):
                attrs[k] = v  # (the common case, inline: `_atomic` and `_plain` of a plain value)
                continue
            plain = False
            if k == "config" and not _atomic(v) and hasattr(v, "__dict__"):
                config = v
            elif _atomic(v):
                attrs[k] = _plain(v)
        if shape is not None and shape[0] and plain:
            _, names, values = shape
            if all(type(v) in exact or type(v) is tuple and exact_items.issuperset(map(type, v)) for v in values):
                _MEMO[id(module)] = (names, values, dict(attrs))
        if config is not None:
            scalars = configs.get(id(config))
            if scalars is None:
                scalars = configs[id(config)] = config_scalars(config)
            for k, v in scalars.items():
                attrs.setdefault(k, v)  # the module's own attribute wins over its config's
                attrs[f"config.{k}"] = v
        if attrs:
            out[address] = attrs
    if whole is not None:
        values = list(chain.from_iterable(state.rows))
        if all(type(v) in exact or type(v) is tuple and exact_items.issuperset(map(type, v)) for v in values):
            # (plain values only: they keep nothing alive)
            if len(_WHOLE) >= _MEMO_MAX:
                _WHOLE.clear()
            _WHOLE[id(modules[0][1])] = (whole[0], whole[1], values, {a: dict(v) for a, v in out.items()})
    if out:
        trace.annotations["module_custom_attributes"] = out


__all__ = ["snapshot", "config_scalars"]
