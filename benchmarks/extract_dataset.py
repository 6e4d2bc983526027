"""Throughput and memory of `tl.extract_dataset` against a plain forward loop (issue 23).

A GPT-2 small shape model (random init from a config, nothing downloaded) runs over `--rows`
rows of `--tokens` token ids (torch.randint) in batches of `--batch`; `tl.extract_dataset`
keeps 4 sites (MLP outputs spread over the layers) to disk shards, and the plain loop runs
the same batches under no_grad. Both run in this process, interleaved, `--rounds` times; the
table reports the medians and their ratio (the issue's aim: <= 1.3x). Peak memory is
measured in fresh subprocesses (peak RSS) at `--rows` / 2 and 2 x `--rows`, disk mode, to
show it is flat in the number of rows. Results go to benchmarks/results/extract_dataset.json.

    python benchmarks/extract_dataset.py                        # GPT-2 small shape, 512 x 64
    python benchmarks/extract_dataset.py --preset tiny --rows 128 --rounds 2   # a quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "extract_dataset.json"
PRESETS = {"gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257),
           "tiny": dict(n_layer=4, n_embd=64, n_head=4, vocab_size=1000)}


def build(preset: str, tokens: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_positions=max(tokens, 64), attn_implementation="eager", **PRESETS[preset])
    model = GPT2LMHeadModel(cfg).eval()
    n = cfg.n_layer
    sites = [f"transformer.h.{i}.mlp" for i in sorted({0, n // 3, 2 * n // 3, n - 1})]
    return model, sites, cfg.vocab_size


def data(rows: int, tokens: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(1))


def plain(model, ids: torch.Tensor, batch: int) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            model(ids[i:i + batch])
    return time.perf_counter() - t0


def extract(model, ids: torch.Tensor, batch: int, sites: list[str], path: Path | None) -> float:
    import torchlens as tl

    if path is not None and path.exists():
        shutil.rmtree(path)
    t0 = time.perf_counter()
    with torch.no_grad():
        tl.extract_dataset(model, ids, sites, batch_size=batch, path=path, progress=False)
    return time.perf_counter() - t0


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_child(preset: str, rows: int, tokens: int, batch: int) -> None:
    """Subprocess body: one disk-mode run; prints the peak RSS above the RSS just before the
    run (model and data already built), sampled every 2 ms by a thread, in MiB."""
    import threading

    model, sites, vocab = build(preset, tokens)
    ids = data(rows, tokens, vocab)
    extract(model, ids[:batch], batch, sites, None)  # warm-up: allocator pools, lazy imports
    base, top, stop = _rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            top[0] = max(top[0], _rss_mib())
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    with tempfile.TemporaryDirectory() as d:
        extract(model, ids, batch, sites, Path(d) / "run")
    stop.set()
    th.join()
    print(json.dumps({"peak_rss_mib": max(top[0], _rss_mib()), "base_rss_mib": base,
                      "peak_over_base_mib": max(top[0], _rss_mib()) - base}))


def peak(preset: str, rows: int, tokens: int, batch: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--peak-child", "--preset", preset, "--rows", str(rows),
                          "--tokens", str(tokens), "--batch", str(batch)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpt2")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--peak-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peak_child:
        peak_child(a.preset, a.rows, a.tokens, a.batch)
        return
    model, sites, vocab = build(a.preset, a.tokens)
    ids = data(a.rows, a.tokens, vocab)
    times: dict[str, list[float]] = {"plain": [], "extract_disk": [], "extract_memory": []}
    with tempfile.TemporaryDirectory() as d:
        plain(model, ids[: a.batch], a.batch)  # warm-up
        extract(model, ids[: a.batch], a.batch, sites, None)
        for r in range(a.rounds):
            order = ["plain", "extract_disk", "extract_memory"]
            order = order[r % 3:] + order[: r % 3]
            for name in order:
                if name == "plain":
                    times[name].append(plain(model, ids, a.batch))
                else:
                    times[name].append(extract(model, ids, a.batch, sites,
                                               Path(d) / "run" if name == "extract_disk" else None))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "preset": a.preset, "rows": a.rows, "tokens": a.tokens, "batch": a.batch, "sites": sites, "rounds": a.rounds,
        "median_s": med, "ratio_disk": med["extract_disk"] / med["plain"], "ratio_memory": med["extract_memory"] / med["plain"],
        "rows_per_s_disk": a.rows / med["extract_disk"], "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "threads": torch.get_num_threads(),
    }
    if not a.no_memory:
        small, big = peak(a.preset, a.rows // 2, a.tokens, a.batch), peak(a.preset, a.rows * 2, a.tokens, a.batch)
        result["peak_rss_mib"] = {str(a.rows // 2): small, str(a.rows * 2): big}
        result["peak_ratio"] = big["peak_rss_mib"] / small["peak_rss_mib"]
        result["peak_over_base_ratio"] = big["peak_over_base_mib"] / max(small["peak_over_base_mib"], 1e-9)
    print(f"{'variant':16} {'median s':>10} {'ratio':>7}")
    for k in times:
        print(f"{k:16} {med[k]:10.3f} {med[k] / med['plain']:7.2f}x")
    if "peak_ratio" in result:
        print(f"peak RSS {result['peak_rss_mib']} MiB -> ratio {result['peak_ratio']:.3f} "
              f"(over base: {result['peak_over_base_ratio']:.3f})")
    RESULTS.parent.mkdir(exist_ok=True)
    allres = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    allres[f"{a.preset}_{a.rows}x{a.tokens}"] = result
    RESULTS.write_text(json.dumps(allres, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
