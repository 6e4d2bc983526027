"""Test helpers for the "loading never runs code" promise (docs/guides/security.md).

`rewrite_records` edits a saved `.tlspec` the way an attacker would: change record cells,
then recompute every digest, size and disclosure count in the manifest, so the loader's
integrity checks pass and only the callable table stands between the file and code.
Shared by the core, torch and jax `test_security_callables*` files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from torchlens.io.manifest import render

#: Shell/Python payloads write this file; a test fails if it ever appears.
MARKER_NAME = "PWNED_MARKER"


def exec_source(marker: Path) -> str:
    """Python source that writes the marker file when executed."""
    return f"open({str(marker)!r}, 'w').write('code ran')"


def _count_callables(obj: Any) -> int:
    if isinstance(obj, dict):
        return int("$callable" in obj and len(obj) == 1) + sum(_count_callables(v) for v in obj.values())
    if isinstance(obj, list):
        return sum(_count_callables(v) for v in obj)
    return 0


def _count_unencodable(obj: Any, types: dict[str, int]) -> None:
    if isinstance(obj, dict):
        body = obj.get("$unencodable")
        if len(obj) == 1 and isinstance(body, list) and body and isinstance(body[0], str):
            types[body[0]] = types.get(body[0], 0) + 1
        for v in obj.values():
            _count_unencodable(v, types)
    elif isinstance(obj, list):
        for v in obj:
            _count_unencodable(v, types)


def rewrite_records(path: Path, edit: Callable[[dict[str, dict[str, Any]]], None]) -> None:
    """Apply `edit` to the parsed record tables ({kind: {"schema", "columns", "rows"}}),
    write them back and recompute the manifest's file digests, sizes and callable count."""
    path = Path(path)
    tables = {p.stem: json.loads(p.read_bytes()) for p in sorted((path / "records").glob("*.json"))}
    edit(tables)
    manifest = json.loads((path / "manifest.json").read_bytes())
    for kind, table in tables.items():
        data = json.dumps(table, separators=(",", ":")).encode("ascii")
        name = f"records/{kind}.json"
        (path / name).write_bytes(data)
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    manifest["disclosures"]["callable_placeholders"] = sum(_count_callables(t["rows"]) for t in tables.values())
    types: dict[str, int] = {}
    for t in tables.values():
        _count_unencodable(t["rows"], types)
    manifest["disclosures"]["unencodable_types"] = types
    manifest["disclosures"]["unencodable_values"] = sum(types.values())
    manifest["counts"] = {k: len(t["rows"]) for k, t in tables.items()}
    (path / "manifest.json").write_bytes(render(manifest))


def cell(tables: dict, kind: str, label: str, column: str) -> tuple[list, int]:
    """(row, column index) of record `label` (first column) in table `kind`."""
    t = tables[kind]
    col = t["columns"].index(column)
    for row in t["rows"]:
        if row[0] == label:
            return row, col
    raise KeyError(label)


def set_cell(tables: dict, kind: str, label: str, column: str, value: Any) -> None:
    row, col = cell(tables, kind, label, column)
    row[col] = value


def replace_cell(tables: dict, kind: str, label: str, column: str, value: Any) -> None:
    """Set a cell, keeping whatever payloads the old cell referenced referenced from the
    trace's annotations (so the edit leaves no orphan payload record behind)."""
    row, col = cell(tables, kind, label, column)
    old, row[col] = row[col], value
    if "$payload" in json.dumps(old):
        trow = tables["trace"]["rows"][0]
        acol = tables["trace"]["columns"].index("annotations")
        trow[acol]["$dict"].append([f"kept_{kind}_{label}_{column}", old])


def add_to_dict(tables: dict, kind: str, label: str, column: str, key: str, value: Any) -> None:
    """Add one entry to a `$dict` cell (keeping what it held)."""
    row, col = cell(tables, kind, label, column)
    row[col]["$dict"].append([key, value])


def tup(*items: Any) -> dict:
    """A `$tuple` cell."""
    return {"$tuple": list(items)}


def argref(index: int) -> dict:
    return {"$argref": [index, None]}


def dct(**items: Any) -> dict:
    """A `$dict` cell with string keys."""
    return {"$dict": [[k, v] for k, v in items.items()]}
