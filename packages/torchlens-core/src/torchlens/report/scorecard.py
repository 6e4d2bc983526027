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


# capability coverage (apart from cell outcomes) -------------------------------------------------

def coverage_of(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The record's capability coverage (`supported`, `total`, `unsupported`, `untested`),
    recomputed from its `capabilities` summary when an older record has no `coverage`."""
    if not record or not isinstance(record.get("capabilities"), dict):
        return None
    caps = record["capabilities"]
    return {"supported": sum(1 for v in caps.values() if v == "supported"), "total": len(caps),
            "unsupported": sorted(f for f, v in caps.items() if v == "unsupported"),
            "untested": sorted(f for f, v in caps.items() if v == "untested")}


def coverage_text(record: dict[str, Any] | None) -> str:
    """`supported k/n; unsupported: a, b; untested: c` (or why there is no coverage)."""
    cov = coverage_of(record)
    if cov is None:
        return "no capability record"
    text = f"supported {cov['supported']}/{cov['total']}"
    if cov["unsupported"]:
        text += "; unsupported: " + ", ".join(cov["unsupported"])
    if cov["untested"]:
        text += "; untested: " + ", ".join(cov["untested"])
    return text


def summary_lines(record: dict[str, Any]) -> list[str]:
    """Two lines for people: cell outcomes (with how many passed cells only verify a
    refusal), then capability coverage."""
    cells: dict[str, dict] = record.get("cells", {})
    count = {k: sum(1 for c in cells.values() if c.get("outcome") == k) for k in ("passed", "failed", "unsupported")}
    refusals = sum(1 for cid, c in cells.items() if cid.startswith("c1_refusal_") and c.get("outcome") == "passed")
    name = record.get("backend", "?")
    return [f"{name} ({record.get('maturity', '?')}): cells {count['passed']}/{len(cells)} passed "
            f"({refusals} of them verify a refusal), {count['unsupported']} unsupported, {count['failed']} failed; "
            f"highest tier {record.get('highest_tier', '?')}",
            f"{name} capabilities: {coverage_text(record)}"]


def capability_row(spec: Any) -> dict[str, str]:
    """The doctor's `backend_capabilities:<name>` row: capability coverage from the shipped
    record, shown apart from the cells (a passed refusal cell is not a supported capability)."""
    record = read_scorecard(spec)
    cov = coverage_of(record)
    if cov is None:
        status = "not_tested"
    elif cov["untested"]:
        status = "untested"
    else:
        status = "full" if cov["supported"] == cov["total"] else "partial"
    return {"key": f"backend_capabilities:{spec.name}", "label": f"{spec.name} backend capabilities", "status": status,
            "detail": coverage_text(record),
            "suggestion": "" if status in ("full", "partial") else
            f"python -m torchlens_conformance.scorecard --backend {spec.name} --write"}


_TABLE_BEGIN = "<!-- capability-table:begin (generated: python -m torchlens.report --write-docs) -->"
_TABLE_END = "<!-- capability-table:end -->"
_MARK = {"supported": "yes", "unsupported": "no", "untested": "not yet proven"}


def capability_table(records: dict[str, dict[str, Any]]) -> str:
    """The Markdown capability table of `docs/backends.md`: one column per backend, one row
    per capability flag, then the coverage line, from the shipped scorecard records."""
    names = sorted(records)
    flags = sorted({f for r in records.values() for f in (r.get("capabilities") or {})})
    lines = ["| capability | " + " | ".join(f"`{n}`" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for flag in flags:
        cells = [_MARK.get((records[n].get("capabilities") or {}).get(flag, ""), "?") for n in names]
        lines.append(f"| `{flag}` | " + " | ".join(cells) + " |")
    covs = [coverage_of(records[n]) for n in names]
    lines.append("| **supported** | " + " | ".join(f"{c['supported']}/{c['total']}" if c else "?" for c in covs) + " |")
    return "\n".join(lines)


def shipped_records() -> dict[str, dict[str, Any]]:
    """name -> shipped scorecard record, for every registered backend that ships one."""
    from torchlens.backends.registry import specs

    out = {}
    for name, spec in specs().items():
        record = read_scorecard(spec)
        if record is not None:
            out[name] = record
    return out


def docs_with_table(text: str, table: str) -> str:
    """`text` with the block between the capability-table markers replaced by `table`."""
    start, end = text.find(_TABLE_BEGIN), text.find(_TABLE_END)
    if start < 0 or end < start:
        raise ValueError("the capability-table markers are missing")
    return text[:start + len(_TABLE_BEGIN)] + "\n" + table + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    """`python -m torchlens.report --write-docs [PATH] | --check-docs [PATH]`: write or check
    the capability table in docs/backends.md from the shipped records."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m torchlens.report")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write-docs", nargs="?", const="docs/backends.md", metavar="PATH")
    mode.add_argument("--check-docs", nargs="?", const="docs/backends.md", metavar="PATH")
    args = parser.parse_args(argv)
    path = Path(args.write_docs or args.check_docs)
    old = path.read_text()
    new = docs_with_table(old, capability_table(shipped_records()))
    if args.write_docs:
        path.write_text(new)
        print(f"wrote the capability table into {path}")
        return 0
    if new != old:
        print(f"{path}: the capability table differs from the shipped scorecards; run --write-docs", file=sys.stderr)
        return 1
    print(f"{path}: the capability table matches the shipped scorecards")
    return 0

