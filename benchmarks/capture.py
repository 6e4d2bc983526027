"""Capture overhead, side by side: a plain forward vs `tl.trace` (save="none", save="all")
and, when installed, TransformerLens `run_with_cache` and nnsight saving every block output.

Models (random init, nothing downloaded):
- GPT-2 small shape (12 layers, d_model 768, 12 heads, vocab 50257) at 128 tokens;
- a ResNet-like CNN (ResNet-18 layout, BatchNorm, residual adds) on a 1x3x64x64 image;
- a MobileNet-style CNN (MobileNetV2 layout: depthwise convs, many small ops) on 1x3x64x64
  (`--models mobilenet`; `benchmarks/per_op.py` times it next to the per-op floor).

Every variant runs in the same process, interleaved (variant order rotates each round),
and the table reports the median seconds and the ratio to the plain forward's median.
A collection of the whole heap runs before each timed call (`--collect full`, the default),
so one variant's garbage is never collected inside another's timing. It also evicts the CPU
caches, which slows the capture's Python work far more than a forward's kernels, by an amount
that moves with the heap's layout; `--collect young` collects only what the variants made since
the warm-up (see `measure`). Results go to `benchmarks/results/capture.json`.

    python benchmarks/capture.py                 # full run (default 9 rounds)
    python benchmarks/capture.py --rounds 5 --models gpt2
    python benchmarks/capture.py --clock cpu --threads 1   # CPU time: steadier on a shared machine
    python benchmarks/capture.py --collect young           # collect only what the variants made

The report records the clock, the date and the machine's load averages at the start and end.

PyPI `torchlens` cannot live in this venv (its import name is ours). To compare against it,
install it in a separate venv (with TransformerLens and nnsight too, if you like) and point
`--pypi-torchlens-python` (or the environment variable TORCHLENS_PYPI_PYTHON) at that venv's
python: the script then runs the same models there in a subprocess (`_peer_worker` below)
and adds their ratios, measured against that process's own plain forward.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results" / "capture.json"


# models ---------------------------------------------------------------------------------

class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNetLike(nn.Module):
    """ResNet-18 layout: stem, four stages of two basic blocks, pooling, a linear head."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 project (BatchNorm, ReLU6), residual
    add when the shape allows."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True)]
        layers += [nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
                   nn.ReLU6(inplace=True), nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.block(x) if self.residual else self.block(x)


class MobileNetLike(nn.Module):
    """MobileNetV2 layout at width 1.0 (17 inverted residual blocks, depthwise convs)."""

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32),
                                                 nn.ReLU6(inplace=True))]
        cin = 32
        for t, c, n, s in self.SETTINGS:
            for i in range(n):
                layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        layers.append(nn.Sequential(nn.Conv2d(cin, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6(inplace=True)))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, classes))

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


