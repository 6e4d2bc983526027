"""Where a capture's time goes, and how the measuring conditions move it.

For one model (the CNNs or GPT-2 of `capture.py`), interleaved in one process, median over
rounds, one torch thread, CPU clock for the whole calls:

- the plain forward;
- the bare interception: a pass-through `TorchFunctionMode` plus no-op global module hooks
  (the floor of op-level capture without copies);
- `tl.trace(save=...)`, split by its provenance timings into setup (before the forward),
  the forward with recording, and everything after the forward (state restore, the build,
  grad_fn records, stamps).

Each is measured three ways: with a collection of the whole heap before every timed call
(`full`: it evicts the CPU caches, which the capture's Python work notices far more than the
forward's kernels), with a collection of only what was made since the warm-up (`young`:
everything alive then is frozen; `capture.py` and `per_op.py` do this with `--collect young`;
their default is `full`), and with
no collection between calls (`none`). `--after-gpt2` first builds and runs a plain GPT-2
forward (importing `transformers` doubles the objects a full collection walks) to show the
effect of a larger process.

    python benchmarks/capture_phases.py                     # ResNet-like, save="all"
    python benchmarks/capture_phases.py --after-gpt2
    python benchmarks/capture_phases.py --model mobilenet --save none --rounds 60

Results go to `benchmarks/results/capture_phases.json` (or `--out`). Forward, setup and
after-forward times are wall-clock (`perf_counter`, as the capture's provenance records
them); totals and ratios use the CPU clock.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import capture as B  # noqa: E402 - the shared models

RESULTS = Path(__file__).resolve().parent / "results" / "capture_phases.json"


class PassThrough(TorchFunctionMode):
    """See every torch call, do nothing else."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _bare(model: Any, x: Any) -> Callable[[], float]:
    import torch.nn.modules.module as mm

    def run() -> float:
        pre = mm.register_module_forward_pre_hook(lambda m, a: None)
        post = mm.register_module_forward_hook(lambda m, a, o: None)
        try:
            t0 = time.perf_counter()
            with PassThrough():
                model(x)
            return time.perf_counter() - t0
        finally:
            pre.remove()
            post.remove()

    return run


def measure(model: Any, x: Any, save: str, rounds: int, collect: str) -> dict[str, float]:
    import torchlens as tl

    cpu = time.process_time
    bare = _bare(model, x)
    plain, plain_wall, floor, fwd, setup, after, total = [], [], [], [], [], [], []
    for _ in range(3):
        model(x), bare(), tl.trace(model, x, save=save)
    if collect == "young":
        gc.collect()
        gc.freeze()
    for r in range(rounds):
        for k in ((0, 1, 2), (1, 2, 0), (2, 0, 1))[r % 3]:
            if collect != "none":
                gc.collect()
            if k == 0:
                t0, w0 = cpu(), time.perf_counter()
                model(x)
                plain.append(cpu() - t0)
                plain_wall.append(time.perf_counter() - w0)
            elif k == 1:
                floor.append(bare())
            else:
                t0 = cpu()
                trace = tl.trace(model, x, save=save)
                total.append(cpu() - t0)
                extra = trace.provenance.extra
                fwd.append(extra["forward_duration"])
                setup.append(extra["setup_duration"])
                after.append(extra["cleanup_duration"])
                del trace
    if collect == "young":
        gc.unfreeze()
    med = statistics.median
    ms = lambda v: round(med(v) * 1e3, 3)  # noqa: E731
    return {"plain_ms": ms(plain), "plain_wall_ms": ms(plain_wall), "bare_forward_ms": ms(floor),
            "trace_forward_ms": ms(fwd), "trace_setup_ms": ms(setup), "trace_after_forward_ms": ms(after),
            "trace_total_ms": ms(total), "ratio": round(med(total) / med(plain), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("resnet", "mobilenet", "gpt2"), default="resnet")
    ap.add_argument("--save", choices=("all", "none"), default="all")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--after-gpt2", action="store_true", help="run a plain GPT-2 forward first (imports transformers)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(), "threads": 1, "rounds": args.rounds,
        "model": args.model, "save": args.save, "after_gpt2": args.after_gpt2, "note": args.note,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "loadavg_start": B._loadavg(),
    }
    if args.after_gpt2:
        g, ids = B.gpt2_small(args.tokens)
        g(ids)
        del g, ids
        gc.collect()
    report["gc_objects"] = len(gc.get_objects())
    model, x = {"resnet": B.resnet_like, "mobilenet": B.mobilenet_like,
                "gpt2": lambda: B.gpt2_small(args.tokens)}[args.model]()
    for collect in ("full", "young", "none"):
        row = measure(model, x, args.save, args.rounds, collect)
        report[f"collect_{collect}"] = row
        print(f"collect={collect:6s} " + " ".join(f"{k}={v}" for k, v in row.items()))
    report["loadavg_end"] = B._loadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
