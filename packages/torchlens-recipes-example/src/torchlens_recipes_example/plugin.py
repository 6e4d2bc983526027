"""The `torchlens.recipes` entry point: light on purpose (the recipes load in the hook)."""

from __future__ import annotations

from typing import Any

import torchlens


@torchlens.hookimpl
def torchlens_facet_recipes() -> list[Any]:
    from torchlens_recipes_example.recipes import RECIPES

    return list(RECIPES)
