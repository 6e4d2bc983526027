"""Save/load of a GPT-2-small trace vs torch.save of the same tensors.

GPT-2 small (12 layers, d_model 768) from a random-init transformers.GPT2Config, 128
tokens, save="all". Reports seconds and bytes on disk for Trace.save, tl.load (eager and
lazy) and torch.save / torch.load of the same payload tensors (op outputs, params, buffers).

    .venv/bin/python benchmarks/io.py [--repeat 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

import torchlens as tl


def _du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _gpt2_trace():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12)).eval()
    ids = torch.randint(0, 50257, (1, 128))
    with torch.no_grad():
        return tl.trace(model, ids, save="all", backend="torch")


def _tensors(trace) -> dict[str, torch.Tensor]:
    out = {}
    for op in trace:
        if op.saved:
            for i, v in enumerate(op.outs):
                if isinstance(v, torch.Tensor):
                    out[f"{op.label}/{i}"] = v
    for store in (trace._params, trace._buffers):
        for addr, r in store.items():
            if isinstance(r.value, torch.Tensor):
                out[addr] = r.value
    return out


def _best(fn, repeat: int, path: str | None = None) -> float:
    """Best of `repeat` runs; a save writes a fresh path each time (removed outside the timing)."""
    times = []
    for _ in range(repeat):
        if path is not None and os.path.exists(path):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    trace = _gpt2_trace()
    print(f"capture: {time.perf_counter() - t0:.2f}s, {len(trace)} ops, {len(trace._params)} params")
    tensors = _tensors(trace)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"payload tensors: {len(tensors)}, {nbytes / 2**20:.1f} MiB")
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        tls, pt = os.path.join(root, "gpt2.tlspec"), os.path.join(root, "gpt2.pt")
        save_s = _best(lambda: trace.save(tls), args.repeat, tls)
        tsave_s = _best(lambda: torch.save(tensors, pt), args.repeat, pt)
        load_s = _best(lambda: tl.load(tls), args.repeat)
        lazy_s = _best(lambda: tl.load(tls, lazy=True), args.repeat)
        tload_s = _best(lambda: torch.load(pt, weights_only=True), args.repeat)
        print(f"{'':22}{'seconds':>10}{'MiB on disk':>14}")
        print(f"{'Trace.save':22}{save_s:10.3f}{_du(tls) / 2**20:14.1f}")
        print(f"{'torch.save':22}{tsave_s:10.3f}{_du(pt) / 2**20:14.1f}")
        print(f"{'tl.load':22}{load_s:10.3f}")
        print(f"{'tl.load(lazy=True)':22}{lazy_s:10.3f}")
        print(f"{'torch.load':22}{tload_s:10.3f}")
        print(f"save ratio {save_s / tsave_s:.2f}x torch.save (target <= 1.5x); load ratio {load_s / tload_s:.2f}x torch.load")
        loaded = tl.load(tls)
        diffs = tl.io.trace_differences(trace, loaded)
        print("round trip equal:", diffs == [] or diffs[:3])
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
