"""Public value types that records can carry (`tl.types`).

`UnencodableValue` stands in, in a loaded artifact, for a value the save met outside the
saved format's vocabulary; `CallablePlaceholder` stands in for a saved callable, whose code
an artifact never stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: `UnencodableValue.repr_text` is cut at this many characters.
REPR_LIMIT = 256


@dataclass(frozen=True)
class UnencodableValue:
    """A value with no typed encoding, as a loaded artifact carries it.

    - `type_name`: the original type's dotted name (`module.qualname`).
    - `repr_text`: its repr, cut at 256 characters.
    - `at`: where it sat in the artifact: `"<record kind>[<row>].<column>"` plus a path
      into the cell when it was nested (`"ops[3].meta['rng'][0]"`).
    """

    type_name: str
    repr_text: str
    at: str

    @staticmethod
    def describe(value: Any) -> tuple[str, str]:
        """(type_name, repr_text) a save writes for `value`."""
        t = type(value)
        try:
            text = repr(value)
        except Exception as exc:  # a broken __repr__ must not break the save
            text = f"<repr failed: {type(exc).__name__}>"
        return f"{t.__module__}.{t.__qualname__}", text[:REPR_LIMIT]


@dataclass(frozen=True)
class CallablePlaceholder:
    """A saved callable: its name and where it sat, never its code.

    A load turns an op's placeholder back into a callable only through the backend's closed
    callable table; an op left with one is opaque, and replaying it refuses with
    `opaque_op_not_replayable` before anything runs. Calling a placeholder directly raises
    `ArtifactError` code `callable_not_persisted`.
    """

    qualname: str
    at: str = ""

    @staticmethod
    def describe(fn: Any) -> str:
        """`module.qualname` of a callable: the name saved for one no backend table names."""
        module = getattr(fn, "__module__", None) or type(fn).__module__
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__qualname__
        return f"{module}.{name}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torchlens.errors import ArtifactError

        raise ArtifactError("callable_not_persisted", f"{self.qualname} was saved as a placeholder, not as code",
                            remedy="capture again from the live model to run this op", qualname=self.qualname, at=self.at)


@dataclass(frozen=True)
class AttributeWrite:
    """One plain instance attribute a module's forward wrote during a capture.

    - `kind`: "added", "replaced" (a rebinding or an in-place change) or "removed".
    - `value`: what the forward left: the object itself when it bound a new one, a copy when
      it changed the original in place (containers copied, tensors cloned), None when removed.
    """

    kind: str
    value: Any = None


__all__ = ["UnencodableValue", "CallablePlaceholder", "AttributeWrite", "REPR_LIMIT"]
