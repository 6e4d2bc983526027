"""Time Trace.draw on a synthetic ~2,000-op trace (no ML framework needed).

    python benchmarks/draw.py [--blocks 125] [--format svg] [--repeat 3]

Prints the op count and, per step, the best-of-N wall time: building the DOT source
(RenderIR + emission) and rendering it with graphviz `dot`. Target: a full SVG render of
2,000 ops in under 10 s on a laptop-class CPU.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from torchlens.viz.examples import example_trace


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=154, help="transformer-like blocks of 13 ops each (154 -> 2,006 ops)")
    ap.add_argument("--format", default="svg")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    trace = example_trace("blocks", n_blocks=args.blocks)
    build_s = time.perf_counter() - t0
    print(f"trace: {trace.num_ops} ops, {len(trace.modules)} modules (built from events in {build_s:.2f} s)")
    with tempfile.TemporaryDirectory() as tmp:
        dot_path = os.path.join(tmp, "g.dot")
        out = os.path.join(tmp, f"g.{args.format}")
        rows = [
            ("DOT source, collapse='none'", lambda: trace.draw(dot_path, collapse="none", progress=False)),
            ("DOT source, default (auto)", lambda: trace.draw(dot_path, progress=False)),
            ("DOT source, depth=1", lambda: trace.draw(dot_path, depth=1, progress=False)),
            ("DOT source, collapse=0.5", lambda: trace.draw(dot_path, collapse=0.5, progress=False)),
            (f"{args.format} render, depth=1", lambda: trace.draw(out, depth=1, progress=False)),
            (f"{args.format} render, default (auto)", lambda: trace.draw(out, progress=False)),
            (f"{args.format} render, collapse='none'", lambda: trace.draw(out, collapse="none", progress=False)),
        ]
        for name, fn in rows:
            print(f"  {name:<28} {best(fn, args.repeat):7.3f} s")


if __name__ == "__main__":
    main()
