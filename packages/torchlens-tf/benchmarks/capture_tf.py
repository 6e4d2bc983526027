"""Capture cost of the TensorFlow backend: an attention stack (two Keras pre-norm
MultiHeadAttention blocks, 74 recorded ops), `tl.trace(..., backend="tf")` against a plain
eager forward of the same model on the same input.

Rounds are interleaved (plain, capture, plain, capture, ...) after a warm-up, each time is
the median of its rounds, and the result is their ratio, measured in this one run (no
absolute time is asserted anywhere). Run:

    .venv/bin/python packages/torchlens-tf/benchmarks/capture_tf.py [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import keras
import tensorflow as tf

import torchlens as tl
from torchlens_tf.zoo import AttentionBlock


class Stack(keras.Model):
    def __init__(self, depth: int = 2, **kw) -> None:
        super().__init__(**kw)
        self.blocks = [AttentionBlock(name=f"block{i}") for i in range(depth)]

    def call(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    keras.utils.set_random_seed(0)
    model = Stack()
    x = tf.reshape(tf.sin(tf.range(2 * 5 * 8, dtype=tf.float32) * 0.37), (2, 5, 8))
    model(x)
    for _ in range(3):  # warm-up: kernels, plugin loading, wrapper construction
        model(x)
        t = tl.trace(model, x, backend="tf")
    n_ops = sum(o.kind == "op" for o in t.ops)
    plain, capture = [], []
    for _ in range(a.rounds):
        s = time.perf_counter()
        model(x)
        plain.append(time.perf_counter() - s)
        s = time.perf_counter()
        tl.trace(model, x, backend="tf")
        capture.append(time.perf_counter() - s)
    p, c = statistics.median(plain), statistics.median(capture)
    result = {"model": "2 x (LayerNormalization + MultiHeadAttention(2 heads, key_dim 4) + residual), input (2, 5, 8)",
              "ops": n_ops, "rounds": a.rounds, "plain_median_s": round(p, 6), "capture_median_s": round(c, 6),
              "ratio": round(c / p, 2), "tensorflow": tf.__version__, "keras": keras.__version__}
    print(json.dumps(result, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return result


if __name__ == "__main__":
    main()
