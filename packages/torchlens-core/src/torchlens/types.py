"""Public value types that records can carry (`tl.types`).

`UnencodableValue` stands in, in a loaded artifact, for a value the save met outside the
saved format's vocabulary; `CallablePlaceholder` stands in for a saved callable, whose code
an artifact never stores. `Quantity` and its `Bytes`, `Duration`, `Flops` and `Macs` are the
plain numbers of `trace.cost` that print with their unit.
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


class Quantity:
    """Marker base of the numeric quantity wrappers (spec glossary, "Quantities"): a
    `Bytes`, `Duration`, `Flops` or `Macs` is the plain number (arithmetic, comparison and
    saving treat it as its int or float) that prints with its unit. `trace.cost` holds them."""

    __slots__ = ()
    unit = ""


class Bytes(int, Quantity):
    """A memory size in bytes; prints with a decimal prefix (`1.2 MB`)."""

    unit = "B"

    def __str__(self) -> str:
        from torchlens.viz.units import fmt_bytes

        return fmt_bytes(int(self))

    def __format__(self, spec: str) -> str:  # f"{q}" prints the unit; f"{q:,}" formats the number
        return str(self) if not spec else int.__format__(int(self), spec)


class Duration(float, Quantity):
    """A duration in seconds; prints in s, ms or us."""

    unit = "s"

    def __str__(self) -> str:
        v = float(self)
        if abs(v) >= 1 or v == 0:
            return f"{v:.3g} s"
        if abs(v) >= 1e-3:
            return f"{v * 1e3:.3g} ms"
        return f"{v * 1e6:.3g} us"

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else float.__format__(float(self), spec)


class Flops(int, Quantity):
    """A count of floating-point operations; prints with a decimal prefix (`1.2 MFLOPs`)."""

    unit = "FLOPs"

    def __str__(self) -> str:
        from torchlens.viz.units import fmt_count

        return fmt_count(int(self), "FLOPs")

    __format__ = Bytes.__format__


class Macs(int, Quantity):
    """A count of multiply-accumulates; prints with a decimal prefix (`1.2 MMACs`)."""

    unit = "MACs"

    def __str__(self) -> str:
        from torchlens.viz.units import fmt_count

        return fmt_count(int(self), "MACs")

    __format__ = Bytes.__format__


__all__ = ["UnencodableValue", "CallablePlaceholder", "AttributeWrite", "REPR_LIMIT", "Quantity", "Bytes", "Duration",
           "Flops", "Macs"]


class TraceLike:
    """The shared base of capture products (spec glossary l. 928): `tl.trace`'s `Trace`
    derives from it, so `isinstance(x, tl.types.TraceLike)` accepts any capture product
    without naming the concrete class. It defines no behaviour of its own."""

    __slots__ = ()


__all__ += ["TraceLike"]


@dataclass(frozen=True)
class Relationship:
    """How two Bundle members relate for comparison: the grade `Bundle.comparability(a, b)`
    returns and the comparison gate acts on (experimental).

    - `grade`: `"same_inputs"` (inputs proven equal, sites line up by label),
      `"same_graph"` (different or unproven inputs, equal graph-shape hashes),
      `"ordered"` (a directed path of ordering relation rows joins them),
      `"different_graph"` (same parameters, graph shapes differ, inputs not proven equal) or
      `"foreign"` (the same_param_shapes floor fails: different models).
    - `comparable`: whether the gate lets the pair through; `code` is the gate's
      `bundle_gate_*` refusal code when it does not (None otherwise).
    - `same_param_shapes`, `same_graph_shape`, `inputs_equal` (None: not provable, an
      input's payload was not saved): the facts the grade is read from.
    - `ordering_path`: the member names of the ordering path, earliest last (empty if none).
    - `shared_sites`: how many op labels line up between the two.
    """

    a: str
    b: str
    grade: str
    comparable: bool
    code: str | None
    same_param_shapes: bool
    same_graph_shape: bool
    inputs_equal: bool | None
    ordering_path: tuple[str, ...] = ()
    shared_sites: int = 0
    reasons: tuple[str, ...] = ()


__all__ += ["Relationship"]


def __getattr__(name: str) -> Any:
    # Records defined by a higher layer, served here under their spec names (lazily, so
    # this module stays at the bottom of the import graph).
    if name == "RecordingSettings":
        from torchlens.recording.settings import RecordingSettings

        return RecordingSettings
    if name in ("MergeAlignment", "MergeValueStatus"):
        from torchlens.distributed import records

        return getattr(records, name)
    raise AttributeError(f"module 'torchlens.types' has no attribute {name!r}")
