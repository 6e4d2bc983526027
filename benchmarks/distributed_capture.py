"""Capture overhead of a tensor-parallel MLP on 4 ranks (gloo on the loopback, CPU).

    python benchmarks/distributed_capture.py [--ranks 4] [--repeat 20] [--hidden 256]

Each rank times (median of --repeat, interleaved, after a warm-up) the plain
forward unarmed, the same forward armed (column-parallel fc1, row-parallel fc2, one `all_reduce`)
and `tl.trace` of it, all in lockstep with the other ranks (a barrier before each call). Rank 0 prints
the per-rank medians and the ratio capture / plain measured in this one run, plus the
unarmed plain forward (what arming costs a forward outside any capture). Results go to
benchmarks/results/distributed_capture.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _worker(rank: int, ws: int, port: int, repeat: int, hidden: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import torchlens as tl

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)

    class TP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(rank)
            self.fc1 = torch.nn.Parameter(torch.randn(hidden // ws, 64, generator=g))
            self.fc2 = torch.nn.Parameter(torch.randn(64, hidden // ws, generator=g))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, self.fc1)), self.fc2)
            dist.all_reduce(y)
            return y

    model, x = TP(), torch.randn(8, 64)

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    runs: dict[str, list[float]] = {"unarmed": [], "plain": [], "capture": []}
    with torch.no_grad():
        model(x)
        with tl.distributed.arming():
            tl.trace(model, x)  # warm-up
        for _ in range(repeat):  # interleaved, so load changes hit the three alike
            runs["unarmed"].append(timed(lambda: model(x)))
            tl.distributed.arm()
            runs["plain"].append(timed(lambda: model(x)))
            runs["capture"].append(timed(lambda: tl.trace(model, x)))
            tl.distributed.disarm()
    unarmed, plain, capture = (sorted(v)[len(v) // 2] for v in runs.values())
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"unarmed": unarmed, "plain": plain, "capture": capture}, f)
    dist.destroy_process_group()


def main() -> None:
    import tempfile

    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        mp.spawn(_worker, args=(a.ranks, _port(), a.repeat, a.hidden, out), nprocs=a.ranks, join=True)
        res = [json.load(open(f"{out}.{r}")) for r in range(a.ranks)]
    for r, v in enumerate(res):
        print(f"rank {r}: unarmed {v['unarmed'] * 1e3:.3f} ms, armed plain {v['plain'] * 1e3:.3f} ms, "
              f"capture {v['capture'] * 1e3:.3f} ms")
    worst = max(v["capture"] / v["plain"] for v in res)
    mean = sum(v["capture"] / v["plain"] for v in res) / len(res)
    armed = max(v["plain"] / v["unarmed"] for v in res)
    print(f"{a.ranks}-rank TP MLP: capture / plain = {mean:.1f}x (mean over ranks), {worst:.1f}x (worst rank); "
          f"armed plain / unarmed = {armed:.2f}x")
    import platform

    import torch

    result = {"ranks": a.ranks, "repeat": a.repeat, "hidden": a.hidden, "backend": "gloo", "per_rank_median_s": res,
              "ratio_capture_plain_mean": mean, "ratio_capture_plain_worst": worst, "ratio_armed_unarmed_worst": armed,
              "machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
              "python": platform.python_version(), "torch": torch.__version__}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "distributed_capture.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
