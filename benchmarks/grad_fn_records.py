"""Cost of the grad_fn records (issues 25 and 26): the capture with the walk deferred to the
first read (the default for a save="all" capture) against the same capture with the walk
forced at capture time (the issue-25 behaviour), and a plain forward.

Variants, interleaved in one process (order rotating each round), CPU clock by default:
- plain: the model's forward, no TorchLens;
- lazy: `tl.trace(model, x)` (save="all"): the walk waits for the first read;
- eager: the same capture with the walk forced at capture time;
- lazy+read: the lazy capture followed by `trace.autograd.grad_fns` (what a capture whose
  records are read pays in total; should equal eager within noise).
Reports the medians and each ratio to plain, the time spent inside `record_grad_fns` per
capture (lazy: roots and seeds only; eager: the whole walk; a direct measure, steadier than
the difference of two noisy capture times), and the load averages at the start and the end
(the cores are shared: read ratios, not seconds).

Models: the ResNet-like CNN of `benchmarks/capture.py` at 1x3x64x64 (default) and, with
`--models resnet,gpt2`, GPT-2 small shape (random weights) at 32 tokens.

Results go to `benchmarks/results/grad_fn_records.json`.

Run: .venv/bin/python benchmarks/grad_fn_records.py [--rounds 7] [--reps 3] [--models resnet] [--threads 1]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics as st
import sys
import time
from pathlib import Path

import torch

import torchlens as tl
import torchlens_torch.autograd_records as AR

sys.path.insert(0, str(Path(__file__).resolve().parent))
RESULTS = Path(__file__).resolve().parent / "results" / "grad_fn_records.json"


def _models(names: list[str]):
    for name in names:
        if name == "resnet":
            from capture import resnet_like

            torch.manual_seed(0)
            model, x = resnet_like()
            yield "ResNet-like CNN, 1x3x64x64", model, x
        elif name == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            torch.manual_seed(0)
            yield "GPT-2 small shape, 32 tokens", GPT2LMHeadModel(GPT2Config()).eval(), torch.randint(0, 50257, (1, 32))
        else:
            raise SystemExit(f"unknown model {name!r} (resnet, gpt2)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3, help="calls per variant per round (each timed on its own)")
    ap.add_argument("--models", default="resnet")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    real_decide, real_record = AR._holds_every_seed, AR.record_grad_fns
    spent: list[float] = []

    def timed_record(*a, **k):  # the time tl.trace spends in record_grad_fns (roots, seeds, and the walk if eager)
        t0 = clock()
        real_record(*a, **k)
        spent.append(clock() - t0)
    load_start = os.getloadavg()
    print("load at start", load_start, "threads", torch.get_num_threads(), "clock", args.clock)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(), "clock": args.clock,
                    "threads": torch.get_num_threads(), "rounds": args.rounds, "reps": args.reps,
                    "load_start": load_start, "models": {}}
    for label, model, x in _models(args.models.split(",")):
        def plain():
            with torch.enable_grad():
                return model(x)

        def lazy():
            return tl.trace(model, x)

        def eager():
            AR._holds_every_seed = lambda *a: False
            try:
                return tl.trace(model, x)
            finally:
                AR._holds_every_seed = real_decide

        def lazy_read():
            t = tl.trace(model, x)
            t.autograd.grad_fns  # noqa: B018 - the first read runs the walk
            return t

        variants = {"plain": plain, "lazy": lazy, "eager": eager, "lazy+read": lazy_read}
        for fn in variants.values():  # warm (and the model-description cache)
            fn()
        t = tl.trace(model, x)
        assert t.provenance.__dict__.get("_deferred_extra"), "the save='all' capture did not defer its walk"
        n_nodes, n_ops = len(t.autograd.grad_fns), len(t._ops)
        del t
        times: dict[str, list[float]] = {k: [] for k in variants}
        in_record: dict[str, list[float]] = {"lazy": [], "eager": []}
        names = list(variants)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for k in order:
                spent.clear()
                AR.record_grad_fns = timed_record
                try:
                    for _ in range(args.reps):
                        gc.collect()  # as benchmarks/capture.py: no collection inside the timed call
                        t0 = clock()
                        result = variants[k]()
                        times[k].append(clock() - t0)
                        del result  # released outside the timed call
                finally:
                    AR.record_grad_fns = real_record
                if k in in_record:
                    in_record[k].extend(spent)
        med = {k: st.median(v) for k, v in times.items()}
        print(f"\n{label}: {n_ops} ops, {n_nodes} grad_fn nodes; {args.rounds} rounds x {args.reps} calls, median "
              "(gc.collect() before each call, the result released after the clock stops)")
        for k in names:
            print(f"  {k:10s} {med[k] * 1e3:8.2f} ms  {med[k] / med['plain']:.3f}x plain")
        print(f"  walk deferred: eager - lazy = {(med['eager'] - med['lazy']) * 1e3:.2f} ms "
              f"({(med['eager'] - med['lazy']) / med['plain']:.1%} of a plain forward); "
              f"lazy / eager = {med['lazy'] / med['eager']:.3f}")
        rl, re_ = st.median(in_record["lazy"]), st.median(in_record["eager"])
        print(f"  inside record_grad_fns (median per capture): lazy {rl * 1e3:.3f} ms, eager {re_ * 1e3:.3f} ms "
              f"(saved {(re_ - rl) * 1e3:.3f} ms = {(re_ - rl) / med['plain']:.1%} of a plain forward)")
        report["models"][label] = {
            "ops": n_ops, "grad_fn_nodes": n_nodes, "median_s": med,
            "ratio_to_plain": {k: med[k] / med["plain"] for k in names}, "lazy_over_eager": med["lazy"] / med["eager"],
            "record_grad_fns_s": {"lazy": rl, "eager": re_}}
    report["load_end"] = os.getloadavg()
    print("\nload at end", report["load_end"])
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
