"""Circuit costs (issue 17): patch_edges of a full circuit and edge_scores EAP-IG, as ratios.

    python benchmarks/circuits.py [--layers 12] [--heads 12] [--d-model 768] [--vocab 50257]
                                  [--rows 2] [--score-rows 20] [--tokens 16] [--threads 2]
                                  [--rounds 2] [--clock wall|cpu] [--out benchmarks/results/circuits.json]
                                  [--only-scores]

GPT-2 shape, random init, eager attention, frozen parameters. Measured in ONE run, reported as
ratios, every measurement interleaved with its baseline (the machine is shared: each round
times the baseline right before and after the measured call, and the ratio of a round is the
call over the mean of its two baselines; the report gives every round and the median):
- patch_edges of a circuit that patches every edge into every receiver (all 25 stages at GPT-2
  small) on --rows rows, over one plain forward of the same batch (issue target: <= 30x;
  absolute target <= 10 s at GPT-2 small, 2 rows, 2 threads);
- edge_scores(method="eap_ig", steps=5) on --score-rows rows, over the bare floor: 5 forwards +
  5 backwards (to the input embedding) with frozen parameters of the same batch (target <= 1.5x).
  Round 1 is a cold call (it captures the graph structure from one row); later rounds reuse the
  structure edge_scores keeps per model (same parameters, same input shape) and are labelled so.
The load average is recorded with the numbers. Results go to benchmarks/results/circuits.json
(or --out). --only-scores runs just the edge_scores part (results: benchmarks/results/circuits_scores.json
unless --out is given).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "circuits.json"


def model_args(results: Path, *, rounds: int) -> argparse.ArgumentParser:
    """The GPT-2-shape options this benchmark and benchmarks/acdc.py share."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--out", default=str(results))
    return ap


def frozen_gpt2(a: argparse.Namespace):
    """A random-init GPT-2 of the parsed shape (eager attention, frozen parameters), with the
    thread count and seed set."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=a.layers, n_head=a.heads, n_embd=a.d_model, vocab_size=a.vocab,
                                       n_positions=max(64, a.tokens), attn_implementation="eager")).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def main() -> None:
    ap = model_args(RESULTS, rounds=2)
    ap.add_argument("--score-rows", type=int, default=20)
    ap.add_argument("--only-scores", action="store_true",
                    help="run only the edge_scores part (patch_edges is skipped and left out of the results)")
    a = ap.parse_args()
    if a.only_scores and a.out == str(RESULTS):  # a partial run never overwrites the full run's results
        a.out = str(RESULTS.with_name("circuits_scores.json"))

    import torch

    import torchlens as tl
    import torchlens_mechinterp as mi

    clock = time.perf_counter if a.clock == "wall" else time.process_time
    model = frozen_gpt2(a)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, a.vocab, (a.rows, a.tokens), generator=g)
    corrupt = torch.randint(0, a.vocab, (a.rows, a.tokens), generator=g)

    def timed(fn):
        t0 = clock()
        out = fn()
        return clock() - t0, out

    def forward():
        with torch.no_grad():
            model(clean)

    def median_forward(n=5):
        return statistics.median(timed(forward)[0] for _ in range(n))

    load = {"before": os.getloadavg()}
    forward()
    patch = None
    if not a.only_scores:
        replayable = tl.options.CaptureOptions(replayable=True)
        ct = tl.trace(model, clean, save="all", capture=replayable)
        kt = tl.trace(model, corrupt, save="all", capture=replayable)
        graph, cgraph = mi.component_graph(ct), mi.component_graph(kt)
        edges = list(graph.edges.values())
        patch_rounds = []
        for _ in range(a.rounds):
            f0 = median_forward()
            t, _fork = timed(lambda: mi.patch_edges(ct, edges, corrupted_graph=cgraph))
            del _fork
            f1 = median_forward()
            patch_rounds.append({"patch_edges_s": t, "forward_s": (f0 + f1) / 2, "ratio": t / ((f0 + f1) / 2)})
        patch = {"edges": len(graph.edges), "vocabulary_edges": graph.vocabulary_edge_count,
                 "receivers": len(graph.receivers), "stages": len(graph.stages()), "rounds": patch_rounds,
                 "median_s": statistics.median(r["patch_edges_s"] for r in patch_rounds),
                 "median_ratio": statistics.median(r["ratio"] for r in patch_rounds),
                 "target": "<= 10 s and <= 30x one plain forward"}
        print(f"patch_edges full circuit: {patch['edges']} edges, {patch['receivers']} receivers, {patch['stages']} "
              f"stages: " + ", ".join(f"{r['patch_edges_s']:.2f} s / fwd {r['forward_s'] * 1e3:.0f} ms = "
                                      f"{r['ratio']:.1f}x" for r in patch_rounds)
              + f"; median {patch['median_s']:.2f} s, {patch['median_ratio']:.1f}x (target <= 10 s, <= 30x)",
              flush=True)
        del ct, kt, graph, cgraph, edges

    sc = torch.randint(0, a.vocab, (a.score_rows, a.tokens), generator=g)
    sk = torch.randint(0, a.vocab, (a.score_rows, a.tokens), generator=g)

    def metric(logits):
        return logits[:, -1, 3] - logits[:, -1, 4]

    def floor():
        for _ in range(5):
            emb = model.transformer.wte(sc).detach().requires_grad_(True)
            m = metric(model(inputs_embeds=emb).logits).sum()
            torch.autograd.grad(m, emb)

    floor()  # warm
    score_rounds = []
    n_edges = 0
    import torchlens_mechinterp.edges as edges_module

    edges_module._PLANS.clear()  # round 1 pays the one-row structure capture; later rounds reuse it
    for i in range(a.rounds):
        f0, _ = timed(floor)
        t, table = timed(lambda: mi.edge_scores(model, sc, corrupted_input=sk, metric=metric, steps=5))
        f1, _ = timed(floor)
        n_edges = len(table)
        del table
        score_rounds.append({"edge_scores_s": t, "floor_s": (f0 + f1) / 2, "ratio": t / ((f0 + f1) / 2),
                             "s_per_row": t / a.score_rows, "structure": "captured" if i == 0 else "cached"})
    scores = {"edges": n_edges, "rounds": score_rounds,
              "cold_ratio": score_rounds[0]["ratio"],
              "cached_median_ratio": (statistics.median(r["ratio"] for r in score_rounds[1:])
                                      if len(score_rounds) > 1 else None),
              "median_ratio": statistics.median(r["ratio"] for r in score_rounds),
              "target": "<= 1.5x the floor (5 forwards + 5 backwards, frozen parameters)"}
    print(f"edge_scores eap_ig 5 steps, {a.score_rows} rows, {n_edges} edges: "
          + ", ".join(f"{r['edge_scores_s']:.2f} s / floor {r['floor_s']:.2f} s = {r['ratio']:.2f}x "
                      f"(structure {r['structure']})" for r in score_rounds)
          + f"; median {scores['median_ratio']:.2f}x (target <= 1.5x)", flush=True)
    load["after"] = os.getloadavg()
    print(f"load average before {load['before']}, after {load['after']} ({os.cpu_count()} CPUs)")
    Path(a.out).write_text(json.dumps({
        "machine": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count(), "load_average": load,
        "clock": a.clock, "patch_edges": patch, "edge_scores": scores, "args": vars(a)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
