"""Appliances: named analysis kits served by `trace.using(name)`.

The table lives in the plugin manager (`PluginManager.appliance_table`), next to the
backends: plugins contribute through the `torchlens_appliances` hook, applications through
`register`. This module checks names and factories and binds an appliance to a trace.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable

from torchlens.errors import PluginError


@dataclass(frozen=True)
class ApplianceSpec:
    """One appliance: `factory(trace)` returns it bound to a trace (or `factory` is a lazily
    imported `"module:attribute"` path to such a callable)."""

    name: str
    factory: Callable[[Any], Any] | str
    summary: str = ""


def _name_ok(name: Any) -> bool:
    return isinstance(name, str) and re.fullmatch(r"[a-z][a-z0-9_]*", name) is not None


def _factory_ok(factory: Any) -> bool:
    return callable(factory) or (isinstance(factory, str) and ":" in factory)


def as_appliance_spec(item: Any) -> ApplianceSpec | None:
    """`item` as an ApplianceSpec (from a spec or a `(name, factory[, summary])` tuple), or
    None when it is malformed."""
    if isinstance(item, ApplianceSpec):
        spec = item
    elif isinstance(item, tuple) and len(item) in (2, 3):
        spec = ApplianceSpec(item[0], item[1], item[2] if len(item) == 3 else "")
    else:
        return None
    ok = _name_ok(spec.name) and _factory_ok(spec.factory) and isinstance(spec.summary, str)
    return spec if ok else None


def _manager() -> Any:
    from torchlens.plugins.manager import get_plugin_manager

    return get_plugin_manager()


def register(name: str, factory: Callable[[Any], Any] | str, summary: str = "", replace: bool = False) -> None:
    """Register `factory(trace)` (or a lazily imported `"module:attribute"`) as `name`."""
    if not _name_ok(name):
        raise PluginError("appliance_registration_invalid", f"appliance name {name!r} is not a lowercase identifier",
                          remedy="use a name like 'mechinterp'", name=repr(name))
    if not _factory_ok(factory):
        raise PluginError("appliance_registration_invalid", "an appliance factory is a callable or 'module:attribute'",
                          remedy="register(name, lambda trace: Kit(trace))", name=name)
    _manager().register_appliance(name, factory, summary, replace=replace)


def names() -> dict[str, str]:
    """Registered appliance names with their summaries."""
    return {n: s for n, (_, s) in sorted(_manager().appliance_table().items())}


def bind(name: str, trace: Any) -> Any:
    table = _manager().appliance_table()
    entry = table.get(name)
    if entry is None:
        raise PluginError("appliance_unknown", f"no appliance named {name!r}",
                          remedy="registered: " + (", ".join(sorted(table)) or "none"), name=name)
    factory = entry[0]
    if isinstance(factory, str):
        mod, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(mod), attr)
    return factory(trace)
