"""Interventions (`tl.intervention`): recipes of (site, edit) rules applied by replay,
rerun, capture-time `intervene=`, or a bound executor."""

from torchlens.intervention.edits import (
    Edit,
    HookContext,
    Population,
    add,
    add_noise,
    clamp,
    clip_norm,
    compose,
    hook,
    keep_grad,
    mean_ablate,
    positions,
    splice_module,
    patch_from,
    project_onto,
    project_out,
    replace_with,
    scale,
    scramble_elements,
    steer,
    swap_with,
    zero_ablate,
)
from torchlens.intervention.live import BoundModel, EditPlan
from torchlens.intervention.recipe import Recipe, Rule, when
from torchlens.intervention.sweep import sweep
from torchlens.intervention.subspace import (
    SubspaceSite,
    UnitsSite,
    set_affine_coordinates,
    subspace,
    subspace_ablate,
    subspace_interchange,
    units,
)

__all__ = [
    "Edit", "HookContext", "Population", "SubspaceSite", "UnitsSite", "set_affine_coordinates", "subspace", "units", "Recipe", "Rule", "BoundModel", "EditPlan", "when",
    "compose", "keep_grad", "positions", "splice_module", "sweep", "subspace_ablate", "subspace_interchange",
    "add", "add_noise", "clamp", "clip_norm", "hook", "mean_ablate", "patch_from", "project_onto", "project_out",
    "replace_with", "scale", "scramble_elements", "steer", "swap_with", "zero_ablate",
]
