"""JAX capture cost: first and repeated `tl.trace` of the zoo's attention block against a
jitted forward and an eager (un-jitted) forward of the same block.

    python benchmarks/jax_capture.py [--repeats N]

Prints the figures and writes them to benchmarks/results/jax_capture.json. The first
capture pays tracing plus one XLA compilation per distinct primitive; a repeat capture
reuses the cached jaxpr and per-primitive executables and pays only dispatch (one call
per primitive) and event bookkeeping.
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
from torchlens_jax.zoo import AttentionBlock


def _time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    model = AttentionBlock()
    x = jnp.sin(jnp.arange(2 * 5 * 16, dtype=jnp.float32)).reshape(2, 5, 16)

    from flax import nnx

    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, v: nnx.merge(graphdef, s)(v))
    t0 = time.perf_counter()
    jax.block_until_ready(fwd(state, x))
    jit_first = time.perf_counter() - t0
    jit_forward = _time(lambda: fwd(state, x), args.repeats)
    eager_forward = _time(lambda: model(x), args.repeats)

    clear_trace_cache()
    clear_executable_cache()
    t0 = time.perf_counter()
    first = tl.trace(model, x, backend="jax")
    first_capture = time.perf_counter() - t0
    repeat_capture = _time(lambda: tl.trace(model, x, backend="jax").output_ops[0].out, args.repeats)
    n_ops = sum(1 for o in first.ops if o.kind == "op")

    result = {
        "model": "torchlens_jax.zoo.AttentionBlock (dim 16, 2 heads, input 2x5x16)",
        "jax": jax.__version__, "platform": platform.platform(), "device": str(jax.devices()[0]),
        "recorded_ops": n_ops, "repeats": args.repeats,
        "seconds": {"jit_first_call": jit_first, "jit_forward": jit_forward, "eager_forward": eager_forward,
                    "first_capture": first_capture, "repeat_capture": repeat_capture},
        "ratios": {"first_capture_vs_jit_forward": first_capture / jit_forward,
                   "repeat_capture_vs_jit_forward": repeat_capture / jit_forward,
                   "repeat_capture_vs_eager_forward": repeat_capture / eager_forward,
                   "first_capture_vs_repeat_capture": first_capture / repeat_capture},
        "per_op_repeat_us": repeat_capture / n_ops * 1e6,
    }
    for k, v in result["seconds"].items():
        print(f"{k:>22}: {v * 1e3:9.3f} ms")
    for k, v in result["ratios"].items():
        print(f"{k:>34}: {v:9.1f}x")
    print(f"{'per recorded op (repeat)':>34}: {result['per_op_repeat_us']:9.1f} us over {n_ops} ops")
    out = Path(__file__).resolve().parent / "results" / "jax_capture.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
