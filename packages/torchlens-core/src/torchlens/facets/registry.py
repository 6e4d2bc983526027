"""The facet-recipe registry: registration, precedence, snapshots and plugin loading.

A recipe is a function `recipe(module) -> {facet name: FacetSpec | None}` matched to module
records by `class_qualname` (most specific), `class_name`, or a `predicate(module)` (least).
Within a specificity tier a user recipe beats a plugin's, and a plugin's beats a built-in;
true same-tier, same-source collisions warn (`facet_recipe_collision`) and the later
registration wins.

Sources of recipes, in the order a snapshot lists them: built-ins and third-party recipes
from plugins (the `torchlens_facet_recipes` hook of `torchlens` / `torchlens.recipes`
entry points, asked on FIRST facet use, never at `import torchlens`), the process registry
(`register`), the context additions (`adding`) and a trace's own `facets=`. Each trace
keeps an immutable `RegistrySnapshot` of the user-side recipes taken when it was captured
(`stamp`), so later registrations never change what an old trace's facets mean.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from torchlens.errors import FacetError, FacetWarning

#: specificity tiers, most specific first
TIERS: tuple[str, ...] = ("class_qualname", "class_name", "predicate")
#: recipe sources, strongest first within a tier
SOURCES: tuple[str, ...] = ("user", "plugin", "builtin")

_ORDER = itertools.count()
_LOCK = threading.RLock()


@dataclass(frozen=True)
class FacetRecipe:
    """One registered recipe and the metadata precedence and `describe` read."""

    fn: Callable[[Any], Any]
    recipe_id: str
    class_name: str | None = None
    class_qualname: str | None = None
    predicate: Callable[[Any], bool] | None = None
    target_scope: str = "module"
    facets: tuple[str, ...] = ()
    source: str = "user"
    version: str = "1"
    order: int = 0

    @property
    def tier(self) -> str:
        if self.class_qualname:
            return "class_qualname"
        if self.class_name:
            return "class_name"
        return "predicate"

    def matches(self, module: Any) -> bool:
        if self.class_qualname:
            return module.class_qualname == self.class_qualname
        if self.class_name:
            return module.class_name == self.class_name
        try:
            return bool(self.predicate(module))
        except Exception as exc:  # a predicate that raises is the recipe author's bug: say whose
            raise FacetError("facet_recipe_invalid", f"the predicate of recipe {self.recipe_id!r} raised "
                             f"{type(exc).__name__}: {exc} on module {module.address!r}",
                             remedy="make the predicate total over Module records (return False when unsure)",
                             recipe=self.recipe_id, module=module.address) from exc

    def rank(self) -> tuple[int, int, int]:
        """Sort key: lower wins (tier, then source, then the later registration)."""
        return TIERS.index(self.tier), SOURCES.index(self.source), -self.order

    def as_dict(self) -> dict[str, Any]:
        return {"recipe_id": self.recipe_id, "tier": self.tier, "source": self.source, "class_name": self.class_name,
                "class_qualname": self.class_qualname, "target_scope": self.target_scope, "facets": list(self.facets),
                "version": self.version}


def make_recipe(fn: Callable[[Any], Any], *, class_name: str | None = None, class_qualname: str | None = None,
                predicate: Callable[[Any], bool] | None = None, target_scope: str = "module",
                facets: Iterable[str] = (), recipe_id: str | None = None, version: str = "1",
                source: str = "user") -> FacetRecipe:
    """Check the registration arguments and build the record (nothing is registered)."""
    if not callable(fn):
        raise FacetError("facet_registration_invalid", f"a facet recipe must be callable, not {type(fn).__name__}",
                         remedy="decorate a function recipe(module) -> {name: FacetSpec}")
    if sum(x is not None for x in (class_name, class_qualname, predicate)) != 1:
        raise FacetError("facet_registration_invalid", "a recipe matches by exactly one of class_qualname=, "
                         "class_name= or predicate=", remedy="pass one matcher, e.g. class_name='MyAttention'")
    if predicate is not None and not callable(predicate):
        raise FacetError("facet_registration_invalid", "predicate= must be callable",
                         remedy="predicate=lambda module: ...")
    if target_scope != "module":
        raise FacetError("facet_registration_invalid", f"target_scope={target_scope!r}: only 'module' recipes exist",
                         remedy="target_scope='module'", target_scope=target_scope)
    if source not in SOURCES:
        raise FacetError("facet_registration_invalid", f"source={source!r} is not one of {SOURCES}",
                         remedy="leave source to the registry")
    rid = recipe_id or f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    return FacetRecipe(fn, rid, class_name, class_qualname, predicate, target_scope, tuple(facets), source, version,
                       next(_ORDER))


def recipe(*, class_name: str | None = None, class_qualname: str | None = None,
           predicate: Callable[[Any], bool] | None = None, target_scope: str = "module", facets: Iterable[str] = (),
           recipe_id: str | None = None, version: str = "1", builtin: bool = False) -> Callable[[Callable], Callable]:
    """Decorator that marks a function as a recipe WITHOUT registering it: what a plugin's
    `torchlens_facet_recipes()` hook returns and what `facets=` / `adding` take."""

    def deco(fn: Callable) -> Callable:
        fn.__facet_recipe__ = make_recipe(fn, class_name=class_name, class_qualname=class_qualname,
                                          predicate=predicate, target_scope=target_scope, facets=facets,
                                          recipe_id=recipe_id, version=version,
                                          source="builtin" if builtin else "plugin")
        return fn

    return deco


def as_recipe(obj: Any, source: str | None = None) -> FacetRecipe:
    """The FacetRecipe behind a decorated function (or the record itself)."""
    rec = obj if isinstance(obj, FacetRecipe) else getattr(obj, "__facet_recipe__", None)
    if not isinstance(rec, FacetRecipe):
        raise FacetError("facet_registration_invalid", f"{obj!r} is not a facet recipe",
                         remedy="decorate it with @tl.facets.register(...) or @tl.facets.recipe(...)")
    if source is not None and rec.source != source and not (source == "plugin" and rec.source == "builtin"):
        from dataclasses import replace

        rec = replace(rec, source=source)
    return rec


# process state ------------------------------------------------------------------------------
_PROCESS: list[FacetRecipe] = []
_VERSION = [0]
_PLUGIN: tuple[FacetRecipe, ...] | None = None
_PLUGIN_KEY: tuple = ()
_CONTEXT: contextvars.ContextVar[tuple[FacetRecipe, ...]] = contextvars.ContextVar("torchlens_facet_context",
                                                                                  default=())


def register(fn: Callable | None = None, *, class_name: str | None = None, class_qualname: str | None = None,
             predicate: Callable[[Any], bool] | None = None, target_scope: str = "module",
             facets: Iterable[str] = (), recipe_id: str | None = None, version: str = "1") -> Any:
    """`@tl.facets.register(class_name="MyAttention")`: add a user recipe to the process
    registry (affects traces captured from now on)."""

    def deco(f: Callable) -> Callable:
        rec = make_recipe(f, class_name=class_name, class_qualname=class_qualname, predicate=predicate,
                          target_scope=target_scope, facets=facets, recipe_id=recipe_id, version=version)
        with _LOCK:
            _PROCESS.append(rec)
            _VERSION[0] += 1
        f.__facet_recipe__ = rec
        return f

    return deco(fn) if fn is not None else deco


def reset() -> None:
    """Restore the process registry to the built-in (and installed plugin) recipes."""
    with _LOCK:
        _PROCESS.clear()
        _VERSION[0] += 1


@contextlib.contextmanager
def adding(*recipes: Any) -> Iterator[None]:
    """Recipes added for traces captured inside the block only (context-local)."""
    recs = tuple(as_recipe(r, source="user") for r in recipes)
    token = _CONTEXT.set(_CONTEXT.get() + recs)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def plugin_recipes() -> tuple[FacetRecipe, ...]:
    """Recipes the installed plugins provide, asked on first facet use (and again only when
    the set of plugins changed, e.g. an application registered one). A broken entry-point
    plugin is skipped with a coded `PluginWarning` by the plugin manager."""
    global _PLUGIN, _PLUGIN_KEY
    from torchlens.plugins.manager import get_plugin_manager

    with _LOCK:
        pm = get_plugin_manager()
        pm.load()
        key = tuple(id(p) for p in pm._pm.get_plugins())
        if _PLUGIN is None or key != _PLUGIN_KEY:
            found: dict[str, FacetRecipe] = {}
            for item in pm.facet_recipes():
                items = item if isinstance(item, (list, tuple)) else [item]
                for one in items:
                    try:
                        rec = as_recipe(one, source="plugin")
                    except FacetError as exc:
                        warnings.warn(FacetWarning("facet_plugin_recipe_invalid", f"a plugin returned a non-recipe "
                                                   f"object {one!r}; skipped", remedy=exc.remedy), stacklevel=3)
                        continue
                    found.setdefault(rec.recipe_id, rec)  # one recipe reached through two plugin names counts once
            _PLUGIN, _PLUGIN_KEY = tuple(found.values()), key
        return _PLUGIN


def plugins_loaded() -> bool:
    return _PLUGIN is not None


# snapshots ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RegistrySnapshot:
    """The recipes one trace uses: the user side frozen at capture, the plugin side loaded
    once per process on first facet use (it never changes after loading)."""

    user: tuple[FacetRecipe, ...]
    version: int
    provenance_id: str
    _plugins: list = field(default_factory=list, compare=False, repr=False)  # frozen on first use

    @property
    def recipes(self) -> tuple[FacetRecipe, ...]:
        if not self._plugins:
            self._plugins.append(plugin_recipes())
        return self._plugins[0] + self.user

    def matching(self, module: Any) -> list[FacetRecipe]:
        return sorted((r for r in self.recipes if r.matches(module)), key=FacetRecipe.rank)


def snapshot(extra: Iterable[Any] = ()) -> RegistrySnapshot:
    """The registry as a trace captured now sees it: process + context + `extra`."""
    with _LOCK:
        user = tuple(_PROCESS) + _CONTEXT.get() + tuple(as_recipe(r, source="user") for r in extra)
        version = _VERSION[0]
    pid = f"v{version}:" + ",".join(r.recipe_id for r in user)
    return RegistrySnapshot(user, version, pid)


#: snapshot id -> snapshot. A trace holds only the id (picklable; a fork shares it); an
#: unpickled trace in another process finds no entry and is stamped again on first use.
_SNAPSHOTS: dict[int, RegistrySnapshot] = {}
_SNAPSHOT_IDS = itertools.count(1)
#: registry id -> snapshot id, so every capture under one registry reuses one entry (a trace
#: per dataset row must not grow this table); a trace's own facets= always get a fresh entry
_SNAPSHOT_BY_PID: dict[tuple, int] = {}
#: per-trace derived state (facet entries, reconstruction caches): kept beside the trace,
#: never in it, so a trace stays picklable and a fork derives its own
_STATE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def state_for(trace: Any) -> dict:
    """The facet layer's derived, recomputable state of `trace` (caches)."""
    with _LOCK:
        st = _STATE.get(trace)
        if st is None:
            st = _STATE[trace] = {}
        return st


