"""Scorecard honesty (issue 14 §6): capability coverage is shown apart from cell outcomes in
the shipped JSON, `torchlens scorecard`, the doctor, and the generated capability table of
docs/backends.md (checked here against the shipped records)."""

from __future__ import annotations

from pathlib import Path

import torchlens as tl
from torchlens.report.scorecard import (
    capability_row,
    capability_table,
    coverage_text,
    docs_with_table,
    read_scorecard,
    shipped_records,
)

ROOT = Path(__file__).resolve().parents[3]
BACKENDS_DOC = ROOT / "docs" / "backends.md"


def _record(caps: dict[str, str]) -> dict:
    return {"backend": "x", "maturity": "preview", "highest_tier": 2, "capabilities": caps,
            "cells": {"c0_a": {"outcome": "passed", "detail": ""}, "c1_refusal_fastlog": {"outcome": "passed", "detail": ""}}}


def test_coverage_names_every_unsupported_capability():
    rec = _record({"fastlog": "unsupported", "validation_replay": "supported", "streaming": "untested"})
    assert coverage_text(rec) == "supported 1/3; unsupported: fastlog; untested: streaming"
    from torchlens.report.scorecard import summary_lines

    cells_line, caps_line = summary_lines(rec)
    assert "cells 2/2 passed (1 of them verify a refusal)" in cells_line
    assert caps_line == "x capabilities: supported 1/3; unsupported: fastlog; untested: streaming"


def test_shipped_records_carry_coverage_apart_from_cells():
    records = shipped_records()
    assert {"torch", "jax", "reference"} <= set(records)
    for name, rec in records.items():
        caps = rec["capabilities"]
        cov = rec["coverage"]
        assert cov["supported"] == sum(v == "supported" for v in caps.values()) and cov["total"] == len(caps)
        assert cov["unsupported"] == sorted(f for f, v in caps.items() if v == "unsupported")
        counts = rec["cell_counts"]
        assert counts["total"] == len(rec["cells"])
        assert counts["refusal_checks"] == sum(1 for c, v in rec["cells"].items()
                                               if c.startswith("c1_refusal_") and v["outcome"] == "passed")
        declared = tl.backends.get_protocol(name).capabilities().as_dict()
        assert {f for f, v in caps.items() if v == "supported"} == {f for f, v in declared.items() if v}


def test_jax_scorecard_no_longer_reads_as_everything_supported():
    rec = shipped_records()["jax"]
    assert rec["cell_counts"]["failed"] == 0
    assert rec["coverage"]["supported"] < rec["coverage"]["total"]
    assert {"fastlog", "streaming"} <= set(rec["coverage"]["unsupported"])
    assert {"backward_capture", "interventions", "rng_replay", "validation_replay"} <= set(
        rec["coverage"]["supported_capabilities"])


C3_CELLS = {"c3_edit_zero_matches_oracle", "c3_edit_scale_matches_oracle", "c3_edit_replace_matches_oracle",
            "c3_patch_from_matches_oracle", "c3_noop_edit_bit_exact", "c3_grads_match_autodiff"}


def test_torch_and_jax_records_include_the_c3_cells_passing():
    """Issue 14 acceptance: the shipped torch and jax records carry the tier-3 cells, passed
    (both declare interventions and backward_capture); `--check` keeps them true."""
    records = shipped_records()
    for name in ("torch", "jax"):
        cells = records[name]["cells"]
        assert C3_CELLS <= set(cells), f"{name}: run the scorecard --write"
        bad = {c: cells[c] for c in C3_CELLS if cells[c]["outcome"] != "passed"}
        assert not bad, f"{name}: {bad}"
        assert records[name]["highest_tier"] == 3
    ref = records["reference"]["cells"]  # no autodiff: unsupported by capability, not passed or failed
    assert ref["c3_grads_match_autodiff"] == {"outcome": "unsupported", "detail": "unsupported: backward_capture"}
    assert all(ref[c]["outcome"] == "passed" for c in C3_CELLS - {"c3_grads_match_autodiff"})


def test_doctor_shows_capability_coverage():
    report = tl.report.doctor()
    for name in ("torch", "jax", "reference"):
        row = report[f"backend_capabilities:{name}"]
        rec = read_scorecard(tl.backends.get_spec(name))
        assert row.detail == coverage_text(rec) and row.detail.startswith("supported ")
        assert row.status == ("full" if rec["coverage"]["supported"] == rec["coverage"]["total"] else "partial")
        for flag in rec["coverage"]["unsupported"]:
            assert flag in row.detail
    assert capability_row(tl.backends.get_spec("jax"))["status"] == "partial"


def test_docs_capability_table_matches_the_shipped_records():
    text = BACKENDS_DOC.read_text()
    table = capability_table(shipped_records())
    assert docs_with_table(text, table) == text, "run: python -m torchlens.report --write-docs"
    for name, rec in shipped_records().items():
        assert f"`{name}`" in table
    jax_col = table.splitlines()[0].split(" | ").index("`jax`")
    row = next(line for line in table.splitlines() if line.startswith("| `interventions`"))
    assert row.split(" | ")[jax_col] == "yes"
    row = next(line for line in table.splitlines() if line.startswith("| `fastlog`"))
    assert row.split(" | ")[jax_col] == "no"


def test_the_docs_check_fails_on_a_stale_table(tmp_path):
    from torchlens.report.scorecard import main

    doc = tmp_path / "backends.md"
    doc.write_text(BACKENDS_DOC.read_text().replace("| `fastlog` |", "| `fastlog_edited` |"))
    assert main(["--check-docs", str(doc)]) == 1
    assert main(["--write-docs", str(doc)]) == 0 and doc.read_text() == BACKENDS_DOC.read_text()


def test_cli_scorecard_prints_coverage(capsys):
    from torchlens.cli import main

    assert main(["scorecard", "--backend", "jax"]) == 0
    out = capsys.readouterr().out
    rec = shipped_records()["jax"]
    assert f"jax capabilities: {coverage_text(rec)}" in out and "verify a refusal" in out
