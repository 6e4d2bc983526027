"""Hook specifications: what a TorchLens plugin may provide.

A plugin is any module or object registered under the entry-point group `torchlens` (or the
seed's `torchlens.recipes`) that implements some of these hooks with `@torchlens.hookimpl`.
Plugin modules must stay light: importing one must not import an ML framework.

The return types are part of the contract: the plugin manager checks every returned item
and skips (with a coded warning) an entry-point plugin that returns anything else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    from torchlens.appliances import ApplianceSpec
    from torchlens.backends.protocol import BackendSpec

hookspec = pluggy.HookspecMarker("torchlens")
hookimpl = pluggy.HookimplMarker("torchlens")


@hookspec
def torchlens_backends() -> list[BackendSpec]:
    """Return the `tl.backends.BackendSpec`s this plugin registers (names must be unique
    across all plugins)."""


@hookspec
def torchlens_facet_recipes() -> list[Any]:
    """Return facet recipes (named semantic views of captured values) this plugin adds."""


@hookspec
def torchlens_appliances() -> list[ApplianceSpec | tuple[str, Callable[[Any], Any] | str, str]]:
    """Return `ApplianceSpec(name, factory, summary)`s (or `(name, factory, summary)` tuples):
    appliances served by `trace.using(name)`; `factory(trace)` returns the bound appliance
    (or `factory` is a `"module:attr"` path to one)."""
