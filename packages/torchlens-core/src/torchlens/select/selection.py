"""Selection: the ordered ops a selector resolved to."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from torchlens.errors import SelectorCompositionError

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.op import Op
    from torchlens.records.trace import Trace


class Selection:
    """Ops matched by a selector, in trace order. Iterate it, index it, or read `.first()`."""

    __slots__ = ("_trace", "_ops", "selector")

    def __init__(self, trace: "Trace", ops: list["Op"], selector: Any = None) -> None:
        self._trace = trace
        self._ops = ops
        self.selector = selector

    def __len__(self) -> int:
        return len(self._ops)

    def __iter__(self) -> Iterator["Op"]:
        return iter(self._ops)

    def __getitem__(self, i: int) -> "Op":
        return self._ops[i]

    def __bool__(self) -> bool:
        return bool(self._ops)

    @property
    def ops(self) -> list["Op"]:
        return list(self._ops)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(o.label for o in self._ops)

    @property
    def outs(self) -> list[Any]:
        return [o.out for o in self._ops]

    def first(self) -> "Op":
        if not self._ops:
            raise SelectorCompositionError("selector_no_match", f"{self.selector!r} matched no op in this trace",
                                           remedy="check the selector against trace.labels or trace.modules.labels",
                                           selector=repr(self.selector))
        return self._ops[0]

    def last(self) -> "Op":
        self.first()
        return self._ops[-1]

    @property
    def signal(self) -> str:
        """Which pass the matched sites belong to: "backward" for gradient sites
        (`tl.grad(...)`), "forward" for activation sites, "both" for a union of the two."""
        universe = getattr(self.selector, "universe", "activation")
        return {"gradient": "backward", "mixed": "both"}.get(universe, "forward")

    def _repr_html_(self) -> str:
        from torchlens.viz.tables import selection_html

        return selection_html(self)

    def to_dataframe(self) -> Any:
        """One row per matched op, with a `signal` column ("forward" or "backward"; for a
        union of both universes, each op's own: "both" when both branches match it)."""
        from torchlens.viz.tables import ops_dataframe

        df = ops_dataframe(self._trace, self._ops)
        df["signal"] = self._signals()
        return df

    def _signals(self) -> list[str]:
        if self.signal != "both":
            return [self.signal] * len(self._ops)
        grad_labels: set[str] = set()
        act_labels: set[str] = set()

        def walk(sel: Any) -> None:
            if sel.universe == "mixed":  # a union: split it into its branches
                walk(sel.a)
                walk(sel.b)
            elif sel.universe == "gradient":
                grad_labels.update(sel.match_set(self._trace))
            else:
                act_labels.update(sel.match_set(self._trace))

        walk(self.selector)
        return ["both" if o.label in grad_labels and o.label in act_labels
                else "backward" if o.label in grad_labels else "forward" for o in self._ops]

    def __repr__(self) -> str:
        head = ", ".join(self.labels[:6]) + (", ..." if len(self._ops) > 6 else "")
        return f"<Selection of {len(self._ops)} op{'s' if len(self._ops) != 1 else ''}: {head}>"