def gpt2_small(tokens: int) -> tuple[nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval(), torch.randint(0, 50257, (1, tokens))


def resnet_like() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return ResNetLike().eval(), torch.randn(1, 3, 64, 64)


def mobilenet_like() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return MobileNetLike().eval(), torch.randn(1, 3, 64, 64)


# variants -------------------------------------------------------------------------------

def torchlens_variants(model: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    import torchlens as tl

    return {
        "plain forward": lambda: model(x),
        'tl.trace save="none"': lambda: tl.trace(model, x, save="none"),
        'tl.trace save="all"': lambda: tl.trace(model, x, save="all"),
    }


def transformer_lens_variant(tokens: torch.Tensor) -> dict[str, Callable[[], Any]]:
    try:
        from transformer_lens import HookedTransformer, HookedTransformerConfig
    except ImportError:
        return {}
    cfg = HookedTransformerConfig(n_layers=12, d_model=768, n_ctx=1024, d_head=64, n_heads=12, d_vocab=50257,
                                  act_fn="gelu_new", normalization_type="LN", seed=0)
    hooked = HookedTransformer(cfg).eval()
    return {"TransformerLens plain": lambda: hooked(tokens),
            "TransformerLens run_with_cache": lambda: hooked.run_with_cache(tokens)}


def nnsight_variant(model: nn.Module, tokens: torch.Tensor) -> dict[str, Callable[[], Any]]:
    try:
        from nnsight import NNsight
    except ImportError:
        return {}
    wrapped = NNsight(model)

    def run() -> Any:
        box: dict[str, Any] = {}  # nnsight runs the block body in its own frame: hand results out by mutation
        with wrapped.trace(tokens):
            box["saved"] = [block.output.save() for block in wrapped.transformer.h]
        return box["saved"]

    return {"nnsight save every block": run}


# measurement ----------------------------------------------------------------------------

def measure(variants: dict[str, Callable[[], Any]], rounds: int,
            clock: Callable[[], float] = time.perf_counter, collect: str = "full") -> dict[str, list[float]]:
    """Seconds per call of each variant, interleaved; `clock` is wall time by default, or
    `time.process_time` (CPU seconds of this process: steadier on a shared machine).

    Each timed call starts after a collection, so one variant's garbage is not collected
    inside another's timing. `collect="full"` (default) walks the whole heap before every
    call: that evicts the CPU caches, which the capture's Python work notices far more than a
    forward's kernels, and the size of that effect moves with the heap's layout (see
    docs/backends/torch.md, Performance). `collect="young"` freezes everything alive after the
    warm-up (`gc.freeze()`), so that collection walks only what the variants made since, as
    the collector's frequent young-generation passes do in a user's loop."""
    if collect not in ("young", "full"):
        raise ValueError(f"collect={collect!r}: 'young' or 'full'")
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for fn in variants.values():  # warm-up
        fn()
    frozen = collect == "young"
    if frozen:
        gc.collect()
        gc.freeze()
    try:
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                gc.collect()
                t0 = clock()
                result = variants[name]()
                times[name].append(clock() - t0)
                del result
    finally:
        if frozen:
            gc.unfreeze()
    return times


def _loadavg() -> list[float] | None:
    """The machine's 1/5/15-minute load averages (None where the platform has none): a
    ratio measured while other work ran is noisier, so it is recorded beside the numbers."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def summarize(times: dict[str, list[float]], baseline: str) -> dict[str, dict[str, float]]:
    base = statistics.median(times[baseline])
    return {name: {"median_s": statistics.median(ts), "ratio": statistics.median(ts) / base, "min_s": min(ts),
                   "runs": len(ts)} for name, ts in times.items()}


def _peer_worker(python: str, model: str, tokens: int, rounds: int) -> dict[str, Any] | None:
    """Run the peers installed in another venv (PyPI torchlens, and for GPT-2 nnsight and
    TransformerLens when importable there) on the same model in one process; ratios are to
    that process's own plain forward (TransformerLens: to its own model's plain forward)."""
    code = f"""
import json, statistics, sys, time, gc, torch
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import capture as B
m, x = B.gpt2_small({tokens}) if {model!r} == "gpt2" else (B.mobilenet_like() if {model!r} == "mobilenet" else B.resnet_like())
fns = {{"plain forward": lambda: m(x)}}
try:
    import torchlens
    entry = getattr(torchlens, "log_forward_pass", None)
    if entry is not None:  # torchlens < 2
        fns["PyPI torchlens trace (save all)"] = lambda: entry(m, x, layers_to_save="all")
    else:  # torchlens 2.x: trace() saves every layer by default
        fns["PyPI torchlens trace (save all)"] = lambda: torchlens.trace(m, x)
except ImportError:
    pass
tl_fns = {{}}
if {model!r} == "gpt2":
    fns.update(B.nnsight_variant(m, x))
    tl_fns = B.transformer_lens_variant(x)
times = B.measure({{**fns, **tl_fns}}, {rounds})
print(json.dumps({{"main": {{k: times[k] for k in fns}}, "tl": {{k: times[k] for k in tl_fns}}}}))
"""
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, timeout=3600)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"  peer run failed: {exc}", file=sys.stderr)
        return None
    res = json.loads(out.stdout.strip().splitlines()[-1])
    summary = summarize(res["main"], "plain forward")
    summary.pop("plain forward")
    if res["tl"]:
        summary.update(summarize(res["tl"], "TransformerLens plain"))
    return {f"{k} [peer venv]": v for k, v in summary.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", default="gpt2,resnet")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--pypi-torchlens-python", default=os.environ.get("TORCHLENS_PYPI_PYTHON"))
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall (perf_counter) or cpu (process_time: steadier on a shared machine; use with --threads 1)")
    ap.add_argument("--collect", choices=("full", "young"), default="full",
                    help="before each timed call: collect the whole heap (full, default: the CPU caches start "
                         "cold) or only what the variants made since the warm-up (young)")
    ap.add_argument("--note", default="", help="conditions worth recording with the results")
    args = ap.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)

    report: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "threads": torch.get_num_threads(), "rounds": args.rounds, "tokens": args.tokens, "clock": args.clock,
        "collect": args.collect,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "note": args.note, "loadavg_start": _loadavg(), "models": {},
    }
    for model_name in args.models.split(","):
        if model_name == "gpt2":
            try:
                model, x = gpt2_small(args.tokens)
            except ImportError:
                print("\nGPT-2: skipped (transformers is not installed)")
                continue
            variants = torchlens_variants(model, x)
            variants.update(nnsight_variant(model, x))
            tl_variants = transformer_lens_variant(x)
            label = f"GPT-2 small shape, {args.tokens} tokens"
        elif model_name == "mobilenet":
            model, x = mobilenet_like()
            variants = torchlens_variants(model, x)
            tl_variants = {}
            label = "MobileNet-style CNN (depthwise convs), 1x3x64x64"
        else:
            model, x = resnet_like()
            variants = torchlens_variants(model, x)
            tl_variants = {}
            label = "ResNet-like CNN, 1x3x64x64"
        times = measure({**variants, **tl_variants}, args.rounds, clock, args.collect)
        summary = summarize({k: times[k] for k in variants}, "plain forward")
        if tl_variants:  # TransformerLens runs its own model: ratio to its own plain forward
            tl_summary = summarize({k: times[k] for k in tl_variants}, "TransformerLens plain")
            summary.update(tl_summary)
        if args.pypi_torchlens_python:
            peers = _peer_worker(args.pypi_torchlens_python, model_name, args.tokens, args.rounds)
            if peers:
                summary.update(peers)
        report["models"][model_name] = {"label": label, "results": summary}
        print(f"\n{label} (median of {args.rounds} interleaved rounds, {torch.get_num_threads()} threads)")
        print(f"{'variant':36s} {'median s':>10s} {'ratio':>8s}")
        for name, row in summary.items():
            print(f"{name:36s} {row['median_s']:10.4f} {row['ratio']:8.3f}")
        del model, x, variants, tl_variants
        gc.collect()
    report["loadavg_end"] = _loadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
