"""The plugin manager: entry-point discovery and the registries built on it.

Plugins are found by pluggy's own entry-point loader (`load_setuptools_entrypoints`): one
pass per group, and when a plugin in it fails, the group again one entry-point name at a
time so that the failing plugin is known by name. A third-party
plugin that fails to import, fails to register, or whose hook raises or returns malformed
objects is skipped with a coded `PluginWarning` (`plugin_skipped`) and listed by the doctor
as broken; every healthy plugin keeps working. A plugin registered directly by the
application (`register`) is the caller's own code: its faults raise `PluginError`.

A block list keeps named plugins from loading at all (they are never imported):
`TORCHLENS_DISABLE_PLUGINS=a,b` in the environment (read when the manager is made), plus
`PluginManager(blocked=...)` and `block(name)`. Backends (`torchlens_backends`), facet recipes and appliances
(`torchlens_appliances`, plus `torchlens.appliances.register`) are all served from this one
manager. The loaded state is recorded only after loading has finished, so a failure
half-way never leaves an empty registry behind.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Iterable

import pluggy

from torchlens.errors import PluginError, PluginWarning
from torchlens.plugins import hookspecs

ENTRY_POINT_GROUPS = ("torchlens", "torchlens.recipes")

#: Environment variable naming entry points (comma separated) that must not be loaded.
DISABLE_ENV = "TORCHLENS_DISABLE_PLUGINS"


@dataclass(frozen=True)
class PluginInfo:
    """One plugin, as the doctor lists it. `status` is "loaded", "broken" (skipped, `error`
    says why) or "blocked" (on the block list, never imported)."""

    name: str
    group: str
    value: str
    distribution: str
    version: str
    status: str = "loaded"
    error: str = ""


def _dist_of(ep: metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", "?"
    return dist.metadata["Name"] or "?", dist.version or "?"


def blocked_from_env() -> frozenset[str]:
    """Entry-point names listed in `TORCHLENS_DISABLE_PLUGINS`."""
    return frozenset(n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip())


class PluginManager:
    """Loads plugins from entry points once, and answers registry questions from them."""

    def __init__(self, blocked: Iterable[str] | None = None) -> None:
        self._pm = pluggy.PluginManager("torchlens")
        self._pm.add_hookspecs(hookspecs)
        self._loaded = False
        self._lock = threading.RLock()
        self.plugins: list[PluginInfo] = []
        self._from_entry_points: set[str] = set()
        self._backends: dict[str, Any] | None = None
        self._appliances: dict[str, tuple[Any, str]] = {}
        self._appliances_loaded = False
        for name in blocked_from_env() | frozenset(blocked or ()):
            self.block(name)

    # loading -----------------------------------------------------------------------------------
    def block(self, name: str) -> None:
        """Never load (or keep) the plugin registered under entry-point name `name`."""
        with self._lock:
            self._pm.set_blocked(name)
            self._backends = None

    def is_blocked(self, name: str) -> bool:
        return self._pm.is_blocked(name)

    @property
    def broken(self) -> list[PluginInfo]:
        """The plugins skipped because they failed."""
        return [p for p in self.plugins if p.status == "broken"]

    def load(self) -> None:
        """Load every entry point once: each group in one pass of pluggy's loader; when a
        plugin fails, the group is finished one name at a time so the failing one is known,
        skipped and named."""
        with self._lock:
            if self._loaded:
                return
            seen: set[str] = set()
            for group in ENTRY_POINT_GROUPS:
                eps = []
                for ep in _entry_points(group):
                    if ep.name not in seen:  # one plugin per name (pluggy's registry is keyed by it)
                        seen.add(ep.name)
                        eps.append(ep)
                try:
                    self._pm.load_setuptools_entrypoints(group)
                except Exception:  # noqa: BLE001 - which plugin failed is found below, name by name
                    pass
                for ep in eps:
                    self._load_entry_point(ep, group)
            self._loaded = True  # only once every entry point was tried

    def _load_entry_point(self, ep: metadata.EntryPoint, group: str) -> None:
        dist_name, version = _dist_of(ep)
        if self._pm.is_blocked(ep.name):
            self.plugins.append(PluginInfo(ep.name, group, ep.value, dist_name, version, "blocked"))
            return
        if any(p.name == ep.name for p in self.plugins):
            return
        if self._pm.has_plugin(ep.name):  # loaded by the group pass
            self._loaded_ok(ep, group, dist_name, version)
            return
        try:
            self._pm.load_setuptools_entrypoints(group, name=ep.name)
        except Exception as exc:  # a broken third-party plugin is skipped, named, never fatal
            if self._pm.has_plugin(ep.name):
                self._pm.unregister(name=ep.name)
            self._skip(PluginInfo(ep.name, group, ep.value, dist_name, version, "broken",
                                  f"failed to load: {type(exc).__name__}: {exc}"))
            return
        if not self._pm.has_plugin(ep.name):  # listed, yet the loader found no distribution holding it
            self._skip(PluginInfo(ep.name, group, ep.value, dist_name, version, "broken",
                                  "the entry point is not provided by any installed distribution"))
            return
        self._loaded_ok(ep, group, dist_name, version)

    def _loaded_ok(self, ep: metadata.EntryPoint, group: str, dist_name: str, version: str) -> None:
        plugin = self._pm.get_plugin(ep.name)
        unknown = sorted({hc.name for hc in self._pm.get_hookcallers(plugin) or () if hc.spec is None
                          and not all(i.optionalhook for i in hc.get_hookimpls() if i.plugin is plugin)})
        if unknown:  # what `register` refuses for a direct plugin (pluggy's loader leaves it pending)
            self._pm.unregister(name=ep.name)
            self._skip(PluginInfo(ep.name, group, ep.value, dist_name, version, "broken",
                                  f"implements hooks no torchlens hookspec declares: {', '.join(unknown)}"))
            return
        self._from_entry_points.add(ep.name)
        self.plugins.append(PluginInfo(ep.name, group, ep.value, dist_name, version))
        self._backends = None

    def _skip(self, info: PluginInfo) -> None:
        self.plugins = [p for p in self.plugins if p.name != info.name] + [info]
        warnings.warn(PluginWarning(
            "plugin_skipped", f"plugin {info.name!r} ({info.value}) of {info.distribution} {info.version} was skipped: "
            f"{info.error}", remedy=f"fix or uninstall the distribution {info.distribution!r}, or set "
            f"{DISABLE_ENV}={info.name}", plugin=info.name, distribution=info.distribution, error=info.error),
            stacklevel=4)

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
            self._appliances_loaded = False

    def unregister(self, name: str) -> None:
        with self._lock:
            self._pm.unregister(name=name)
            self._backends = None

    @property
    def hook(self) -> Any:
        self.load()
        return self._pm.hook

    # registries ---------------------------------------------------------------------------------
    def _results(self, hook_name: str, check: Any, expected: str) -> list[tuple[str, Any]]:
        """(plugin name, item) for every item every plugin's `hook_name` returns. A faulty
        entry-point plugin is skipped (warned, shown broken); a faulty direct one raises."""
        out: list[tuple[str, Any]] = []
        for impl in getattr(self._pm.hook, hook_name).get_hookimpls():
            name = impl.plugin_name
            try:
                result = impl.function()
                items = list(result or ())
                bad = [i for i in items if not check(i)]
                if bad:
                    raise PluginError("plugin_invalid", f"plugin {name!r} returned {type(bad[0]).__name__} from "
                                      f"{hook_name}, not {expected}", remedy=f"return a list of {expected}", plugin=name)
            except Exception as exc:
                if name not in self._from_entry_points:
                    if isinstance(exc, PluginError):
                        raise
                    raise PluginError("plugin_invalid", f"plugin {name!r}'s {hook_name} raised {type(exc).__name__}: {exc}",
                                      remedy="fix the plugin's hook", plugin=name) from exc
                old = next(p for p in self.plugins if p.name == name)
                self._pm.unregister(name=name)
                self._from_entry_points.discard(name)
                self._skip(PluginInfo(old.name, old.group, old.value, old.distribution, old.version, "broken",
                                      f"{hook_name} failed: {exc.message if isinstance(exc, PluginError) else exc}"))
                continue
            out += [(name, i) for i in items]
        return out

    def backends(self) -> dict[str, Any]:
        """name -> BackendSpec, over every plugin. Duplicate names are a typed error."""
        from torchlens.backends.protocol import BackendSpec

        with self._lock:
            self.load()
            if self._backends is not None:
                return self._backends
            out: dict[str, Any] = {}
            for plugin, spec in self._results("torchlens_backends", lambda s: isinstance(s, BackendSpec), "BackendSpec"):
                if spec.name in out:
                    raise PluginError("backend_name_duplicate", f"backend name {spec.name!r} is registered twice (again by {plugin!r})",
                                      remedy=f"uninstall one of the distributions that register it, or set {DISABLE_ENV}={plugin}",
                                      name=spec.name, plugin=plugin)
                out[spec.name] = spec
            self._backends = out
            return out

    def register_appliance(self, name: str, factory: Any, summary: str = "", replace: bool = False) -> None:
        """Add an appliance served by `trace.using(name)` (checked by `torchlens.appliances`)."""
        with self._lock:
            self._load_appliances()
            if name in self._appliances and not replace:
                raise PluginError("appliance_name_taken", f"appliance {name!r} is already registered",
                                  remedy="pass replace=True to override it", name=name)
            self._appliances[name] = (factory, summary)

    def appliance_table(self) -> dict[str, tuple[Any, str]]:
        """name -> (factory, summary): plugin appliances and directly registered ones."""
        with self._lock:
            self._load_appliances()
            return dict(self._appliances)

    def _load_appliances(self) -> None:
        if self._appliances_loaded:
            return
        from torchlens.appliances import ApplianceSpec, as_appliance_spec

        self.load()
        found: dict[str, tuple[Any, str]] = {}
        for _, item in self._results("torchlens_appliances", lambda i: as_appliance_spec(i) is not None,
                                     "ApplianceSpec or (name, factory, summary)"):
            spec: ApplianceSpec = as_appliance_spec(item)
            found.setdefault(spec.name, (spec.factory, spec.summary))
        for name, entry in found.items():
            self._appliances.setdefault(name, entry)
        self._appliances_loaded = True  # after the table is filled, never before

    def appliances(self) -> list[Any]:
        """Every appliance as an `ApplianceSpec`."""
        from torchlens.appliances import ApplianceSpec

        return [ApplianceSpec(n, f, s) for n, (f, s) in sorted(self.appliance_table().items())]

    def facet_recipes(self) -> list[Any]:
        self.load()
        return [item for _, item in self._results("torchlens_facet_recipes", lambda i: True, "facet recipes")]


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=group))


_MANAGER: PluginManager | None = None
_MANAGER_LOCK = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager (loaded on first use)."""
    global _MANAGER
    with _MANAGER_LOCK:
        if _MANAGER is None:
            _MANAGER = PluginManager()
        return _MANAGER
