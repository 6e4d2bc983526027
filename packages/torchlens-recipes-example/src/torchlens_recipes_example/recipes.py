"""The example recipe: written only against the public `tl.facets` authoring helpers.

It matches the reference backend's `LoopNet` by class name (no other framework has that
class, so installing this example adds no facet to anyone's torch models) and declares
`entry_lo` / `entry_hi` (the two halves of the entry projection's output features) and
`entry_w` (that projection's weight).
"""

from __future__ import annotations

from typing import Any

import torchlens as tl

RECIPE_ID = "recipes_example.loopnet_entry"


@tl.facets.recipe(class_name="LoopNet", facets=("entry_lo", "entry_hi", "entry_w"), recipe_id=RECIPE_ID)
def loopnet_entry(module: Any) -> dict[str, Any]:
    entry = tl.facets.child_output_spec(module, "inp", RECIPE_ID)
    return {"entry_lo": entry.split(2, dim=-1)[0], "entry_hi": entry.split(2, dim=-1)[1],
            "entry_w": tl.facets.parameter_spec(module, "inp.weight", RECIPE_ID)}


RECIPES = (loopnet_entry,)
