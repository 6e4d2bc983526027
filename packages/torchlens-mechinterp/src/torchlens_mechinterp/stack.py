"""`ComponentStack`: a decomposition of one captured tensor into literal rows.

Each row is a named writer (an op's captured output), a VERIFIED constant, or (diagnostic
stacks only) an `unresolved_remainder`. The grade says which:

* ``complete``: every row is a named writer;
* ``closed_constant``: the non-writer rows are verified constants (a bias);
* ``closed_unresolved``: a diagnostic stack (``strict=False``) with an unresolved remainder.

There is no OPEN grade: a stack that does not close is refused, never constructed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchlens.errors import MechInterpError

GRADES = ("complete", "closed_constant", "closed_unresolved")
ROW_KINDS = ("writer", "constant", "unresolved_remainder")


@dataclass(frozen=True)
class StackRow:
    """One row: `name` (a component name: ``embed``, ``transformer.h.0.attn``, ``neuron[5]``, ...),
    `kind` (writer / constant / unresolved_remainder), `value` (the literal tensor), `label`
    (the pass-qualified op label it was read from, None for computed rows), `site` (that op's
    site key), `module` (the component's module address) and `parts` (for a writer that is a
    sum of several branches, e.g. a parallel block's attention + MLP: their op labels)."""

    name: str
    kind: str
    value: Any
    label: str | None = None
    site: Any = None
    module: str | None = None
    component: str = "other"
    parts: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpineStep:
    """One spine step of a residual walk: the add op (`label`, pass-qualified, with its `site`
    key), the spine state it produced, the writer operand and the value-preserving hops crossed
    (each ``(label, func_name)``) between this step and the next state down the spine."""

    label: str
    site: Any
    writer_label: str
    spine_label: str
    hops: tuple[tuple[str, str], ...] = ()


@dataclass
class ComponentStack:
    """A decomposition `target == sum(rows)` (in row order, in the captured dtype).

    `rows` are `StackRow` records; `grade` one of ``GRADES``; `target_label` the op whose value
    the rows sum to; `receipt` the facts of the check that closed it."""

    rows: list[StackRow]
    grade: str
    target_label: str | None = None
    steps: list[SpineStep] = field(default_factory=list)
    receipt: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.grade not in GRADES:
            raise MechInterpError("mi_stack_open", f"a ComponentStack cannot have grade {self.grade!r}",
                                  remedy=f"grades: {', '.join(GRADES)}; a stack that does not close is refused",
                                  grade=self.grade)
        kinds = {r.kind for r in self.rows}
        if not kinds <= set(ROW_KINDS):
            raise MechInterpError("mi_stack_open", f"unknown row kinds {sorted(kinds - set(ROW_KINDS))}",
                                  remedy=f"row kinds: {', '.join(ROW_KINDS)}", grade=self.grade)
        if ("unresolved_remainder" in kinds) != (self.grade == "closed_unresolved"):
            raise MechInterpError("mi_stack_open", "only a closed_unresolved stack has an unresolved_remainder row",
                                  remedy="grade the stack by its rows", grade=self.grade)

    @property
    def diagnostic_only(self) -> bool:
        return self.grade == "closed_unresolved"

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, key: Any) -> StackRow:
        if isinstance(key, str):
            for r in self.rows:
                if r.name == key:
                    return r
            raise KeyError(key)
        return self.rows[key]

    def stacked(self) -> Any:
        """The row values stacked along a new first axis (broadcast to the target's shape)."""
        import torch

        shape = torch.broadcast_shapes(*(tuple(r.value.shape) for r in self.rows))
        return torch.stack([r.value.expand(shape) for r in self.rows])

    def total(self) -> Any:
        """The rows summed in order, in their own dtype (the replay of the forward's adds)."""
        acc = self.rows[0].value
        for r in self.rows[1:]:
            acc = acc + r.value
        return acc

    def summary(self) -> str:
        lines = [f"ComponentStack[{self.grade}] -> {self.target_label} ({len(self.rows)} rows)"]
        for r in self.rows:
            extra = f" parts={list(r.parts)}" if r.parts else ""
            lines.append(f"  {r.kind:<20} {r.name:<40} {r.label or '':<18} {r.component}{extra}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<ComponentStack {self.grade}: {len(self.rows)} rows -> {self.target_label}>"


__all__ = ["ComponentStack", "StackRow", "SpineStep", "GRADES"]
