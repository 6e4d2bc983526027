"""The `torchlens` entry point of the kit: registers the "mechinterp" appliance. Light on
purpose: the kit (and torch) import only when an appliance is bound to a trace."""

from __future__ import annotations

from typing import Any

import torchlens
from torchlens.appliances import ApplianceSpec


@torchlens.hookimpl
def torchlens_appliances() -> list[Any]:
    return [ApplianceSpec("mechinterp", "torchlens_mechinterp.appliance:bind",
                          "the mech-interp kit: residual decomposition, DLA, heads, patch grids")]
