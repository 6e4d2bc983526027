"""Built-in torch facet recipes, served through the same plugin hook a third party uses.

This module is a pluggy plugin (`torchlens_facet_recipes`), light on purpose: importing it
imports no torch (the recipes import torch inside the functions that compute values).
TorchLens asks for the recipes on the first facet access, never at `import torchlens`.
"""

from __future__ import annotations

from typing import Any

import torchlens

from torchlens_torch.recipes.attention import attention, multihead_attention
from torchlens_torch.recipes.blocks import mlp, residual_block
from torchlens_torch.recipes.heads import classification_head, contrastive_image_head, language_model_head

#: every built-in torch recipe, in registration order
RECIPES: tuple[Any, ...] = (attention, multihead_attention, residual_block, mlp, language_model_head,
                               classification_head, contrastive_image_head)


@torchlens.hookimpl
def torchlens_facet_recipes() -> list[Any]:
    return list(RECIPES)


__all__ = ["RECIPES", "torchlens_facet_recipes", "attention", "multihead_attention", "residual_block", "mlp",
           "language_model_head", "classification_head",
           "contrastive_image_head"]
