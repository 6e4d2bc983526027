"""Capture cost of the MLX backend: a stack of attention blocks (`mlx.nn.MultiHeadAttention`,
LayerNorm, a GELU MLP; over 50 ops per forward), `tl.trace` vs a plain forward (output
evaluated with `mx.eval`), interleaved rounds, median seconds and the ratio.

    python benchmarks/mlx_capture.py [--rounds 15] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

import torchlens as tl


class Block(nn.Module):
    def __init__(self, dims: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dims)
        self.attn = nn.MultiHeadAttention(dims, heads)
        self.ln2 = nn.LayerNorm(dims)
        self.fc1 = nn.Linear(dims, 4 * dims)
        self.fc2 = nn.Linear(4 * dims, dims)

    def __call__(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h)
        return x + self.fc2(nn.gelu(self.fc1(self.ln2(x))))


class Stack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = [Block() for _ in range(n)]

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    mx.random.seed(0)
    model = Stack()
    mx.eval(model.parameters())
    x = mx.random.normal((2, 32, 64))
    mx.eval(x)

    def plain():
        mx.eval(model(x))

    def capture():
        tl.trace(model, x, backend="mlx")

    n_ops = sum(1 for o in tl.trace(model, x, backend="mlx").ops if o.kind == "op")
    times = {"plain": [], "capture": []}
    for f in (plain, capture):
        f()
    for r in range(a.rounds):
        order = [("plain", plain), ("capture", capture)]
        for name, f in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"model": "3 attention blocks (dims 64, 4 heads, 32 tokens)", "ops": n_ops, "rounds": a.rounds,
              "median_s": med, "ratio_capture_vs_plain": med["capture"] / med["plain"], "mlx": mx.__version__}
    print(json.dumps(result, indent=2))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
