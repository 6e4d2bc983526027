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

    def to_dataframe(self) -> Any:
        from torchlens.viz.tables import ops_dataframe

        return ops_dataframe(self._trace, self._ops)

    def __repr__(self) -> str:
        head = ", ".join(self.labels[:6]) + (", ..." if len(self._ops) > 6 else "")
        return f"<Selection of {len(self._ops)} op{'s' if len(self._ops) != 1 else ''}: {head}>"
