"""Hook specifications: what a TorchLens plugin may provide.

A plugin is any module or object registered under the entry-point group `torchlens` (or the
seed's `torchlens.recipes`) that implements some of these hooks with `@torchlens.hookimpl`.
Plugin modules must stay light: importing one must not import an ML framework.
"""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("torchlens")
hookimpl = pluggy.HookimplMarker("torchlens")


@hookspec
def torchlens_backends() -> list[Any]:
    """Return the `tl.backends.BackendSpec`s this plugin registers (names must be unique
    across all plugins)."""


@hookspec
def torchlens_facet_recipes() -> list[Any]:
    """Return facet recipes (named semantic views of captured values) this plugin adds."""


@hookspec
def torchlens_appliances() -> list[Any]:
    """Return `(name, factory, summary)` tuples: appliances served by `trace.using(name)`;
    `factory(trace)` returns the bound appliance (or a `"module:attr"` path to one)."""
