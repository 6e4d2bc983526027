"""A backend's zoo of small models (`BackendSpec.zoo`), read the same way everywhere.

Entries are dicts (`model`, `args`, `kwargs`, optional `reseed` callable that puts the
framework's random stream in a fixed state) or `(model, args, kwargs)` tuples.
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


def load_zoo(spec: Any) -> dict[str, ZooEntry]:
    """The backend's zoo as `ZooEntry`s (this imports the backend's framework)."""
    if spec.zoo is None:
        return {}
    out = {}
    for name, entry in spec.zoo().items():
        if isinstance(entry, dict):
            out[name] = ZooEntry(name, entry["model"], tuple(entry.get("args", ())), dict(entry.get("kwargs") or {}),
                                 entry.get("reseed"))
        else:
            model, args, kwargs = entry
            out[name] = ZooEntry(name, model, tuple(args), dict(kwargs or {}))
    return out
