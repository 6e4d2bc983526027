"""Scorecard honesty in the suite (issue 14 §6, issue 27): a backend that supplies no models
passes no model cell, and the record separates cell outcomes from capability coverage."""

from __future__ import annotations

import dataclasses

import pytest

import torchlens as tl
from torchlens_conformance import cells as C
from torchlens_conformance.scorecard import cell_counts, coverage

#: Cells that need no model: the provider-API tier.
NO_MODEL_CELLS = {"c0_protocol_complete", "c0_framework_requirement_consistent", "c0_refusal_codes_registered",
                  "c0_capability_table_complete"}


@pytest.mark.parametrize("zoo_factory", ["empty", "missing"])
def test_no_cell_that_runs_models_passes_without_models(zoo_factory):
    from torchlens_conformance.zoo import load_zoo

    ctx = C.make_context("reference")
    spec = dataclasses.replace(ctx.spec, zoo=(lambda: {}) if zoo_factory == "empty" else None)
    ctx = C.Context(spec, ctx.proto, load_zoo(spec))
    outcomes = {cid: C.run_cell(ctx, cell) for cid, cell in C.cells_for(ctx.proto).items()}
    passed = {cid for cid, o in outcomes.items() if o.outcome == "passed"}
    assert passed == NO_MODEL_CELLS
    for cid, o in outcomes.items():
        if cid not in NO_MODEL_CELLS:
            assert o.outcome == "failed" and "supplies no models" in o.detail, (cid, o)


def test_refusal_codes_cell_checks_them_against_capabilities(monkeypatch):
    ctx = C.make_context("reference")
    monkeypatch.setattr(type(ctx.proto), "refusal_codes", lambda self: frozenset({"trace_option_unsupported"}))
    out = C.run_cell(ctx, C.c0_refusal_codes_registered)
    assert out.outcome == "failed" and "omits" in out.detail


def test_record_separates_coverage_from_cells():
    caps = {"a": "supported", "b": "unsupported", "c": "untested"}
    assert coverage(caps) == {"supported": 1, "total": 3, "supported_capabilities": ["a"], "unsupported": ["b"],
                              "untested": ["c"]}
    cells = {"c0_x": {"outcome": "passed"}, "c1_refusal_b": {"outcome": "passed"}, "c1_y": {"outcome": "failed"}}
    assert cell_counts(cells) == {"passed": 2, "failed": 1, "unsupported": 0, "total": 3, "refusal_checks": 1}


def test_summary_mode_prints_coverage(capsys):
    from torchlens_conformance.scorecard import main

    assert main(["--backend", "reference", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "reference capabilities: supported 3/9; unsupported: backward_capture" in out
    assert tl.report.doctor()["backend_capabilities:reference"].detail in out
