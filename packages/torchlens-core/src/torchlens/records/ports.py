"""Ports: the work a record hands to a layer above it, without importing that layer.

Records sit below selection, interventions, persistence and drawing (the dependency test
enforces it), yet `Trace.do`, `Trace.save`, `Op.out = v` or a record's HTML view run code
of those layers. Each such method calls `port(name)`; the top-level package binds every
port when `torchlens` is imported (`torchlens._wiring`), lazily: a port's implementation is
imported on its first call, as the methods' local imports did before. The builder's
post-build hook (`stamp_params`) goes through a port too, for the same reason.

An unbound port is a packaging error (the wiring table and the callers disagree), raised as
`RuntimeError` naming the port; a test checks every port a record calls is bound.
"""

from __future__ import annotations

from typing import Any, Callable

_LOADERS: dict[str, Callable[[], Callable[..., Any]]] = {}
_RESOLVED: dict[str, Callable[..., Any]] = {}


def bind(name: str, loader: Callable[[], Callable[..., Any]]) -> None:
    """Bind port `name` to `loader()`, called once on first use (it imports the upper layer)."""
    _LOADERS[name] = loader
    _RESOLVED.pop(name, None)


def port(name: str) -> Callable[..., Any]:
    """The implementation bound to port `name`."""
    fn = _RESOLVED.get(name)
    if fn is None:
        loader = _LOADERS.get(name)
        if loader is None:
            raise RuntimeError(f"records port {name!r} is not bound (torchlens._wiring binds every port)")
        fn = _RESOLVED[name] = loader()
    return fn


def bound() -> frozenset[str]:
    """The names of the bound ports."""
    return frozenset(_LOADERS)
