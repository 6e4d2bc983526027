"""Circuit costs (issue 17): patch_edges of a full circuit and edge_scores EAP-IG, as ratios.

    python benchmarks/circuits.py [--layers 12] [--heads 12] [--d-model 768] [--vocab 50257]
                                  [--rows 2] [--score-rows 20] [--tokens 16] [--threads 2]

GPT-2 shape, random init, eager attention. Measured in ONE run, reported as ratios:
- patch_edges of a circuit that patches every edge into every receiver (all stages) on --rows
  rows, divided by one plain forward of the same batch (issue target: <= 30x; absolute target
  <= 10 s at GPT-2 small, 2 rows, 2 threads);
- edge_scores(method="eap_ig", steps=5) on --score-rows rows, divided by the bare floor: 5
  forwards + 5 backwards with frozen parameters of the same batch (issue target <= 1.5x).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--score-rows", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import torchlens as tl
    import torchlens_mechinterp as mi

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=a.layers, n_head=a.heads, n_embd=a.d_model, vocab_size=a.vocab,
                                       n_positions=max(64, a.tokens), attn_implementation="eager")).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, a.vocab, (a.rows, a.tokens), generator=g)
    corrupt = torch.randint(0, a.vocab, (a.rows, a.tokens), generator=g)

    def timed(fn, n=1):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn()
        return (time.perf_counter() - t0) / n, out

    with torch.no_grad():
        model(clean)
        t_fwd, _ = timed(lambda: model(clean), 3)
    ct, kt = tl.trace(model, clean, save="all"), tl.trace(model, corrupt, save="all")
    graph, cgraph = mi.component_graph(ct), mi.component_graph(kt)
    t_patch, _ = timed(lambda: mi.patch_edges(ct, list(graph.edges.values()), corrupted_graph=cgraph))
    print(f"patch_edges full circuit: {len(graph.edges)} edges, {len(graph.receivers)} receivers, "
          f"{len(graph.stages())} stages: {t_patch:.2f} s; plain forward {t_fwd * 1e3:.1f} ms; "
          f"ratio {t_patch / t_fwd:.1f}x (target <= 30x)")

    sc = torch.randint(0, a.vocab, (a.score_rows, a.tokens), generator=g)
    sk = torch.randint(0, a.vocab, (a.score_rows, a.tokens), generator=g)

    def metric(logits):
        return logits[:, -1, 3] - logits[:, -1, 4]

    def floor():
        for _ in range(5):
            emb = model.transformer.wte(sc).detach().requires_grad_(True)
            m = metric(model(inputs_embeds=emb).logits).sum()
            torch.autograd.grad(m, emb)

    t_floor, _ = timed(floor)
    t_scores, table = timed(lambda: mi.edge_scores(model, sc, corrupted_input=sk, metric=metric, steps=5))
    print(f"edge_scores eap_ig 5 steps, {a.score_rows} rows: {t_scores:.2f} s ({t_scores / a.score_rows:.3f} s/row); "
          f"floor {t_floor:.2f} s ({t_floor / a.score_rows:.3f} s/row); ratio {t_scores / t_floor:.2f}x "
          f"(target <= 1.5x); {len(table)} edges")


if __name__ == "__main__":
    main()
