"""ACDC cost (issue 17): per-test cost of the ACDC recipe on GPT-2 small shape, and the projection
of a full walk.

    python benchmarks/acdc.py [--layers 12] [--heads 12] [--d-model 768] [--vocab 50257] [--rows 2]
                              [--tokens 16] [--threads 2] [--rounds 1] [--clock wall|cpu]
                              [--out benchmarks/results/acdc.json]

GPT-2 shape, random init, eager attention, IOI-style prompts from torch.randint tokens (a name
token A, a name token B, B again; the corrupted prompt flips the second B to A). One ACDC test is
one `patch_edges` call of the pruned set plus the trial edge, then the metric (logit difference
A - B at the last position) on the fork, then `fork.cleanup()` -- exactly what
`torchlens.mechinterp.acdc` runs per test. Measured in ONE run, each test timed right between
two plain forwards of the same batch (the machine is shared; the ratio of a round is the test
over the mean of its two baselines):
- a logits-only test: every non-bias edge into logits patched (1 stage);
- a mid test: every edge into the receivers of the upper half of the layers (13 stages at 12 layers);
- an all-receivers test: every edge into every receiver (all 25 stages at GPT-2 small).
Projection: the walk goes from the output back, so a test at a receiver of stage s patches a
set that touches at most the stages from s to logits; each test's cost is interpolated
(piecewise-linear through the three measured points) by that stage count, and summed over every
non-bias edge (bias edges are pruned untested; the unreachable shortcut can only remove tests,
so this is an upper bound for the walk on the same batch); it is reported in hours of the
chosen clock and in plain forwards of the same batch. The load average is recorded.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "acdc.json"


def ioi_prompts(rows: int, tokens: int, vocab: int, seed: int = 0):
    """(clean, corrupted, a, b): random filler tokens with names A at 1, B at 3 and B again at
    tokens - 2; the corrupted prompt has A there instead (the S2 / IO flip)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, vocab, (rows, tokens), generator=g)
    a = torch.randint(0, vocab, (rows,), generator=g)
    b = (a + 1 + torch.randint(0, vocab - 1, (rows,), generator=g)) % vocab
    clean[:, 1], clean[:, 3], clean[:, tokens - 2] = a, b, b
    corrupt = clean.clone()
    corrupt[:, tokens - 2] = a
    return clean, corrupt, a, b


def main() -> None:
    from circuits import frozen_gpt2, model_args  # the same model and options as benchmarks/circuits.py

    a = model_args(RESULTS, rounds=1).parse_args()

    import torch

    import torchlens as tl
    import torchlens_mechinterp as mi
    from torchlens_mechinterp.audit import logits_of

    clock = time.perf_counter if a.clock == "wall" else time.process_time
    model = frozen_gpt2(a)
    clean, corrupt, ta, tb = ioi_prompts(a.rows, a.tokens, a.vocab)
    rows = torch.arange(a.rows)

    def metric(logits):
        return logits[rows, -1, ta] - logits[rows, -1, tb]

    def forward() -> float:
        t0 = clock()
        with torch.no_grad():
            model(clean)
        return clock() - t0

    forward()
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    ready = tl.options.CaptureOptions(replayable=True)
    ct = tl.trace(model, clean, capture=ready, save="all")
    kt = tl.trace(model, corrupt, capture=ready, save="all")
    graph = mi.component_graph(ct)
    cgraph = mi.component_graph(kt)
    setup_s = time.perf_counter() - t0
    stages = [[r.name for r in st] for st in graph.stages()]
    n_stages = len(stages)
    stage_index = {name: i for i, st in enumerate(stages) for name in st}
    non_bias = [n for n, e in graph.edges.items() if e.sender.kind != "bias"]

    def into(first_stage: int) -> list:
        return [graph.edges[n] for n in non_bias if stage_index[graph.edges[n].receiver.name] >= first_stage]

    mid = n_stages - (n_stages // 2 + 1)  # the upper half of the layers plus logits
    tests = {"logits_only": into(n_stages - 1), "mid": into(mid), "all_receivers": into(0)}

    def one_test(edges: list) -> float:
        t0 = clock()
        fork = mi.patch_edges(ct, edges, corrupted_graph=cgraph)
        with torch.no_grad():
            float(metric(logits_of(fork, "benchmark")).mean())
        fork.cleanup()
        return clock() - t0

    one_test(tests["logits_only"])  # warm-up (first-call costs are not a test's)
    measured = {}
    for name, edges in tests.items():
        rounds = []
        for _ in range(a.rounds):
            before = forward()
            s = one_test(edges)
            after = forward()
            rounds.append({"seconds": s, "forward_before": before, "forward_after": after,
                           "ratio_to_forward": s / ((before + after) / 2)})
        touched = len({stage_index[e.receiver.name] for e in edges})
        measured[name] = {"stages": touched, "edges": len(edges),
                          "receivers": len({e.receiver.name for e in edges}),
                          "seconds": statistics.median(r["seconds"] for r in rounds),
                          "ratio_to_forward": statistics.median(r["ratio_to_forward"] for r in rounds),
                          "rounds": rounds}
        print(f"{name}: {measured[name]['stages']} stages, {len(edges)} edges, {measured[name]['seconds']:.2f} s, "
              f"{measured[name]['ratio_to_forward']:.1f}x a forward", flush=True)

    points = sorted((m["stages"], m["seconds"], m["ratio_to_forward"]) for m in measured.values())

    def interp(k: int, col: int) -> float:
        """Piecewise-linear through the measured (stages, cost) points."""
        for (x0, *y0), (x1, *y1) in zip(points, points[1:]):
            if k <= x1:
                return y0[col] + (y1[col] - y0[col]) * (k - x0) / (x1 - x0)
        return points[-1][col + 1]

    def cost(k: int) -> float:
        return interp(k, 0)

    # the walk: receivers from the output back; a test at stage s touches stages s..logits
    walk_tests = 0
    projected = 0.0
    forwards = 0.0
    for n in non_bias:
        s = stage_index[graph.edges[n].receiver.name]
        walk_tests += 1
        projected += cost(n_stages - s)
        forwards += interp(n_stages - s, 1)
    result = {
        "benchmark": "acdc", "issue": 17,
        "shape": {"layers": a.layers, "heads": a.heads, "d_model": a.d_model, "vocab": a.vocab, "rows": a.rows,
                  "tokens": a.tokens, "threads": a.threads, "dtype": "float32", "init": "random"},
        "clock": a.clock, "machine": platform.platform(), "cpu_count": os.cpu_count(),
        "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
        "graph": {"receivers": len(graph.receivers), "edges": len(graph.edges), "non_bias_edges": len(non_bias),
                  "stages": n_stages},
        "setup_seconds": setup_s,
        "tests": measured,
        "cost_model": "piecewise-linear in the stages a test touches, through the three measured tests",
        "projection": {"tests": walk_tests, "hours": projected / 3600, "plain_forwards": forwards,
                       "note": "upper bound: every non-bias edge tested, each test touching every stage from its "
                               "receiver's to logits; the reference projects 450 h (20 rows, 4 cores)"},
    }
    print(f"projection: {walk_tests} tests, {projected / 3600:.1f} h, {forwards:.0f} plain forwards of the batch")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
