"""Recipes: immutable lists of (site, edit) rules built with `tl.when`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from torchlens.errors import InterventionError
from torchlens.intervention.edits import Edit, as_edit


def _site_repr(site: Any) -> str:
    return site if isinstance(site, str) else repr(site)


@dataclass(frozen=True, eq=False)
class Rule:
    """One clause: `target` (a selector or label) and `edit`."""

    target: Any
    edit: Edit

    def __init__(self, target: Any, edit: Any, *args: Any, **kwargs: Any) -> None:
        if args or "direction" in kwargs:
            raise InterventionError("intervention_direction_invalid", "Rule takes no direction: the site decides the pass",
                                    remedy="write tl.when(tl.grad(site), edit) for a gradient edit")
        if kwargs:
            raise InterventionError("intervention_edit_invalid", f"Rule got unexpected {sorted(kwargs)}",
                                    remedy="Rule(target, edit)")
        object.__setattr__(self, "target", _check_site(target))
        object.__setattr__(self, "edit", as_edit(edit))
        if self.edit.signal == "forward" and self.signal != "forward":  # reads recorded forward state
            raise InterventionError("edit_signal_mismatch", f"{self.edit.name} reads recorded forward state; it cannot "
                                    f"edit the gradient site {_site_repr(self.target)}",
                                    remedy="use a neutral edit on gradient sites (tl.scale, tl.zero_ablate, tl.clamp, "
                                    "tl.replace_with, a callable fn(tensor, *, ctx))", edit=self.edit.name,
                                    target=_site_repr(self.target))

    @property
    def signal(self) -> str:
        universe = getattr(self.target, "universe", "activation")
        return {"gradient": "backward", "mixed": "both"}.get(universe, "forward")

    def identity(self) -> str:
        return f"{_site_repr(self.target)} -> {self.edit.identity()}"

    def __repr__(self) -> str:
        return f"Rule({_site_repr(self.target)}, {self.edit!r})"


def _check_site(site: Any) -> Any:
    from torchlens.intervention.subspace import SubspaceSite, UnitsSite
    from torchlens.select.selectors import Selector

    if isinstance(site, (str, Selector, SubspaceSite, UnitsSite)):
        return site
    raise InterventionError("intervention_site_invalid", f"a site is a selector or a label, not {type(site).__name__}",
                            remedy="tl.when(tl.module('encoder.0'), edit) or tl.when('relu_1_2', edit)")


class Recipe:
    """An immutable multi-clause intervention spec. `recipe.bind(model)` applies it to live calls."""

    __slots__ = ("_rules",)

    def __init__(self, rules: tuple[Rule, ...] = ()) -> None:
        self._rules = tuple(rules)

    @property
    def rules(self) -> tuple[Rule, ...]:
        return self._rules

    def merge(self, *others: "Recipe") -> "Recipe":
        rules = list(self._rules)
        seen = {r.identity() for r in rules}
        for other in others:
            if not isinstance(other, Recipe):
                raise InterventionError("intervention_edit_invalid", f"cannot merge a {type(other).__name__} into a Recipe",
                                        remedy="merge Recipes built with tl.when")
            for r in other.rules:
                if r.identity() in seen:
                    raise InterventionError("spec_rules_duplicate", f"the clause {r!r} is already in the recipe",
                                            remedy="drop the duplicate clause", rule=r.identity())
                seen.add(r.identity())
                rules.append(r)
        return Recipe(tuple(rules))

    def __and__(self, other: "Recipe") -> "Recipe":
        return self.merge(other)

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for r in self._rules:
            h.update(r.identity().encode())
            h.update(b"\n")
        return h.hexdigest()

    def save(self, path: Any, level: str = "portable", overwrite: bool = False) -> Any:
        """Write the rules alone as a `.tlspec` directory of kind "recipe"; `tl.load` reads it back."""
        from torchlens.io.intervention import save_intervention

        return save_intervention(self, path, level=level, overwrite=overwrite, kind="recipe")

    def bind(self, model: Any, *, backend: str | None = None, on_zero_fire: str = "warn") -> Any:
        from torchlens.intervention.live import BoundModel

        return BoundModel(model, self, backend=backend, on_zero_fire=on_zero_fire)

    def __len__(self) -> int:
        return len(self._rules)

    def __iter__(self):
        return iter(self._rules)

    def __repr__(self) -> str:
        return f"Recipe({', '.join(repr(r) for r in self._rules)})"


def when(site: Any, edit: Any) -> Recipe:
    """A one-clause Recipe: apply `edit` at `site` (a selector or a label)."""
    return Recipe((Rule(site, edit),))
