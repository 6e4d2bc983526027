"""Issue 24, framework-free: the distributed records and the merge derivation on hand-built
rank traces (no framework, no process group; the real multi-process runs are in
torchlens-torch/tests/test_distributed_capture.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import torchlens as tl
from torchlens.distributed import GroupIdentity, MergeAlignment, MergeValueStatus
from torchlens.distributed.records import ArmingRecord, check_boundary, membership_digest

ARM = ArmingRecord(1, "snap", "explicit").as_dict()


def _group(ranks=(0, 1)) -> GroupIdentity:
    return GroupIdentity.of(ranks, "gloo")


def _payload(kind, rank, seq=0, role="contributor_receiver", c=("a",), r=("s",), run="run1", ranks=(0, 1),
             channel="collective", **geo):
    g = _group(ranks)
    return {"schema": "collective_boundary_v1", "kind": kind,
            "correlation_key": {"group_uid": list(g.group_uid), "seq": seq, "channel": channel},
            "rank": rank, "group_rank": list(ranks).index(rank), "world_size": len(ranks), "group": g.as_dict(),
            "geometry": {"role": role, "contributed": [{"shape": [2], "dtype": "float32"}] * len(c),
                         "received": [{"shape": [2], "dtype": "float32"}] * len(r), **geo},
            "proof": {"contributed_digest": list(c), "received_digest": list(r), "reduce_op": geo.get("reduce_op")},
            "notes": [], "lifetime": {"ordinal_source": "first_use_order"}, "arming": ARM, "run_id": run}


def _op(label, eid, kind="op", func="relu", parents=(), meta=None):
    return SimpleNamespace(label=label, event_id=eid, kind=kind, func_name=func, parent_slots=tuple(parents),
                           saved=False, meta=meta or {}, outs=(None,))


def _trace(rank, payload, run="run1"):
    ops = [_op("input_1", 0, "input", "input"), _op("linear_1_1", 1, func="linear", parents=[(0, 0)])]
    if payload is not None:
        ops.append(_op("allreduce_1_2", 2, func=payload["kind"], parents=[(1, 0)], meta={"collective": payload}))
    ops.append(_op("output_1", 3, "output", "output", parents=[(ops[-1].event_id, 0)]))
    extra = {"distributed": {"rank": rank, "world_size": 2, "run_id": run, "arming": ARM}}
    return SimpleNamespace(_ops={o.label: o for o in ops}, provenance=SimpleNamespace(extra=extra), backend="none")


def test_group_identity_and_boundary_schema():
    g = _group((0, 2, 1))
    assert g.group_uid == (membership_digest((0, 1, 2), "gloo"), 0) and g.global_ranks == (0, 2, 1)
    assert GroupIdentity.from_dict(g.as_dict()) == g
    forged = dict(g.as_dict(), global_ranks=[0, 1])  # ranks changed, digest kept
    with pytest.raises(tl.errors.ArtifactError) as exc:
        GroupIdentity.from_dict(forged)
    assert exc.value.code == "merge_artifact_tampered"
    p = _payload("all_reduce", 0, reduce_op="sum")
    assert check_boundary(p) is p
    for broken in ({**p, "kind": "gather"}, {**p, "proof": {**p["proof"], "received_digest": []}},
                   {**p, "schema": "v0"}, {k: v for k, v in p.items() if k != "arming"}):
        with pytest.raises(tl.errors.ArtifactError) as exc:
            check_boundary(broken)
        assert exc.value.code == "merge_artifact_tampered"


def test_aligned_all_reduce_is_joined_once_with_both_contributors():
    traces = [_trace(r, _payload("all_reduce", r, c=(f"c{r}",), reduce_op="sum")) for r in (0, 1)]
    report = tl.merge_report(traces)
    assert report.ok and [(v.alignment, v.value_status) for v in report.verdicts] == [("aligned", "proven")]
    merged = tl.merge_ranks(traces)
    assert merged.num_ops == 8 and len(merged.collectives) == 1
    c = merged.collectives[0]
    assert c.ops == {0: "allreduce_1_2", 1: "allreduce_1_2"} and c.contributing_ranks == (0, 1)
    # each contributor's input op feeds the other rank's all_reduce
    assert sorted(merged.collective_edges()) == [((0, "linear_1_1"), (1, "allreduce_1_2")),
                                                 ((1, "linear_1_1"), (0, "allreduce_1_2"))]
    assert merged.path((0, "input_1"), (1, "output_1")) == [(0, "input_1"), (0, "linear_1_1"), (1, "allreduce_1_2"),
                                                           (1, "output_1")]


@pytest.mark.parametrize("case, alignment, value, code", [
    ("contradicted", MergeAlignment.ALIGNED, MergeValueStatus.CONTRADICTED, "merge_boundary_mismatch"),
    ("kind", MergeAlignment.KIND_MISMATCH, MergeValueStatus.UNPROVEN, "merge_boundary_mismatch"),
    ("reduce_op", MergeAlignment.GEOMETRY_MISMATCH, MergeValueStatus.UNPROVEN, "merge_boundary_mismatch"),
    ("missing", MergeAlignment.MISSING_PEER, MergeValueStatus.UNPROVEN, "merge_boundary_unmatched"),
])
def test_conflicts_report_without_raising_and_merge_refuses_typed(case, alignment, value, code):
    p0 = _payload("all_reduce", 0, reduce_op="sum")
    p1 = {"contradicted": _payload("all_reduce", 1, r=("other",), reduce_op="sum"),
          "kind": _payload("all_gather", 1, r=("s", "t")),
          "reduce_op": _payload("all_reduce", 1, reduce_op="max"),
          "missing": None}[case]
    traces = [_trace(0, p0), _trace(1, p1)]
    report = tl.merge_report(traces)  # never raises on a conflict
    assert not report.ok
    assert [(v.alignment, v.value_status) for v in report.verdicts] == [(alignment, value)]
    with pytest.raises(tl.errors.ArtifactError) as exc:
        tl.merge_ranks(traces)
    assert exc.value.code == code


def test_runs_duplicates_and_bad_input():
    a, b = _trace(0, _payload("all_reduce", 0, reduce_op="sum")), _trace(1, _payload("all_reduce", 1, run="run2",
                                                                                       reduce_op="sum"), run="run2")
    report = tl.merge_report([a, b])
    assert [p["code"] for p in report.problems] == ["merge_run_mismatch"]
    assert report.verdicts[0].alignment == MergeAlignment.RUN_MISMATCH
    with pytest.raises(tl.errors.ArtifactError) as exc:
        tl.merge_ranks([a, b])
    assert exc.value.code == "merge_run_mismatch"
    with pytest.raises(tl.errors.ArtifactError) as exc:
        tl.merge_ranks([a, a])
    assert exc.value.code == "merge_duplicate_rank"
    for bad in ("rank0.tlspec", [], [object()]):
        with pytest.raises(tl.errors.InvalidArgumentError) as exc:
            tl.merge_report(bad)
        assert exc.value.code == "merge_input_invalid"
    plain = _trace(0, None)
    plain.provenance.extra = {}
    with pytest.raises(tl.errors.InvalidArgumentError) as exc:
        tl.merge_ranks([plain])
    assert exc.value.code == "merge_input_invalid"


def test_distributed_scope_is_checked_against_its_vocabulary():
    from torchlens.records.trace import Provenance

    assert Provenance(backend="x").distributed_scope is None
    assert Provenance(backend="x", extra={"distributed_scope": "rank_local_shard"}).distributed_scope == "rank_local_shard"
    assert "distributed_scope" in Provenance(backend="x").unavailable
    with pytest.raises(tl.errors.ArtifactError) as exc:
        Provenance(backend="x", extra={"distributed_scope": "whole_model"}).distributed_scope
    assert exc.value.code == "distributed_scope_invalid"


def test_unloadable_path_is_a_report_problem_and_a_merge_refusal(tmp_path):
    good = _trace(0, _payload("all_reduce", 0, reduce_op="sum"))
    missing = tmp_path / "rank1.tlspec"
    report = tl.merge_report([good, missing])  # reports, does not raise
    codes = [p["code"] for p in report.problems]
    assert len(codes) == 1 and codes[0].startswith("artifact_")
    assert report.verdicts[0].alignment == MergeAlignment.MISSING_PEER
    with pytest.raises(tl.errors.TorchLensError) as exc:
        tl.merge_ranks([good, missing])
    assert exc.value.code == codes[0]
