"""Two effects behind the spread of the capture benchmarks (docs/backends/torch.md, Performance).

`--context`: the same `tl.trace(save="all")` of the 2,000-tiny-op loop (`per_op.TinyOps`), a
whole-heap `gc.collect()` before each call, timed when called from a plain loop and from inside
a `for name in [...]:` loop (as `capture.measure` calls it), then both again after
`gc.freeze()`. Only the caller differs; the capture's own work is the same (cProfile counts
the same calls), yet the times differ by 10-30% until the heap is frozen.

`--order`: `per_op.py`'s tiny-op variants timed in the harness's order (plain, floor,
`save="none"`, `save="all"`: the rotation keeps that cycle, so `save="none"` always runs right
after a variant that runs none of the capture's code) and with the two captures swapped. The
capture timed right after other work runs slower than the one timed right after a capture.

`--none-memory`: the peak RSS growth of one GPT-2 `save="none"` capture (128 tokens) over a
plain forward, each variant in a fresh subprocess: as shipped (`WeakKeep`: no recorded output
held) and with the recorder holding every output until the forward ends (a plain list, the
behaviour before session 9; patched in for this measurement only).

    python benchmarks/capture_effects.py --context
    python benchmarks/capture_effects.py --order
    python benchmarks/capture_effects.py --none-memory
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def context(rounds: int) -> None:
    import torch
    import torchlens as tl
    import per_op as PO

    torch.set_num_threads(1)
    model, x = PO.TinyOps(2000).eval(), torch.randn(4)

    def once() -> float:
        gc.collect()
        t0 = time.perf_counter()
        trace = tl.trace(model, x, save="all")
        took = time.perf_counter() - t0
        del trace
        return took

    def plain_loop() -> float:
        return statistics.median([once() for _ in range(rounds)]) * 1e3

    def list_loop() -> float:
        times = []
        for _ in range(rounds):
            for _name in ["variant"]:
                times.append(once())
        return statistics.median(times) * 1e3

    once(), once()
    for label in ("heap not frozen", "after gc.freeze()"):
        if label.startswith("after"):
            gc.freeze()
        print(f"{label:18s} called from a plain loop {plain_loop():6.2f} ms, from a list loop {list_loop():6.2f} ms")
    gc.unfreeze()


def order(rounds: int) -> None:
    import torch
    import torchlens as tl
    import per_op as PO
    import capture as B

    torch.set_num_threads(1)
    model, x = PO.TinyOps(2000).eval(), torch.randn(4)
    fns = {"plain": lambda: model(x), "floor": lambda: PO.floor_run(model, x),
           "none": lambda: tl.trace(model, x, save="none"), "all": lambda: tl.trace(model, x, save="all")}
    for names in (("plain", "floor", "none", "all"), ("plain", "floor", "all", "none")):
        times = B.measure({k: fns[k] for k in names}, rounds, time.process_time)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"order {', '.join(names):26s} " + "  ".join(
            f"{k} {med[k]:6.2f} ms ({med[k] / med['floor']:.2f}x floor)" for k in ("none", "all")))


_MEMORY_CHILD = r'''
import gc, resource, sys
sys.path.insert(0, {here!r})
import torch, torchlens as tl
import capture as B
torch.set_num_threads(1)
if {hold_all!r}:
    import torchlens_torch.backend as backend

    class HoldAll(list):
        dead = ()

    backend.WeakKeep = lambda tags: HoldAll()
model, ids = B.gpt2_small(128)
model(ids)
gc.collect()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tl.trace(model, ids, save="none")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
'''


def none_memory(repeats: int) -> None:
    for label, hold_all in (("as shipped (WeakKeep)", False), ("holding every output", True)):
        growth = []
        for _ in range(repeats):
            out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD.format(here=str(HERE), hold_all=hold_all)],
                                 capture_output=True, text=True, check=True)
            growth.append(float(out.stdout.strip().splitlines()[-1]))
        print(f"GPT-2 save='none', peak RSS growth over a plain forward, {label}: "
              + ", ".join(f"{g:.1f}" for g in growth) + " MB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", action="store_true")
    ap.add_argument("--order", action="store_true")
    ap.add_argument("--none-memory", action="store_true")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    if not (args.context or args.order or args.none_memory):
        ap.error("choose --context, --order and/or --none-memory")
    if args.context:
        context(args.rounds)
    if args.order:
        order(args.rounds)
    if args.none_memory:
        none_memory(args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
