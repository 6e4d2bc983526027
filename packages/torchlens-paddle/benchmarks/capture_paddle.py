"""Capture cost of the paddle backend: a stack of attention blocks (`paddle.nn.MultiHeadAttention`,
LayerNorm, a GELU MLP; over 50 ops per forward), `tl.trace` vs a plain forward, interleaved
rounds, median seconds and the ratio.

    python packages/torchlens-paddle/benchmarks/capture_paddle.py [--rounds 15] [--out capture_paddle.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from torchlens_paddle.plugin import load_paddle

paddle = load_paddle()
import paddle.nn as nn  # noqa: E402
import paddle.nn.functional as F  # noqa: E402

import torchlens as tl  # noqa: E402


class Block(nn.Layer):
    def __init__(self, dims: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dims)
        self.attn = nn.MultiHeadAttention(dims, heads)
        self.ln2 = nn.LayerNorm(dims)
        self.fc1 = nn.Linear(dims, 4 * dims)
        self.fc2 = nn.Linear(4 * dims, dims)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Stack(nn.Layer):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.LayerList([Block() for _ in range(n)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    paddle.seed(0)
    model = Stack()
    model.eval()
    x = paddle.randn([2, 32, 64])

    def plain():
        model(x)

    def capture():
        tl.trace(model, x, backend="paddle")

    n_ops = sum(1 for o in tl.trace(model, x, backend="paddle").ops if o.kind == "op")
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
              "median_s": med, "ratio_capture_vs_plain": med["capture"] / med["plain"], "paddle": paddle.__version__}
    print(json.dumps(result, indent=2))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
