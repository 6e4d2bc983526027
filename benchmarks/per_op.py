"""Per-op capture cost: what `tl.trace` adds to each torch call, next to the floor of
op-level capture (a bare `TorchFunctionMode` that clones every tensor output).

Workloads (random init, nothing downloaded):
- `tiny`: a forward of N tiny ops (`tanh` then `+ 1` on a 4-element tensor, N/2 times in a
  loop; N = 2,000 by default), reported as microseconds per op and as ratios to the floor;
- `resnet`: the ResNet-like CNN of `capture.py` (ResNet-18 layout) on 1x3x64x64;
- `mobilenet`: a MobileNet-style CNN of `capture.py` (inverted residuals with depthwise
  convs, many small ops) on 1x3x64x64.

Variants, interleaved in one process (order rotates each round, `capture.measure`: a
collection of the whole heap before each timed call; `--collect young` collects only what the
variants made since the warm-up), median over rounds: plain forward, the cloning floor, `tl.trace(save="none")`,
`tl.trace(save="all")`. The CNN
rows also give ratios to the plain forward (the issue's acceptance figure).
Results go to `benchmarks/results/per_op.json` (or `--out`).

    python benchmarks/per_op.py                       # all workloads, 1 thread, 15 rounds, wall clock
    python benchmarks/per_op.py --clock cpu           # CPU time: steadier on a shared machine
    python benchmarks/per_op.py --workloads tiny --rounds 31
    python benchmarks/per_op.py --profile tiny        # cProfile of tl.trace(save="all"), top 30

`results/per_op_before.json` holds the same run on the tree before issue 26's changes.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import capture as B  # noqa: E402 - the shared models

RESULTS = Path(__file__).resolve().parent / "results" / "per_op.json"


class TinyOps(nn.Module):
    """`n` tiny ops: `tanh` then `+ 1`, `n // 2` times, on whatever tensor it is given."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.half = n // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.half):
            x = torch.tanh(x) + 1
        return x


class CloningMode(TorchFunctionMode):
    """The floor of op-level capture: see every call, clone every tensor output, keep it."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.kept.append(out.detach().clone())
        elif isinstance(out, (tuple, list)):
            self.kept.append([o.detach().clone() if isinstance(o, torch.Tensor) else o for o in out])
        return out


def floor_run(model: nn.Module, x: torch.Tensor) -> list[Any]:
    mode = CloningMode()
    with mode:
        model(x)
    return mode.kept


def workload(name: str, n_ops: int) -> tuple[nn.Module, torch.Tensor, str]:
    if name == "tiny":
        return TinyOps(n_ops).eval(), torch.randn(4), f"{n_ops} tiny ops (tanh, +1) on a 4-element tensor"
    if name == "resnet":
        m, x = B.resnet_like()
        return m, x, "ResNet-like CNN, 1x3x64x64"
    if name == "mobilenet":
        m, x = B.mobilenet_like()
        return m, x, "MobileNet-style CNN (depthwise convs), 1x3x64x64"
    raise SystemExit(f"unknown workload {name!r} (tiny, resnet, mobilenet)")


def variants(model: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    import torchlens as tl

    return {
        "plain forward": lambda: model(x),
        "cloning mode (floor)": lambda: floor_run(model, x),
        'tl.trace save="none"': lambda: tl.trace(model, x, save="none"),
        'tl.trace save="all"': lambda: tl.trace(model, x, save="all"),
    }


def measure(fns: dict[str, Callable[[], Any]], rounds: int, clock: Callable[[], float],
            collect: str = "full") -> dict[str, list[float]]:
    """`capture.measure` (same interleaving and collection modes) with a choice of clock:
    `time.process_time` (CPU seconds of this process) is far less disturbed than wall time on
    a machine shared with other work."""
    return B.measure(fns, rounds, clock, collect)


def count_ops(model: nn.Module, x: torch.Tensor) -> int:
    import torchlens as tl

    return sum(1 for op in tl.trace(model, x, save="none").ops if op.kind == "op")


def run_workload(name: str, n_ops: int, rounds: int, no_grad: bool, clock: Callable[[], float],
                 collect: str = "full") -> dict[str, Any]:
    model, x, label = workload(name, n_ops)
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        ops = count_ops(model, x)
        fns = variants(model, x)
        times = measure(fns, rounds, clock, collect)
    med = {k: statistics.median(v) for k, v in times.items()}
    floor, plain = med["cloning mode (floor)"], med["plain forward"]
    rows = {k: {"median_s": m, "us_per_op": m / ops * 1e6, "ratio_to_floor": m / floor, "ratio_to_plain": m / plain,
                "min_s": min(times[k]), "runs": len(times[k])} for k, m in med.items()}
    print(f"\n{label}: {ops} recorded ops (median of {rounds} interleaved rounds, {torch.get_num_threads()} threads)")
    print(f"{'variant':26s} {'median ms':>10s} {'us/op':>8s} {'x floor':>8s} {'x plain':>8s}")
    for k, r in rows.items():
        print(f"{k:26s} {r['median_s'] * 1e3:10.3f} {r['us_per_op']:8.2f} {r['ratio_to_floor']:8.3f} "
              f"{r['ratio_to_plain']:8.3f}")
    return {"label": label, "ops": ops, "results": rows}


def profile(name: str, n_ops: int, save: str, top: int, no_grad: bool) -> None:
    import torchlens as tl

    model, x, label = workload(name, n_ops)
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        for _ in range(3):
            tl.trace(model, x, save=save)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            tl.trace(model, x, save=save)
        prof.disable()
    print(f"cProfile: 5 x tl.trace(save={save!r}) on {label}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="tiny,resnet,mobilenet")
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1: less noise)")
    ap.add_argument("--no-grad", action="store_true", help="run every variant under torch.no_grad()")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall (perf_counter) or cpu (process_time: steadier on a shared machine)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--profile", default=None, help="a workload to profile instead of timing")
    ap.add_argument("--profile-save", default="all")
    ap.add_argument("--collect", choices=("full", "young"), default="full",
                    help="before each timed call: collect the whole heap (full, default: the CPU caches start "
                         "cold) or only what the variants made since the warm-up (young)")
    ap.add_argument("--note", default="", help="conditions worth recording with the results")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.profile:
        profile(args.profile, args.ops, args.profile_save, 30, args.no_grad)
        return 0
    report: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "threads": torch.get_num_threads(), "rounds": args.rounds,
        "grad": "torch.no_grad()" if args.no_grad else "enabled (as capture.py)",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "clock": args.clock, "collect": args.collect, "note": args.note,
        "loadavg_start": B._loadavg(), "workloads": {},
    }
    for name in args.workloads.split(","):
        report["workloads"][name] = run_workload(name, args.ops, args.rounds, args.no_grad,
                                                   time.process_time if args.clock == "cpu" else time.perf_counter,
                                                   args.collect)
        gc.collect()
    report["loadavg_end"] = B._loadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
