"""`python -m torchlens_conformance.scorecard --backend NAME [--write | --check | --graduation]`.

Computes the backend's scorecard by running every cell, and writes it as `scorecard.json`
into the backend's package (shipped in its wheel). `--check` recomputes and exits non-zero
on any difference from the shipped record, so the record is a tested fact.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from torchlens.report.scorecard import scorecard_path
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
        "capabilities": capability_summary(ctx.proto, cells),
    }


def highest_tier(cells: dict[str, dict]) -> int:
    """The highest tier t such that no cell of tier <= t failed and some cell of tier t passed."""
    best = -1
    for t in (0, 1, 2):
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
             f"  cells: {sum(v['outcome'] == 'passed' for v in cells.values())}/{len(cells)} passed"]
    lines += [f"  failed: {c}: {cells[c]['detail']}" for c in failed]
    lines += [f"  unsupported: {c}: {cells[c]['detail']}" for c in unsupported]
    ready = not failed and not unsupported and record["highest_tier"] == 2
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
    args = parser.parse_args(argv)
    try:
        spec = tl.backends.get_spec(args.backend)
    except tl.errors.BackendUnsupportedError as exc:  # one line, not a traceback (issue 27)
        print(f"{parser.prog}: {exc.message}; installed backends: {', '.join(sorted(tl.backends.specs())) or 'none'}",
              file=sys.stderr)
        return 2
    path = scorecard_path(spec)
    if args.graduation:
        if path is None or not path.is_file():
            print(f"no shipped scorecard for {args.backend}", file=sys.stderr)
            return 1
        print(graduation_report(json.loads(path.read_text())))
        return 0
    record = compute(args.backend)
    text = _dump(record)
    if args.write:
        if path is None:
            print(f"cannot locate the package of backend {args.backend}", file=sys.stderr)
            return 1
        path.write_text(text)
        print(f"wrote {path}")
        return 0
    if args.check:
        shipped = path.read_text() if path is not None and path.is_file() else None
        if shipped != text:
            print(f"scorecard for {args.backend} differs from the shipped record {path}", file=sys.stderr)
            if shipped is not None:
                old = json.loads(shipped)["cells"]
                for cid, cell in record["cells"].items():
                    if old.get(cid) != cell:
                        print(f"  {cid}: shipped {old.get(cid)} now {cell}", file=sys.stderr)
            return 1
        print(f"scorecard for {args.backend} matches {path}")
        return 0
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
