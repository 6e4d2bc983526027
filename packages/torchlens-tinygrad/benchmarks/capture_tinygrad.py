"""Capture cost of the tinygrad backend: a stack of the zoo's pre-norm attention blocks
(`nn.LayerNorm`, a `qkv` projection split in three, `scaled_dot_product_attention`, an output
projection; over 50 ops per forward), `tl.trace` vs a plain forward (its output realized),
interleaved rounds, median seconds and the ratio.

Both sides run warm: tinygrad compiles each distinct kernel once per process (and caches it on
disk), so the rounds measure the steady state. The capture realizes every op as its own
kernel; the plain forward runs the whole lazy graph as a few fused kernels.

    python packages/torchlens-tinygrad/benchmarks/capture_tinygrad.py [--rounds 11] [--depth 4] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from importlib.metadata import version
from tinygrad import Tensor

import torchlens as tl
from torchlens_tinygrad.zoo import AttentionStack


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--dims", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    Tensor.manual_seed(0)
    model = AttentionStack(depth=a.depth, dims=a.dims, heads=4)
    x = Tensor(np.random.default_rng(0).standard_normal((2, 32, a.dims)).astype(np.float32)).realize()

    def plain():
        model(x).realize()

    def capture():
        tl.trace(model, x, backend="tinygrad")

    n_ops = sum(1 for o in tl.trace(model, x, backend="tinygrad").ops if o.kind == "op")
    times: dict[str, list[float]] = {"plain": [], "capture": []}
    for f in (plain, capture, plain, capture):  # warm: every kernel compiled
        f()
    for r in range(a.rounds):
        order = [("plain", plain), ("capture", capture)]
        for name, f in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"model": f"{a.depth} attention blocks (dims {a.dims}, 4 heads, 32 tokens)", "ops": n_ops,
              "rounds": a.rounds, "median_s": med, "ratio_capture_vs_plain": med["capture"] / med["plain"],
              "tinygrad": version("tinygrad")}
    print(json.dumps(result, indent=2))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
