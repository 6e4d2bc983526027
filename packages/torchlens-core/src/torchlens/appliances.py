"""Appliances: named analysis kits served by `trace.using(name)`."""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable

from torchlens.errors import PluginError

_REGISTRY: dict[str, tuple[Any, str]] = {}
_loaded_plugins = False


def register(name: str, factory: Callable[[Any], Any] | str, summary: str = "", replace: bool = False) -> None:
    """Register `factory(trace)` (or a lazily imported `"module:attribute"`) as `name`."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise PluginError("appliance_registration_invalid", f"appliance name {name!r} is not a lowercase identifier",
                          remedy="use a name like 'mechinterp'", name=repr(name))
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise PluginError("appliance_registration_invalid", "an appliance factory is a callable or 'module:attribute'",
                          remedy="register(name, lambda trace: Kit(trace))", name=name)
    if name in _REGISTRY and not replace:
        raise PluginError("appliance_name_taken", f"appliance {name!r} is already registered",
                          remedy="pass replace=True to override it", name=name)
    _REGISTRY[name] = (factory, summary)


def _load_plugins() -> None:
    global _loaded_plugins
    if _loaded_plugins:
        return
    _loaded_plugins = True
    from torchlens.plugins.manager import get_plugin_manager

    for item in get_plugin_manager().appliances():
        name, factory, summary = (tuple(item) + ("",))[:3]
        if name not in _REGISTRY:
            register(name, factory, summary)


def names() -> dict[str, str]:
    """Registered appliance names with their summaries."""
    _load_plugins()
    return {n: s for n, (_, s) in sorted(_REGISTRY.items())}


def bind(name: str, trace: Any) -> Any:
    _load_plugins()
    entry = _REGISTRY.get(name)
    if entry is None:
        raise PluginError("appliance_unknown", f"no appliance named {name!r}",
                          remedy="registered: " + (", ".join(sorted(_REGISTRY)) or "none"), name=name)
    factory = entry[0]
    if isinstance(factory, str):
        mod, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(mod), attr)
    return factory(trace)
