"""Intervention engines, side by side on GPT-2 small shape (12 layers, d_model 768, random
init, 128 tokens): a plain forward; the replay engine (`trace.do(site, edit)` on a saved
trace, recomputing only the downstream cone); the rerun engine (`trace.do(site, edit,
model=, inputs=)`); and a bound executor (`recipe.bind(model)(ids)`), for an edit in the last
block. Medians of interleaved rounds; ratios to the plain forward and replay/rerun.
Results go to `benchmarks/results/intervention.json`.

    python benchmarks/intervention.py [--rounds 5] [--layers 12] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

import torchlens as tl

RESULTS = Path(__file__).resolve().parent / "results" / "intervention.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=12, n_positions=max(1024, a.tokens))
    model = GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, a.tokens))
    site = tl.module(f"transformer.h.{a.layers - 1}.mlp")
    edit = tl.scale(0.5)
    base = tl.trace(model, ids)

    def plain():
        with torch.no_grad():
            model(ids)

    def replay():
        base.fork().do(site, edit)

    def rerun():
        base.fork().do(site, edit, model=model, inputs=ids)

    bound = tl.when(site, edit).bind(model)

    def bind():
        with torch.no_grad():
            bound(ids)

    variants = {"plain forward": plain, "replay do (last block)": replay, "rerun do (last block)": rerun,
                "bound executor": bind}
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(a.rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            variants[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    check = base.fork().do(site, edit)
    same = torch.equal(check.output_ops[0].out, base.fork().do(site, edit, model=model, inputs=ids).output_ops[0].out)
    rows = {k: {"median_s": med[k], "x_plain": med[k] / med["plain forward"]} for k in med}
    summary = {"replay_over_rerun": med["replay do (last block)"] / med["rerun do (last block)"],
               "replay_reexecuted_ops": check.last_run["num_reexecuted"], "trace_ops": len(base.ops),
               "replay_equals_rerun": same}
    print(f"GPT-2 {a.layers}x{a.width}, {a.tokens} tokens, {a.rounds} rounds, torch threads {torch.get_num_threads()}")
    print(f"{'variant':28s} {'median s':>10s} {'x plain':>8s}")
    for k, r in rows.items():
        print(f"{k:28s} {r['median_s']:10.4f} {r['x_plain']:8.2f}")
    print(f"replay / rerun = {summary['replay_over_rerun']:.3f} (target <= 0.3); replay re-executed "
          f"{summary['replay_reexecuted_ops']} of {summary['trace_ops']} ops; replay == rerun: {same}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.platform(), "torch": torch.__version__, "rows": rows,
                                   "summary": summary, "args": vars(a)}, indent=2))


if __name__ == "__main__":
    main()
