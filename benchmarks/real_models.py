"""The issue-12 table: the real-model zoo's five acceptance checks, per architecture.

    python benchmarks/real_models.py [NAME ...] [--no-big] [--threads 1] [--json out.json]
    python benchmarks/real_models.py --draw-maskrcnn 30   # issue 12 §4 drawing timings

For each architecture of `torchlens_torch.real_zoo` that installs here (Hugging Face
configs, torchvision/timm from `.venv/vision`, hand-written feature models), prints: traced
ok, output bit-exact, validate verdict (reason and op when False), save/load + validate,
replay zero-ablation == forward-hook ablation, op count and the capture time ratio
(`tl.trace` wall time over one plain forward; one run each, indicative only).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch

from torchlens_torch import real_zoo
from torchlens_torch.real_checks import CHECKS, Check, capture


def _cell(c: Check) -> str:
    return "n/a" if c.ok is None else ("yes" if c.ok else "NO")


def draw_maskrcnn(n_dets: int) -> None:
    """Time `Trace.draw` (DOT build + Graphviz) on torchvision Mask R-CNN with `n_dets`
    detections (30 gives ~2,600 ops, the size issue 12 §4 reports)."""
    import tempfile

    import torchlens as tl
    from torchlens.errors import DrawCostWarning
    from torchlens_torch import vision_env

    tv = vision_env.import_torchvision()
    torch.manual_seed(0)
    model = tv.models.detection.maskrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=91, min_size=128, max_size=128, box_score_thresh=0.0,
        box_detections_per_img=n_dets).eval()
    trace = tl.trace(model, [torch.rand(3, 128, 128)], save="none")
    print(f"Mask R-CNN, {n_dets} detections: {trace.num_ops} ops")
    print("| draw call | drawn nodes | warning | seconds |")
    print("|---|---|---|---|")
    variants = [{}, {"rolled": True}, {"collapse": "none", "layout": "rank"}, {"rolled": True, "layout": "rank"},
                {"collapse": "none"}]
    with tempfile.TemporaryDirectory() as tmp:
        for kw in variants:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always", DrawCostWarning)
                t0 = time.perf_counter()
                d = trace.draw(f"{tmp}/m.svg", **kw)
                dt = time.perf_counter() - t0
            warned = [w.message.fields["estimated_s"] for w in seen if isinstance(w.message, DrawCostWarning)]
            est = f"draw_layout_slow (est. {warned[0]:.0f} s)" if warned else "-"
            print(f"| draw({', '.join(f'{k}={v!r}' for k, v in kw.items())}) | {d.num_nodes} | {est} | {dt:.2f} |",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    ap.add_argument("--no-big", action="store_true", help="skip entries marked big (Mask R-CNN, inception, compile)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--draw-maskrcnn", type=int, default=None, metavar="N_DETS")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.draw_maskrcnn is not None:
        return draw_maskrcnn(args.draw_maskrcnn)
    warnings.simplefilter("ignore")
    names = args.names or real_zoo.names(include_big=not args.no_big)
    cols = ["traced", "output_exact", "validate", "module_hooks", "save_load_validate", "ablation"]
    print("| model | " + " | ".join(cols) + " | ops | capture/plain | failing detail |")
    print("|" + "---|" * (len(cols) + 4))
    rows = []
    for name in names:
        entry = real_zoo.ENTRIES[name]
        if not entry.available():
            print(f"| {name} | not installed ({', '.join(entry.requires)}) |")
            continue
        t0 = time.perf_counter()
        try:
            case = capture(name)
        except Exception as exc:  # a builder that fails here is a row, not a crash
            print(f"| {name} | build failed: {type(exc).__name__}: {str(exc)[:120]} |")
            continue
        results = {k: fn(case) for k, fn in CHECKS.items()}
        ops = len(case.trace.ops) if case.trace is not None else 0
        ratio = case.capture_s / case.plain_s if case.plain_s > 0 and case.trace is not None else float("nan")
        details = "; ".join(f"{k}: {c.detail}" for k, c in results.items() if c.ok is False and c.detail)
        cells = ["yes" if case.trace is not None else "NO"] + [_cell(results[k]) for k in cols[1:]]
        print(f"| {name} | " + " | ".join(cells) + f" | {ops} | {ratio:.1f}x | {details[:240]} |", flush=True)
        rows.append({"model": name, **{k: results[k].ok for k in results}, "traced": case.trace is not None,
                     "ops": ops, "capture_s": case.capture_s, "plain_s": case.plain_s,
                     "details": {k: c.detail for k, c in results.items() if c.ok is False},
                     "wall_s": time.perf_counter() - t0})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
