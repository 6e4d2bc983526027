"""Cost of recording generate() token by token (issue 22).

    python benchmarks/generation_stream_cost.py [--tokens 64 128 256 512] [--repeat 3] [--layers 4] [--width 64]

GPT-2 from a config (random weights, greedy). For each generation length N it measures, best of
`--repeat` in this one run:
  - plain `model.generate()` (the reference);
  - `tl.record` of one site with one reducer (`reducers.norm()`), `keep_last=8`: wall time,
    time per token, and `peak_saved_bytes`;
  - `tl.record` of one site, payloads kept (`save=tl.module(...)`): the overhead ratio against
    plain generate().
Targets (issue 22): the per-token time of the reducer run stays within 1.5x between the
shortest and longest run; the peak retained bytes with keep_last=8 stay flat; the one-site
overhead against plain generate() is reported as a ratio (aim <= 1.3x).
"""

from __future__ import annotations

import argparse
import time


def best(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import torchlens as tl

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=4, vocab_size=1000, n_positions=max(a.tokens) + 64,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    site = f"transformer.h.{a.layers // 2}"
    ids = torch.randint(1, 1000, (1, 16))
    R = tl.recording
    rows = []
    for n in a.tokens:
        gk = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False, "pad_token_id": 0}
        opts = R.GenerationOptions(reducers={site: R.reducers.norm()}, keep_last=8)
        runs = {"plain": lambda: model.generate(ids, **gk),
                "reducer": lambda: tl.record(model, ids, generate_kwargs=gk, generation=opts),
                "site": lambda: tl.record(model, ids, save=tl.module(site), generate_kwargs=gk)}
        times: dict = {k: [] for k in runs}
        outs: dict = {}
        for _ in range(a.repeat):  # interleaved, so a load change on the machine hits every kind alike
            for k, fn in runs.items():
                t, outs[k] = best(fn, 1)
                times[k].append(t)
        t_plain, t_red, t_site = (min(times[k]) for k in ("plain", "reducer", "site"))
        ref, g, g1 = outs["plain"], outs["reducer"], outs["site"]
        assert torch.equal(g.sequences, ref) and torch.equal(g1.sequences, ref)
        rows.append((n, t_plain, t_red, t_red / n * 1e3, g.peak_saved_bytes, t_site, t_site / t_plain))
    print(f"GPT-2 {a.layers} layers, width {a.width}, prompt 16, greedy; site {site}; best of {a.repeat}; "
          f"torch threads {a.threads}")
    print(f"{'tokens':>6} {'plain s':>8} {'reducer s':>9} {'ms/token':>9} {'peak B (keep_last=8)':>21} "
          f"{'one-site s':>10} {'overhead':>8}")
    for n, tp, tr, per, peak, ts, ratio in rows:
        print(f"{n:>6} {tp:>8.3f} {tr:>9.3f} {per:>9.3f} {peak:>21} {ts:>10.3f} {ratio:>7.2f}x")
    per_token = [r[3] for r in rows]
    peaks = [r[4] for r in rows]
    print(f"per-token time, longest/shortest run: {per_token[-1] / per_token[0]:.2f}x (target <= 1.5x); "
          f"max/min over runs: {max(per_token) / min(per_token):.2f}x")
    print(f"peak retained bytes with keep_last=8: min {min(peaks)}, max {max(peaks)} (flat: {min(peaks) == max(peaks)})")
    print(f"one-site overhead vs plain generate(): {', '.join(f'{r[6]:.2f}x' for r in rows)} (aim <= 1.3x)")


if __name__ == "__main__":
    main()
