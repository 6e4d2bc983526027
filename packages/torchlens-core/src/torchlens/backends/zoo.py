"""A backend's zoo of small models (`BackendSpec.zoo`), read the same way everywhere.

Entries are dicts (`model`, `args`, `kwargs`, optional `reseed` callable that puts the
framework's random stream in a fixed state, optional `compiled_reference`) or
`(model, args, kwargs)` tuples.

`compiled_reference` is a sentence saying why the model's own forward runs a compiled kernel
that the capture evaluates step by step (a JAX `fori_loop` is one fused XLA loop; the capture
unrolls it primitive by primitive), so the two cannot be bit-equal on every processor. Cells
then compare that entry's outputs with its reference at a tolerance derived from the dtype
(`reference_tolerance`) and say so; every other entry is compared bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class ZooEntry:
    name: str
    model: Any
    args: tuple
    kwargs: dict
    reseed: Callable[[], None] | None = None
    compiled_reference: str | None = None


def load_zoo(spec: Any) -> dict[str, ZooEntry]:
    """The backend's zoo as `ZooEntry`s (this imports the backend's framework)."""
    if spec.zoo is None:
        return {}
    out = {}
    for name, entry in spec.zoo().items():
        if isinstance(entry, dict):
            out[name] = ZooEntry(name, entry["model"], tuple(entry.get("args", ())), dict(entry.get("kwargs") or {}),
                                 entry.get("reseed"), entry.get("compiled_reference"))
        else:
            model, args, kwargs = entry
            out[name] = ZooEntry(name, model, tuple(args), dict(kwargs or {}))
    return out


#: Units in the last place a compiled kernel may differ from step-by-step evaluation, per
#: element, for one fused region (fused multiply-adds and vectorised transcendental
#: approximations differ by a few ulp; a short loop compounds them).
REFERENCE_ULPS = 32


def reference_tolerance(dtype: Any) -> tuple[float, float] | None:
    """(rtol, atol) for comparing a compiled reference with a step-by-step capture of a
    floating dtype (`REFERENCE_ULPS` machine epsilons), or None for exact dtypes."""
    import numpy as np

    try:
        eps = float(np.finfo(dtype).eps)
    except (TypeError, ValueError):
        return None
    return REFERENCE_ULPS * eps, REFERENCE_ULPS * eps
