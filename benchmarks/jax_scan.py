"""JAX capture of a long `lax.scan` (issue 28 item 6): first and repeated `tl.trace` of an
LSTM written as a plain function over `jax.lax.scan`, against a jitted forward of the same
function, at 128 and 1,024 steps.

    python benchmarks/jax_scan.py [--steps 128 1024] [--hidden 16] [--repeats 5]

Prints the figures and writes them to benchmarks/results/jax_scan.json. Ratios are measured
in one run on one machine (capture / jitted forward); the absolute seconds depend on the
machine and its load. A first capture traces the jaxpr and compiles one executable per
distinct primitive (scan steps share one compiled slice with a traced index); a repeat
reuses both and pays dispatch per recorded op (about 15 per step). `loops="rolled"`
records the scan as one op (no step cap): its repeat capture is also measured, and a length
past the 1,024-step unroll cap (`--rolled-only`, default 4,096) is timed rolled only.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import torchlens as tl
from torchlens_jax.backend import clear_trace_cache
from torchlens_jax.interpret import clear_executable_cache


def lstm(params: dict, xs: jax.Array) -> jax.Array:
    h0 = jnp.zeros((params["wh"].shape[0],), xs.dtype)

    def cell(carry, x):
        h, c = carry
        i, f, g, o = jnp.split(x @ params["wx"] + h @ params["wh"] + params["b"], 4)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    _, hs = jax.lax.scan(cell, (h0, h0), xs)
    return hs


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(steps: int, hidden: int, repeats: int) -> dict:
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    d = hidden
    params = {"wx": jax.random.normal(k[0], (d, 4 * hidden)) * 0.1,
              "wh": jax.random.normal(k[1], (hidden, 4 * hidden)) * 0.1, "b": jnp.zeros((4 * hidden,))}
    xs = jax.random.normal(k[2], (steps, d))
    fwd = jax.jit(lstm)
    jax.block_until_ready(fwd(params, xs))
    jit_forward = _median(lambda: fwd(params, xs), max(repeats, 20))
    clear_trace_cache()
    clear_executable_cache()
    t0 = time.perf_counter()
    t = tl.trace(lstm, params, xs, backend="jax")
    first = time.perf_counter() - t0
    n_ops = len(t.ops)
    repeat = _median(lambda: tl.trace(lstm, params, xs, backend="jax").output_ops[0].out, repeats)
    rolled = _rolled(params, xs, repeats)
    return {"steps": steps, "hidden": hidden, "ops": n_ops, "first_capture_s": round(first, 4),
            "repeat_capture_s": round(repeat, 4), "jit_forward_s": jit_forward,
            "first_over_jit": round(first / jit_forward, 1), "repeat_over_jit": round(repeat / jit_forward, 1),
            "repeat_per_op_us": round(repeat / n_ops * 1e6, 2),
            "rolled_repeat_capture_s": round(rolled, 4), "rolled_repeat_over_jit": round(rolled / jit_forward, 1)}


def _rolled(params: dict, xs: jax.Array, repeats: int) -> float:
    tl.trace(lstm, params, xs, backend="jax", loops="rolled")  # first: traces and compiles the scan op
    return _median(lambda: tl.trace(lstm, params, xs, backend="jax", loops="rolled").output_ops[0].out, repeats)


def measure_rolled_only(steps: int, hidden: int, repeats: int) -> dict:
    """A scan past the unroll cap: only `loops="rolled"` can record it."""
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"wx": jax.random.normal(k[0], (hidden, 4 * hidden)) * 0.1,
              "wh": jax.random.normal(k[1], (hidden, 4 * hidden)) * 0.1, "b": jnp.zeros((4 * hidden,))}
    xs = jax.random.normal(k[2], (steps, hidden))
    fwd = jax.jit(lstm)
    jax.block_until_ready(fwd(params, xs))
    jit_forward = _median(lambda: fwd(params, xs), max(repeats, 20))
    t0 = time.perf_counter()
    t = tl.trace(lstm, params, xs, backend="jax", loops="rolled")
    first = time.perf_counter() - t0
    rolled = _rolled(params, xs, repeats)
    return {"steps": steps, "hidden": hidden, "ops": len(t.ops), "rolled_first_capture_s": round(first, 4),
            "rolled_repeat_capture_s": round(rolled, 4), "jit_forward_s": jit_forward,
            "rolled_repeat_over_jit": round(rolled / jit_forward, 1)}


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rolled-only", type=int, nargs="*", default=[4096])
    args = ap.parse_args()
    rows = [measure(s, args.hidden, args.repeats) for s in args.steps]
    rolled_rows = [measure_rolled_only(s, args.hidden, args.repeats) for s in args.rolled_only]
    result = {"benchmark": "jax_scan", "jax": jax.__version__, "python": platform.python_version(),
              "machine": platform.machine(), "rows": rows, "rolled_only": rolled_rows}
    for r in rows:
        print(f"T={r['steps']}: {r['ops']} ops, first {r['first_capture_s']:.2f} s ({r['first_over_jit']}x jit), "
              f"repeat {r['repeat_capture_s']:.2f} s ({r['repeat_over_jit']}x jit), jit {r['jit_forward_s'] * 1e3:.3f} ms; "
              f"rolled repeat {r['rolled_repeat_capture_s'] * 1e3:.1f} ms ({r['rolled_repeat_over_jit']}x jit)")
    for r in rolled_rows:
        print(f"T={r['steps']} rolled only: {r['ops']} ops, first {r['rolled_first_capture_s']:.2f} s, "
              f"repeat {r['rolled_repeat_capture_s'] * 1e3:.1f} ms ({r['rolled_repeat_over_jit']}x jit), "
              f"jit {r['jit_forward_s'] * 1e3:.3f} ms")
    out = Path(__file__).resolve().parent / "results" / "jax_scan.json"
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
