"""`python -m torchlens_conformance.scorecard --backend NAME [--write | --check | --graduation]`.

Computes the backend's scorecard by running every cell, and writes it as `scorecard.json`
into the backend's package (shipped in its wheel). `--check` recomputes and exits non-zero
on any difference from the shipped record, so the record is a tested fact.

Cell outcomes and capability coverage are reported apart: a refusal cell that passes proves
the backend refuses a capability typed, not that it has it. The record's `coverage` says
`supported k/n` and names every unsupported (and untested) capability; `cell_counts`
says how many passed cells only verify a refusal. `--summary` prints both from the shipped
record; `--write` and `--check` print them too.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from torchlens.report.scorecard import scorecard_path, summary_lines
from torchlens_conformance.cells import cells_for, make_context, run_cell, tier_of

SCHEMA = "torchlens_scorecard_v1"


def compute(name: str) -> dict[str, Any]:
    ctx = make_context(name)
    cells = {}
    for cell_id, cell in cells_for(ctx.proto).items():
        o = run_cell(ctx, cell)
        cells[cell_id] = {"outcome": o.outcome, "detail": o.detail}
    return {
        "schema": SCHEMA,
        "backend": name,
        "maturity": ctx.spec.maturity,
        "framework": {"distributions": list(ctx.spec.framework.distributions), "minimum": ctx.spec.framework.minimum,
                      "below": ctx.spec.framework.below, "pinned": ctx.spec.framework.pinned},
        "cells": cells,
        "highest_tier": highest_tier(cells),
        "capabilities": (caps := capability_summary(ctx.proto, cells)),
        "coverage": coverage(caps),
        "cell_counts": cell_counts(cells),
    }


def coverage(capabilities: dict[str, str]) -> dict[str, Any]:
    """Capability coverage, apart from cell outcomes: how many of the capability flags the
    backend supports, and each one it does not (refused typed) or that is untested."""
    supported = sorted(f for f, v in capabilities.items() if v == "supported")
    unsupported = sorted(f for f, v in capabilities.items() if v == "unsupported")
    untested = sorted(f for f, v in capabilities.items() if v == "untested")
    return {"supported": len(supported), "total": len(capabilities), "supported_capabilities": supported,
            "unsupported": unsupported, "untested": untested}


def cell_counts(cells: dict[str, dict]) -> dict[str, int]:
    """Cells by outcome; `refusal_checks` counts the passed cells that only verify a refusal."""
    out = {k: sum(1 for c in cells.values() if c["outcome"] == k) for k in ("passed", "failed", "unsupported")}
    out["total"] = len(cells)
    out["refusal_checks"] = sum(1 for cid, c in cells.items() if cid.startswith("c1_refusal_") and c["outcome"] == "passed")
    return out


def highest_tier(cells: dict[str, dict]) -> int:
    """The highest tier t such that no cell of tier <= t failed and some cell of tier t passed."""
    best = -1
    for t in (0, 1, 2, 3):
        mine = [c for cid, c in cells.items() if tier_of(cid) == t]
        below_ok = all(c["outcome"] != "failed" for cid, c in cells.items() if tier_of(cid) <= t)
        if below_ok and any(c["outcome"] == "passed" for c in mine):
            best = t
        else:
            break
    return best


def capability_summary(proto: Any, cells: dict[str, dict]) -> dict[str, str]:
    """supported | unsupported | untested per capability flag."""
    out = {}
    for flag, value in proto.capabilities().as_dict().items():
        if value:
            out[flag] = "supported"
        else:
            cell = cells.get(f"c1_refusal_{flag}", {})
            out[flag] = "unsupported" if cell.get("outcome") == "passed" else "untested"
    return out


def graduation_report(record: dict[str, Any]) -> str:
    cells = record["cells"]
    failed = [c for c, v in cells.items() if v["outcome"] == "failed"]
    unsupported = [c for c, v in cells.items() if v["outcome"] == "unsupported"]
    lines = [f"graduation report for {record['backend']} ({record['maturity']})",
             f"  highest tier: {record['highest_tier']} (durable is 2)",
             f"  cells: {sum(v['outcome'] == 'passed' for v in cells.values())}/{len(cells)} passed",
             f"  capabilities: {coverage(record['capabilities'])['supported']}/{len(record['capabilities'])} supported"]
    lines += [f"  failed: {c}: {cells[c]['detail']}" for c in failed]
    lines += [f"  unsupported: {c}: {cells[c]['detail']}" for c in unsupported]
    ready = not failed and not unsupported and record["highest_tier"] >= 2
    lines.append(f"  every graduation item met: {'yes' if ready else 'no'}")
    return "\n".join(lines)


def _dump(record: dict[str, Any]) -> str:
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    import torchlens as tl

    parser = argparse.ArgumentParser(prog="torchlens_conformance.scorecard")
    parser.add_argument("--backend", required=True)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the shipped scorecard.json")
    mode.add_argument("--check", action="store_true", help="recompute and fail on any difference")
    mode.add_argument("--graduation", action="store_true", help="print the graduation report from the shipped record")
    mode.add_argument("--summary", action="store_true",
                      help="print cell outcomes and capability coverage from the shipped record")
    args = parser.parse_args(argv)
    try:
        spec = tl.backends.get_spec(args.backend)
    except tl.errors.BackendUnsupportedError as exc:  # one line, not a traceback (issue 27)
        print(f"{parser.prog}: {exc.message}; installed backends: {', '.join(sorted(tl.backends.specs())) or 'none'}",
              file=sys.stderr)
        return 2
    path = scorecard_path(spec)
    if args.graduation or args.summary:
        if path is None or not path.is_file():
            print(f"no shipped scorecard for {args.backend}", file=sys.stderr)
            return 1
        shipped = json.loads(path.read_text())
        print(graduation_report(shipped) if args.graduation else "\n".join(summary_lines(shipped)))
        return 0
    record = compute(args.backend)
    text = _dump(record)
    if args.write:
        if path is None:
            print(f"cannot locate the package of backend {args.backend}", file=sys.stderr)
            return 1
        path.write_text(text)
        print(f"wrote {path}")
        print("\n".join(summary_lines(record)))
        return 0
    if args.check:
        shipped = path.read_text() if path is not None and path.is_file() else None
        if shipped != text:
            print(f"scorecard for {args.backend} differs from the shipped record {path}", file=sys.stderr)
            if shipped is not None:
                old_record = json.loads(shipped)
                old = old_record.get("cells", {})
                for cid, cell in record["cells"].items():
                    if old.get(cid) != cell:
                        print(f"  {cid}: shipped {old.get(cid)} now {cell}", file=sys.stderr)
                if old_record.get("coverage") != record["coverage"]:
                    print(f"  coverage: shipped {old_record.get('coverage')} now {record['coverage']}", file=sys.stderr)
            return 1
        print(f"scorecard for {args.backend} matches {path}")
        print("\n".join(summary_lines(record)))
        return 0
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
