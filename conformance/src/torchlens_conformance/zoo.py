"""Zoo entries for the suite: core's `ZooEntry` (read by `torchlens.backends.zoo`) plus the
tier-3 oracle an entry supplies under its `c3` key.

A zoo entry's `c3` value is a plain dict written in the backend's own framework code (so the
backend package imports nothing from this suite):

- `site`: the label of a mid-graph op of the entry's trace (a pass-qualified label for a
  repeated layer).
- `forward(tap, *args, **kwargs)`: the model's computation written by hand, returning the
  model's outputs. At each op output it reproduces it calls `tap(label, value)` and carries
  on with the value `tap` returns, so the suite can edit the site (and, for gradients, watch
  any tapped op). It must reach `site`.
- `other_args` / `other_kwargs`: inputs for a second capture, the donor of `patch_from`.
- `loss(outputs)`: a scalar of the model's outputs, in framework code.
- `backward(trace, loss)`: runs `trace.backward(...)` with that loss in the form the backend
  takes (a loss value for torch, a callable of the outputs for jax).
- `grads(loss, *args, **kwargs)`: `{label: gradient}` of `loss(forward(...))` with respect to
  each tapped op output, by the framework's own autodiff of the hand forward.
- `grads_not_applicable`: a sentence saying why the entry supplies no gradient oracle (in
  place of `loss`/`backward`/`grads`); `not_applicable`: why it supplies no oracle at all.

An entry without a `c3` key fails the tier-3 cells: not applicable is a named, counted
reason, never a silent pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torchlens.backends.zoo import REFERENCE_ULPS, ZooEntry, reference_tolerance

__all__ = ["ZooEntry", "EditOracle", "load_zoo", "reference_tolerance", "REFERENCE_ULPS"]


@dataclass(frozen=True)
class EditOracle:
    """An entry's hand-written ("edited") forward and what the tier-3 cells need around it."""

    site: str
    forward: Callable[..., Any]
    other_args: tuple = ()
    other_kwargs: dict = field(default_factory=dict)
    loss: Callable[[Any], Any] | None = None
    backward: Callable[[Any, Any], Any] | None = None
    grads: Callable[..., dict] | None = None
    grads_not_applicable: str | None = None

    @classmethod
    def from_dict(cls, name: str, d: dict) -> "EditOracle":
        missing = [k for k in ("site", "forward", "other_args") if k not in d]
        if missing:
            raise ValueError(f"zoo entry {name!r}: c3 oracle lacks {missing}")
        grad_keys = [k for k in ("loss", "backward", "grads") if d.get(k) is not None]
        if len(grad_keys) not in (0, 3):
            raise ValueError(f"zoo entry {name!r}: c3 needs all of loss, backward and grads (has {grad_keys})")
        if not grad_keys and not d.get("grads_not_applicable"):
            raise ValueError(f"zoo entry {name!r}: c3 supplies no gradient oracle and no grads_not_applicable reason")
        return cls(d["site"], d["forward"], tuple(d["other_args"]), dict(d.get("other_kwargs") or {}),
                   d.get("loss"), d.get("backward"), d.get("grads"), d.get("grads_not_applicable"))


@dataclass
class ConformanceEntry(ZooEntry):
    """A `ZooEntry` with its tier-3 oracle (`c3`), or the reason it has none
    (`c3_not_applicable`), or neither (`c3` None and no reason: the entry fails tier 3)."""

    c3: EditOracle | None = None
    c3_not_applicable: str | None = None
    c3_error: str | None = None


def load_zoo(spec: Any) -> dict[str, ConformanceEntry]:
    """The backend's zoo, read once: core's entry fields plus the `c3` oracle (this imports
    the backend's framework)."""
    if spec.zoo is None:
        return {}
    out: dict[str, ConformanceEntry] = {}
    for name, entry in spec.zoo().items():
        if isinstance(entry, dict):
            e = ConformanceEntry(name, entry["model"], tuple(entry.get("args", ())), dict(entry.get("kwargs") or {}),
                                 entry.get("reseed"), entry.get("compiled_reference"))
            c3 = entry.get("c3")
            if isinstance(c3, dict) and c3.get("not_applicable"):
                e.c3_not_applicable = str(c3["not_applicable"])
            elif isinstance(c3, dict):
                try:
                    e.c3 = EditOracle.from_dict(name, c3)
                except ValueError as exc:
                    e.c3_error = str(exc)
        else:
            model, args, kwargs = entry
            e = ConformanceEntry(name, model, tuple(args), dict(kwargs or {}))
        out[name] = e
    return out
