"""Reading a backend's shipped scorecard record (`<package>/scorecard.json`).

The record is written by `python -m torchlens_conformance.scorecard --backend NAME --write`.
Reading it imports neither the backend package nor its framework.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

DURABLE_TIER = 2


def scorecard_path(spec: Any) -> Path | None:
    """Where the backend's package ships `scorecard.json` (found without importing it)."""
    top = (spec.namespace or "").split(".")[0]
    if not top:
        return None
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    return Path(list(found.submodule_search_locations)[0]) / "scorecard.json"


def read_scorecard(spec: Any) -> dict[str, Any] | None:
    path = scorecard_path(spec)
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {"cells": {}, "corrupt": True}


def scorecard_row(spec: Any) -> dict[str, str]:
    """The doctor's `backend_scorecard:<name>` row: status, detail and suggestion."""
    from torchlens.backends.registry import install_hint

    fw = spec.framework
    installed = fw.installed_version()
    record = read_scorecard(spec)
    cells: dict[str, dict] = (record or {}).get("cells", {})
    passed = sum(1 for c in cells.values() if c.get("outcome") == "passed")
    unsupported = sum(1 for c in cells.values() if c.get("outcome") == "unsupported")
    failed = [name for name, c in cells.items() if c.get("outcome") == "failed"]
    detail = (f"{spec.maturity}; {passed}/{len(cells)} cells passed, {unsupported} unsupported, {len(failed)} failed; "
              f"pinned {fw.pinned}, installed {installed or 'absent'}, supported [{fw.minimum}, {fw.below}]")
    detail = detail[:-1] + ")"
    if installed is None:
        status, suggestion = "scope", install_hint(fw.extra or spec.name)
    elif record is None:
        status, suggestion = "not_tested", f"python -m torchlens_conformance.scorecard --backend {spec.name} --write"
    elif failed or record.get("corrupt"):
        status, suggestion = "known_broken", f"first failed cell: {failed[0] if failed else 'record unreadable'}"
    elif record.get("highest_tier", 0) >= DURABLE_TIER:
        status, suggestion = "pass", ""
    else:
        status, suggestion = "not_tested", f"the durable tier has not run for {spec.name}"
    return {"key": f"backend_scorecard:{spec.name}", "label": f"{spec.name} backend scorecard", "status": status,
            "detail": detail, "suggestion": suggestion}
