"""Every installed backend against every conformance cell, and the suite's own behaviour."""

import json


import torchlens as tl
from torchlens_conformance import cells as C
from torchlens_conformance.scorecard import compute, highest_tier


def test_cell(conformance_case, conformance_outcome):
    """A cell passes, or reports a typed refusal; it never fails. Stable backends pass all."""
    name, cell_id = conformance_case
    assert conformance_outcome.outcome != "failed", f"{name} {cell_id}: {conformance_outcome.detail}"
    if tl.backends.get_spec(name).maturity == "stable":
        assert conformance_outcome.outcome == "passed", f"stable backend {name}: {cell_id} {conformance_outcome}"


def test_reference_cells_include_refusals_for_each_false_flag():
    ctx = C.make_context("reference")
    ids = set(C.cells_for(ctx.proto))
    for flag, value in ctx.proto.capabilities().as_dict().items():
        assert (f"c1_refusal_{flag}" in ids) == (not value)
    assert "c1_refusal_trace_option_stop_after" in ids and "c1_refusal_trace_option_intervene" not in ids


def test_validation_cell_catches_a_backend_that_does_not_validate(monkeypatch):
    ctx = C.make_context("reference")
    monkeypatch.setattr(type(ctx.proto), "validate", lambda self, t, g=None: tl.backends.ValidationStatus(True))
    out = C.run_cell(ctx, C.c1_validation_names_reason)
    assert out.outcome == "failed" and "corrupted" in out.detail


def test_graph_integrity_cell_catches_a_dropped_edge(monkeypatch):
    ctx = C.make_context("reference")
    real = ctx.trace

    def broken(entry, **kw):
        t = real(entry, **kw)
        op = next(o for o in t.ops if o.kind == "op" and o.parents)
        t.ops[op.parents[0]].children.remove(op.label)
        return t

    monkeypatch.setattr(ctx, "trace", broken)
    out = C.run_cell(ctx, C.c1_graph_integrity)
    assert out.outcome == "failed" and "does not list child" in out.detail


def test_intermediates_cell_catches_a_wrong_output(monkeypatch):
    ctx = C.make_context("reference")
    real = ctx.trace

    def broken(entry, **kw):
        t = real(entry, **kw)
        out = t.output_ops[0]
        out._outputs = (out.out + 1,)
        return t

    monkeypatch.setattr(ctx, "trace", broken)
    assert C.run_cell(ctx, C.c1_intermediates_match).outcome == "failed"


def test_untyped_exception_is_failed_and_refusal_is_unsupported():
    ctx = C.make_context("reference")

    def boom(ctx):
        raise ZeroDivisionError("x")

    def refuse(ctx):
        ctx.proto.capabilities().refuse_unless("streaming")

    assert C.run_cell(ctx, boom).outcome == "failed"
    assert C.run_cell(ctx, refuse) == C.Outcome("unsupported", "refused: streaming_unsupported")


def test_highest_tier():
    cells = {"c0_a": {"outcome": "passed"}, "c1_b": {"outcome": "passed"}, "c2_c": {"outcome": "unsupported"}}
    assert highest_tier(cells) == 1
    cells["c2_c"] = {"outcome": "passed"}
    assert highest_tier(cells) == 2
    cells["c1_b"] = {"outcome": "failed"}
    assert highest_tier(cells) == 0


def test_shipped_scorecards_match_a_fresh_computation():
    """What `--check` does in CI, for every installed backend that ships a record."""
    from torchlens.report.scorecard import scorecard_path

    checked = 0
    for name, spec in tl.backends.specs().items():
        path = scorecard_path(spec)
        if path is None or not path.is_file():
            continue
        shipped = json.loads(path.read_text())
        assert shipped == compute(name), f"{name}: shipped scorecard is stale; run --write"
        checked += 1
    assert checked >= 1


def test_stable_backends_pass_every_cell_in_their_shipped_record():
    from torchlens.report.scorecard import read_scorecard

    for name, spec in tl.backends.specs().items():
        if spec.maturity != "stable":
            continue
        record = read_scorecard(spec)
        assert record is not None, f"stable backend {name} ships no scorecard"
        bad = {c: v for c, v in record["cells"].items() if v["outcome"] != "passed"}
        assert not bad, f"stable backend {name}: {bad}"


def test_reference_match_is_exact_unless_the_entry_declares_a_compiled_reference():
    import numpy as np

    from torchlens_conformance.zoo import REFERENCE_ULPS, ZooEntry

    ref = np.linspace(-1, 1, 12, dtype=np.float32)
    one_ulp = np.nextafter(ref, np.float32(2))
    far = ref + np.float32(4 * REFERENCE_ULPS) * np.finfo(np.float32).eps
    exact = ZooEntry("exact", None, (), {})
    compiled = ZooEntry("compiled", None, (), {}, compiled_reference="one fused loop, evaluated step by step")
    assert C._matches_reference(exact, ref, ref.copy())
    assert not C._matches_reference(exact, ref, one_ulp)           # bit for bit by default
    assert C._matches_reference(compiled, ref, one_ulp)            # a few ulp allowed when declared
    assert not C._matches_reference(compiled, ref, far)            # but not more
    assert not C._matches_reference(compiled, ref, ref.astype(np.float64))  # dtype must still agree
    ints = np.arange(4)
    assert not C._matches_reference(compiled, ints, ints + 1)      # exact dtypes get no tolerance
