"""Issue 24: explicit torch.distributed collectives captured as collective boundary ops, and
rank-local traces merged with `tl.merge_ranks`.

Real process groups: this file is also the launcher (`python test_distributed_capture.py
MODE OUTDIR WORLD_SIZE`), which `torch.multiprocessing.spawn`s the ranks with gloo on the
loopback; the tests run it in a subprocess with a timeout, so a hang fails instead of
blocking. Each rank saves its traces and a JSON of in-rank checks; the parent merges and
checks against single-process computations. Two launches in all (2 ranks, 4 ranks).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torchlens as tl

D_IN, D_HID, D_OUT, BATCH = 4, 8, 3, 2
TIMEOUT = 150


# --- models ----------------------------------------------------------------------------------
def weights() -> dict:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(*s, generator=g, dtype=torch.float64) for k, s in
            (("w1", (D_HID, D_IN)), ("b1", (D_HID,)), ("w2", (D_OUT, D_HID)), ("b2", (D_OUT,)), ("x", (BATCH, D_IN)))}


def unsharded(w: dict) -> torch.Tensor:
    """The single-process MLP, by hand."""
    return torch.relu(w["x"] @ w["w1"].T + w["b1"]) @ w["w2"].T + w["b2"]


class TensorParallelMLP(torch.nn.Module):
    """Column-parallel fc1 (rows of w1), row-parallel fc2 (columns of w2), one all_reduce."""

    def __init__(self, w: dict, rank: int, ws: int) -> None:
        super().__init__()
        k = D_HID // ws
        sl = slice(rank * k, (rank + 1) * k)
        self.w1 = torch.nn.Parameter(w["w1"][sl].clone())
        self.b1 = torch.nn.Parameter(w["b1"][sl].clone())
        self.w2 = torch.nn.Parameter(w["w2"][:, sl].clone())
        self.b2 = torch.nn.Parameter(w["b2"].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.nn.functional.linear(x, self.w1, self.b1))
        y = torch.nn.functional.linear(h, self.w2)
        dist.all_reduce(y)
        return y + self.b2


class PairMLP(TensorParallelMLP):
    """The tensor-parallel MLP over a 2-rank subgroup (rank % 2 is the shard)."""

    def __init__(self, w: dict, rank: int, group) -> None:
        super().__init__(w, rank % 2, 2)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.nn.functional.linear(x, self.w1, self.b1))
        y = torch.nn.functional.linear(h, self.w2)
        dist.all_reduce(y, group=self.group)
        return y + self.b2


class Stage0(torch.nn.Module):
    def __init__(self, w: dict) -> None:
        super().__init__()
        self.w1, self.b1 = torch.nn.Parameter(w["w1"].clone()), torch.nn.Parameter(w["b1"].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.nn.functional.linear(x, self.w1, self.b1))
        dist.send(h, dst=1)
        return h


class Stage1(torch.nn.Module):
    def __init__(self, w: dict) -> None:
        super().__init__()
        self.w2, self.b2 = torch.nn.Parameter(w["w2"].clone()), torch.nn.Parameter(w["b2"].clone())

    def forward(self, like: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(like)
        dist.recv(h, src=0)
        return torch.nn.functional.linear(h, self.w2, self.b2)


class Misc(torch.nn.Module):
    """all_gather, all_gather_into_tensor, reduce_scatter_tensor, broadcast, isend/irecv."""

    def forward(self, x: torch.Tensor) -> tuple:
        rank, ws = dist.get_rank(), dist.get_world_size()
        a = x * (rank + 1)
        parts = [torch.zeros_like(a) for _ in range(ws)]
        dist.all_gather(parts, a)
        cat = torch.zeros((ws * a.shape[0],) + tuple(a.shape[1:]), dtype=a.dtype)
        dist.all_gather_into_tensor(cat, a)
        rs = torch.zeros_like(a)
        dist.reduce_scatter_tensor(rs, torch.cat([a, a + 1]))
        b = a + 10
        dist.broadcast(b, src=0)
        if rank == 0:
            dist.isend(a * 2, dst=1).wait()
            got = a
        else:
            got = torch.zeros_like(a)
            dist.irecv(got, src=0).wait()
        return parts[0] + parts[1], cat, rs, b, got


# --- the launcher (runs in the spawned ranks) ----------------------------------------------------
def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _codes(fn) -> str | None:
    try:
        fn()
    except tl.errors.TorchLensError as exc:
        return exc.code
    return None


def _worker(rank: int, ws: int, port: int, out: str, mode: str) -> None:
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    originals = {n: getattr(dist, n) for n in ("all_reduce", "send", "recv", "broadcast")}
    record = tl.distributed.arm()  # at process start, before the group exists
    dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=timedelta(seconds=60))
    res: dict = {"arming": record.source, "epoch": record.install_epoch}
    w = weights()
    t = tl.trace(TensorParallelMLP(w, rank, ws), w["x"])
    res["tp_validates"] = t.validate_forward_pass()
    res["tp_scope"] = t.provenance.distributed_scope
    t.save(f"{out}/tp{rank}.tlspec")
    if mode == "four":  # two tensor-parallel pairs, each on its own subgroup
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        sub = tl.trace(PairMLP(w, rank, pairs[rank // 2]), w["x"])
        res["pair_validates"] = sub.validate_forward_pass()
        sub.save(f"{out}/pair{rank}.tlspec")
    if mode == "two":
        if rank == 0:
            p = tl.trace(Stage0(w), w["x"])
        else:
            p = tl.trace(Stage1(w), torch.zeros(BATCH, D_HID, dtype=torch.float64))
        res["pp_validates"] = p.validate_forward_pass()
        p.save(f"{out}/pp{rank}.tlspec")
        x = torch.arange(4.0).reshape(2, 2) + 1
        m = tl.trace(Misc(), x)
        res["misc_validates"] = m.validate_forward_pass()
        res["misc_kinds"] = sorted(o.meta["collective"]["kind"] for o in m._ops.values() if "collective" in o.meta)
        m.save(f"{out}/misc{rank}.tlspec")
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(torch.nn.Linear(D_IN, D_OUT).double())
        res["ddp_code"] = _codes(lambda: tl.trace(ddp, w["x"]))
        inner = tl.trace(ddp.module, w["x"])  # the documented remedy captures
        res["ddp_module_ops"] = len(inner._ops)
        res["ddp_module_scope"] = inner.provenance.distributed_scope
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (ws,))
        lin = torch.nn.Linear(D_IN, D_HID).double()
        lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
        res["dtensor_code"] = _codes(lambda: tl.trace(lin, w["x"]))
        dist.barrier()
    tl.distributed.disarm()
    res["restored"] = all(getattr(dist, n) is f for n, f in originals.items())
    Path(f"{out}/res{rank}.json").write_text(json.dumps(res))
    dist.barrier()  # no rank tears its gloo pairs down while a peer still uses them (gloo can abort then)
    dist.destroy_process_group()


def _launch(tmp: Path, mode: str, ws: int) -> list[dict]:
    proc = subprocess.run([sys.executable, __file__, mode, str(tmp), str(ws)], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp / f"res{r}.json").read_text()) for r in range(ws)]


if __name__ == "__main__":
    import torch.multiprocessing as mp

    _mode, _out, _ws = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mp.spawn(_worker, args=(_ws, _free_port(), _out, _mode), nprocs=_ws, join=True)
    sys.exit(0)


# --- tests (parent process) --------------------------------------------------------------------
@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist2")
    return tmp, _launch(tmp, "two", 2)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist4")
    return tmp, _launch(tmp, "four", 4)


@pytest.mark.parametrize("ws", [2, 4])
def test_tensor_parallel_mlp_merges_to_the_unsharded_output(ws, two, four):
    tmp, res = two if ws == 2 else four
    assert all(r["tp_validates"] for r in res)  # each rank's trace validates (lockstep replay)
    assert all(r["tp_scope"] == "rank_local_shard" and r["arming"] == "explicit" for r in res)
    assert all(r["restored"] for r in res)  # disarm put the very same callables back
    paths = [tmp / f"tp{r}.tlspec" for r in range(ws)]
    merged = tl.merge_ranks(paths)
    assert not isinstance(merged, tl.Trace)
    assert torch.allclose(merged.output, unsharded(weights()), rtol=1e-6, atol=1e-6)
    # every all_reduce: one op per rank, joined into one merged collective with all ranks contributing
    assert len(merged.collectives) == 1
    c = merged.collectives[0]
    assert c.kind == "all_reduce" and sorted(c.ops) == list(range(ws))
    assert c.contributing_ranks == tuple(range(ws)) and c.value_status == "proven"
    traces = [tl.load(p) for p in paths]
    assert merged.num_ops == sum(len(t._ops) for t in traces)
    # the all_reduce's own values: the sum of the ranks' contributions (independent check)
    contrib = []
    for t in traces:
        op = next(o for o in t._ops.values() if o.func_name == "all_reduce")
        parent = next(o for o in t._ops.values() if o.event_id == op.parent_slots[0][0])
        contrib.append(parent.out)
        assert tl.distributed.boundary(op)["correlation_key"]["seq"] == 0
    assert torch.allclose(sum(contrib), op.out, rtol=1e-12, atol=1e-12)


def test_subgroup_collectives_correlate_per_group(four):
    tmp, res = four
    assert all(r["pair_validates"] for r in res)  # lockstep replay on each subgroup
    merged = tl.merge_ranks([tmp / f"pair{r}.tlspec" for r in range(4)])
    groups = sorted((c.contributing_ranks, c.key[0]) for c in merged.collectives)
    assert [g[0] for g in groups] == [(0, 1), (2, 3)] and groups[0][1] != groups[1][1]  # two group uids
    assert all(c.value_status == "proven" for c in merged.collectives)
    for pair in ((0, 1), (2, 3)):
        m = tl.merge_ranks([tmp / f"pair{r}.tlspec" for r in pair])  # a pair merges on its own
        assert torch.allclose(m.output, unsharded(weights()), rtol=1e-6, atol=1e-6)
    with pytest.raises(tl.errors.ArtifactError) as exc:
        tl.merge_ranks([tmp / "pair0.tlspec", tmp / "pair2.tlspec"])  # each misses its partner
    assert exc.value.code == "merge_boundary_unmatched"


def test_pipeline_send_recv_merges_across_the_edge(two):
    tmp, res = two
    assert all(r["pp_validates"] for r in res)
    merged = tl.merge_ranks([tmp / "pp0.tlspec", tmp / "pp1.tlspec"])
    t0, t1 = tl.load(tmp / "pp0.tlspec"), tl.load(tmp / "pp1.tlspec")
    assert merged.num_ops == len(t0._ops) + len(t1._ops)
    start = next(n for n in merged.inputs() if n[0] == 0)
    end = next(n for n in merged.output_nodes() if n[0] == 1)
    path = merged.path(start, end)
    assert path is not None
    crossing = [(a, b) for a, b in zip(path, path[1:]) if a[0] != b[0]]
    assert len(crossing) == 1
    a, b = crossing[0]
    assert t0._ops[a[1]].func_name == "send" and t1._ops[b[1]].func_name == "recv"
    assert torch.allclose(merged.output, unsharded(weights()), rtol=1e-12, atol=1e-12)


def test_other_collectives_and_async_recorded_and_proven(two):
    tmp, res = two
    assert all(r["misc_validates"] for r in res)
    assert res[0]["misc_kinds"] == sorted(["all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                                           "broadcast", "isend"])
    assert res[1]["misc_kinds"] == sorted(["all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                                           "broadcast", "irecv"])
    merged = tl.merge_ranks([tmp / "misc0.tlspec", tmp / "misc1.tlspec"])
    status = {c.kind: c.value_status for c in merged.collectives}
    assert status == {"all_gather": "proven", "all_gather_into_tensor": "proven",
                      "reduce_scatter_tensor": "unproven", "broadcast": "proven", "isend": "proven"}
    x = torch.arange(4.0).reshape(2, 2) + 1
    out0, out1 = merged.outputs[0], merged.outputs[1]
    assert torch.equal(out0[0], x + 2 * x) and torch.equal(out0[1], torch.cat([x, 2 * x]))
    assert torch.equal(out0[2], x + 2 * x) and torch.equal(out1[2], (x + 1) + (2 * x + 1))  # reduce-scatter chunks
    assert torch.equal(out1[3], x + 10) and torch.equal(out1[4], 2 * x)  # broadcast from 0, irecv of 2x


def test_ddp_and_dtensor_refuse_with_documented_codes(two):
    _, res = two
    assert all(r["ddp_code"] == "distributed_wrapper_unsupported" for r in res)
    assert all(r["dtensor_code"] == "distributed_sharded_state_unsupported" for r in res)
    assert all(r["ddp_module_ops"] > 0 and r["ddp_module_scope"] is None for r in res)
    doc = (Path(__file__).resolve().parents[3] / "docs" / "guides" / "distributed.md").read_text()
    assert "distributed_wrapper_unsupported" in doc and "distributed_sharded_state_unsupported" in doc


def test_two_runs_report_without_raising_and_merge_refuses(two, four):
    (t2, _), (t4, _) = two, four
    items = [t2 / "tp0.tlspec", t4 / "tp1.tlspec"]
    report = tl.merge_report(items)
    assert not report.ok
    assert any(p["code"] == "merge_run_mismatch" for p in report.problems)
    assert "NOT mergeable" in report.summary()
    with pytest.raises(tl.errors.ArtifactError) as exc:
        tl.merge_ranks(items)
    assert exc.value.code == "merge_run_mismatch"
    # a rank missing: the report names it, the merge refuses typed
    report = tl.merge_report([t4 / "tp0.tlspec", t4 / "tp1.tlspec"])
    assert [v.alignment for v in report.verdicts] == ["missing_peer"] and "rank 2 not given" in report.verdicts[0].detail
    with pytest.raises(tl.errors.ArtifactError) as exc:
        tl.merge_ranks([t4 / "tp0.tlspec", t4 / "tp1.tlspec"])
    assert exc.value.code == "merge_boundary_unmatched"


def test_tampered_boundary_refuses(two):
    tmp, _ = two
    t0, t1 = tl.load(tmp / "tp0.tlspec"), tl.load(tmp / "tp1.tlspec")
    op = next(o for o in t1._ops.values() if o.func_name == "all_reduce")
    with torch.no_grad():
        op.out.add_(1.0)  # the value no longer matches what the boundary proved at capture
    report = tl.merge_report([t0, t1])
    assert [p["code"] for p in report.problems] == ["merge_artifact_tampered"]
    with pytest.raises(tl.errors.ArtifactError) as exc:
        tl.merge_ranks([t0, t1])
    assert exc.value.code == "merge_artifact_tampered"
    with pytest.raises(tl.errors.ArtifactError) as exc:
        tl.merge_ranks([t0, t0])
    assert exc.value.code == "merge_duplicate_rank"


def test_merged_draw_has_a_cluster_per_rank_and_collective_edges(four, tmp_path):
    tmp, _ = four
    merged = tl.merge_ranks([tmp / f"tp{r}.tlspec" for r in range(4)])
    dot = merged.draw(tmp_path / "m.dot")
    assert (tmp_path / "m.dot").read_text() == dot
    assert [f"subgraph cluster_rank{r} " in dot for r in range(4)] == [True] * 4
    bold = [line for line in dot.splitlines() if "style=bold" in line]
    assert len(bold) == len(merged.collective_edges()) == 4 * 3  # each rank's contribution into each other rank
    assert all('"r' in line and "->" in line for line in bold)


def test_arm_disarm_restore_exactly_without_a_group():
    from torchlens_torch.backend import TorchBackend

    before = {n: getattr(dist, n) for n in ("all_reduce", "all_gather", "send", "recv", "isend", "irecv")}
    capture = TorchBackend.__dict__["capture"]
    with tl.distributed.arming() as record:
        assert record.source == "explicit" and tl.distributed.armed() == record
        assert dist.all_reduce is not before["all_reduce"]
        t = tl.trace(torch.nn.Linear(2, 2), torch.ones(1, 2))  # no group: an ordinary capture
        assert t.provenance.distributed_scope is None and t.provenance.extra["distributed"]["boundaries"] == 0
    assert tl.distributed.armed() is None
    from torchlens_torch.distributed import lazy_arm

    assert lazy_arm() is None and tl.distributed.armed() is None  # no initialised group: nothing to arm
    assert all(getattr(dist, n) is f for n, f in before.items()) and TorchBackend.__dict__["capture"] is capture
    with pytest.raises(tl.errors.InvalidArgumentError) as exc:
        tl.merge_ranks([tl.trace(torch.nn.Linear(2, 2), torch.ones(1, 2))])  # not an armed capture
    assert exc.value.code == "merge_input_invalid"