def stamp(trace: Any, facets: Iterable[Any] | None = None) -> RegistrySnapshot:
    """Give `trace` its registry snapshot (the capture entry point calls this with the
    trace's `facets=`)."""
    if facets is not None and not isinstance(facets, (list, tuple)):
        raise FacetError("facet_registration_invalid", f"facets= takes a list of recipes, not {type(facets).__name__}",
                         remedy="facets=[my_recipe]")
    snap = snapshot(facets or ())
    with _LOCK:
        key = (snap.version, tuple(id(r) for r in snap.user))  # the stored snapshot keeps these recipes alive
        sid = _SNAPSHOT_BY_PID.get(key) if not facets else None  # equal registries share one entry
        if sid is None:
            sid = next(_SNAPSHOT_IDS)
            _SNAPSHOTS[sid] = snap
            if not facets:
                _SNAPSHOT_BY_PID[key] = sid
        snap = _SNAPSHOTS[sid]
        _STATE.pop(trace, None)
    trace.__dict__["_facet_snapshot"] = sid
    return snap


def snapshot_for(trace: Any) -> RegistrySnapshot:
    """The trace's snapshot; a trace captured before the capture entry point stamped it
    (or built by hand, or unpickled in another process) is stamped on first facet access."""
    snap = _SNAPSHOTS.get(trace.__dict__.get("_facet_snapshot", 0))
    if snap is None:
        snap = stamp(trace)
    return snap


def functions() -> list[dict[str, Any]]:
    """Metadata of every recipe the process registry holds (plugins first, then user)."""
    with _LOCK:
        user = tuple(_PROCESS) + _CONTEXT.get()
    return [r.as_dict() for r in plugin_recipes() + user]


def describe(class_name: str) -> list[dict[str, Any]]:
    """The recipes that match modules of class `class_name` (by name or qualname), in
    precedence order; predicate recipes are listed as candidates (they need a module)."""
    out = []
    with _LOCK:
        user = tuple(_PROCESS) + _CONTEXT.get()
    for r in sorted(plugin_recipes() + user, key=FacetRecipe.rank):
        if r.class_name == class_name or r.class_qualname == class_name or (
                r.class_qualname and r.class_qualname.rsplit(".", 1)[-1] == class_name):
            out.append(r.as_dict())
        elif r.predicate is not None:
            out.append({**r.as_dict(), "candidate": True})
    return out


__all__ = ["FacetRecipe", "RegistrySnapshot", "register", "recipe", "reset", "adding", "snapshot", "stamp",
           "snapshot_for", "state_for", "functions", "describe", "plugin_recipes", "make_recipe", "as_recipe", "TIERS", "SOURCES"]
