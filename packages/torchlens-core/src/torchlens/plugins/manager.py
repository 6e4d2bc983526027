"""The plugin manager: entry-point discovery and the registries built on it."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from torchlens.errors import PluginError
from torchlens.plugins import hookspecs

ENTRY_POINT_GROUPS = ("torchlens", "torchlens.recipes")


@dataclass(frozen=True)
class PluginInfo:
    """One loaded plugin, as the doctor lists it."""

    name: str
    group: str
    value: str
    distribution: str
    version: str


class PluginManager:
    """Loads plugins from entry points once, and answers registry questions from them."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager("torchlens")
        self._pm.add_hookspecs(hookspecs)
        self._loaded = False
        self._lock = threading.RLock()
        self.plugins: list[PluginInfo] = []
        self._backends: dict[str, Any] | None = None

    def load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            for group in ENTRY_POINT_GROUPS:
                for ep in _entry_points(group):
                    self._load_entry_point(ep, group)

    def _load_entry_point(self, ep: metadata.EntryPoint, group: str) -> None:
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else "?"
        version = dist.version if dist is not None else "?"
        key = f"{group}:{ep.name}"
        if self._pm.has_plugin(key):
            return
        try:
            obj = ep.load()
        except Exception as exc:  # a broken third-party plugin must say who it is
            raise PluginError("plugin_invalid", f"entry point {ep.name!r} ({ep.value}) of {dist_name} failed to import: {exc}",
                              remedy=f"fix or uninstall the distribution {dist_name!r}", entry_point=ep.name,
                              distribution=dist_name) from exc
        self.register(obj, key)
        self.plugins.append(PluginInfo(ep.name, group, ep.value, dist_name, version))

    def register(self, obj: Any, name: str) -> None:
        """Register a plugin object directly (what an entry point does, for tests and apps)."""
        with self._lock:
            try:
                self._pm.register(obj, name=name)
                self._pm.check_pending()
            except (pluggy.PluginValidationError, ValueError) as exc:
                if self._pm.has_plugin(name):
                    self._pm.unregister(name=name)
                raise PluginError("plugin_invalid", f"plugin {name!r} is malformed: {exc}",
                                  remedy="implement only hooks declared in torchlens.plugins.hookspecs", plugin=name) from exc
            self._backends = None

    def unregister(self, name: str) -> None:
        with self._lock:
            self._pm.unregister(name=name)
            self._backends = None

    @property
    def hook(self) -> Any:
        self.load()
        return self._pm.hook

    def backends(self) -> dict[str, Any]:
        """name -> BackendSpec, over every plugin. Duplicate names are a typed error."""
        from torchlens.backends.protocol import BackendSpec

        with self._lock:
            self.load()
            if self._backends is not None:
                return self._backends
            out: dict[str, Any] = {}
            for impl in self._pm.hook.torchlens_backends.get_hookimpls():
                result = impl.function()
                for spec in result or ():
                    if not isinstance(spec, BackendSpec):
                        raise PluginError("plugin_invalid", f"plugin {impl.plugin_name!r} returned {type(spec).__name__} from torchlens_backends, not BackendSpec",
                                          remedy="return a list of torchlens.backends.BackendSpec", plugin=impl.plugin_name)
                    if spec.name in out:
                        raise PluginError("backend_name_duplicate", f"backend name {spec.name!r} is registered twice (again by {impl.plugin_name!r})",
                                          remedy="uninstall one of the distributions that register it", name=spec.name,
                                          plugin=impl.plugin_name)
                    out[spec.name] = spec
            self._backends = out
            return out

    def appliances(self) -> list[Any]:
        out: list[Any] = []
        for result in self.hook.torchlens_appliances():
            out.extend(result or ())
        return out

    def facet_recipes(self) -> list[Any]:
        out: list[Any] = []
        for result in self.hook.torchlens_facet_recipes():
            out.extend(result or ())
        return out


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=group))


_MANAGER: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager (loaded on first use)."""
    global _MANAGER
    if _MANAGER is None:
        _MANAGER = PluginManager()
    return _MANAGER
