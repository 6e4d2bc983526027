"""Time Bundle.draw on a 3-member GPT-2 bundle (12 layers, tiny width, random weights).

    python benchmarks/bundle_draw.py [--layers 12] [--format svg] [--repeat 3]

Members: clean, corrupted (other token ids) and head-ablated (head 0 of block 0 zeroed at
capture). Prints best-of-N wall times measured in this one run for:
  - the union op graph (graph="forward") and the two-column diff (graph="diff"), DOT source
    only and rendered with graphviz `dot`;
  - the same member's own Trace.draw (rendered), as the reference the ratios are taken to.
Target (issue 25): the rendered union graph of the 3-member 12-layer bundle in under 10 s;
the ratio to one Trace.draw says what the bundle renderer adds.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    import torch
    import transformers

    import torchlens as tl

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--format", default="svg")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=32, n_head=2, n_positions=32, vocab_size=100,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 100, (1, 8))
    clean = tl.trace(model, ids)
    site = next(o.label for o in clean if o.func_name == "matmul" and o.module == "transformer.h.0.attn"
                and any(clean._ops[p].func_name == "softmax" for p in o.parents))

    def head0(t, *, ctx):
        t = t.clone()
        t[:, 0] = 0
        return t

    runs = tl.Bundle({"clean": clean, "corrupted": tl.trace(model, torch.randint(0, 100, (1, 8))),
                      "ablated": tl.trace(model, ids, intervene=tl.when(tl.label(site), head0))})
    print(f"bundle: {len(runs)} members, {clean.num_ops} ops each")
    fmt = args.format
    with tempfile.TemporaryDirectory() as tmp:
        def p(name: str, ext: str) -> str:
            return os.path.join(tmp, f"{name}.{ext}")

        single = best(lambda: clean.draw(p("single", fmt)), args.repeat)
        rows = [
            ("union graph, DOT only", best(lambda: runs.draw(p("u", "dot")), args.repeat)),
            (f"union graph, {fmt}", best(lambda: runs.draw(p("u", fmt)), args.repeat)),
            ("diff, DOT only", best(lambda: runs.draw(p("d", "dot"), graph="diff"), args.repeat)),
            (f"diff, {fmt}", best(lambda: runs.draw(p("d", fmt), graph="diff"), args.repeat)),
        ]
    print(f"one member's Trace.draw ({fmt}): {single:.2f} s")
    for name, secs in rows:
        print(f"{name:24s} {secs:6.2f} s   ratio to one Trace.draw {secs / single:5.2f}x")
    union = rows[1][1]
    print(f"target: rendered union graph under 10 s: {'met' if union < 10 else 'MISSED'} ({union:.2f} s)")


if __name__ == "__main__":
    main()
