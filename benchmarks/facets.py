"""Facet reads, on GPT-2 small shape (12 layers, d_model 768, random init, 128 tokens):
reading EVERY facet of every module (structural outputs, attention q/k/v/scores/pattern/z/
result, residual and MLP facets) on a fresh `save="all"` trace, against one plain forward.
The timed read includes running the recipes (dataflow discovery) and materialising every
value; the capture itself is not timed. Medians of interleaved rounds; the ratio is the
facet read over the plain forward (issue 15 aims at <= 1x: facets are views plus a few
matmuls). Results go to `benchmarks/results/facets.json`.

    python benchmarks/facets.py [--rounds 3] [--layers 12] [--tokens 128]
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

RESULTS = Path(__file__).resolve().parent / "results" / "facets.json"


def read_every_facet(log) -> int:
    n = 0
    for module in log.modules:
        for call in module.calls:
            f = call.facets
            for name in f.keys():
                f[name].value
                n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--attn", default="sdpa")
    a = ap.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=12, n_positions=max(1024, a.tokens),
                     attn_implementation=a.attn)
    model = GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, a.tokens))
    plain_t, facet_t, counts = [], [], []
    for r in range(a.rounds):
        log = tl.trace(model, ids, save="all")
        order = ("plain", "facets") if r % 2 == 0 else ("facets", "plain")
        for k in order:
            t0 = time.perf_counter()
            if k == "plain":
                with torch.no_grad():
                    model(ids)
                plain_t.append(time.perf_counter() - t0)
            else:
                with torch.no_grad():
                    counts.append(read_every_facet(log))
                facet_t.append(time.perf_counter() - t0)
        del log
    plain, facets = statistics.median(plain_t), statistics.median(facet_t)
    log = tl.trace(model, ids, save="all")
    attn = log.attention_blocks()
    summary = {"plain_forward_s": plain, "read_every_facet_s": facets, "x_plain": facets / plain,
               "facets_read": counts[-1], "attention_modules": len(attn),
               "facets_per_attention_module": len(attn[0].facets.keys()) if attn else 0}
    print(f"GPT-2 {a.layers}x{a.width} ({a.attn}), {a.tokens} tokens, {a.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}")
    print(f"plain forward        {plain:8.4f} s")
    print(f"read every facet     {facets:8.4f} s  ({counts[-1]} facets)  = {facets / plain:.2f}x plain (aim <= 1x)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.platform(), "torch": torch.__version__, "summary": summary,
                                   "args": vars(a)}, indent=2))


if __name__ == "__main__":
    main()
