"""Throughput and memory of `tl.extract_dataset` against a plain forward loop (issue 23).

A GPT-2 small shape model (random init from a config, nothing downloaded) runs over `--rows`
rows of `--tokens` token ids (torch.randint) in batches of `--batch`; `tl.extract_dataset`
keeps 4 sites (MLP outputs spread over the layers) to disk shards, and the plain loop runs
the same batches under no_grad. Both run in this process, interleaved, `--rounds` times; the
table reports the medians and their ratio (the issue's aim: <= 1.3x). Peak memory is
measured in fresh subprocesses (peak RSS) at `--rows` / 2 and 2 x `--rows`, disk mode, to
show it is flat in the number of rows (the issue's aim: 256 vs 1024 rows within 10%). A third
row compares the peak memory of one `tl.trace(model, batch, save=...)` for "stats" (folded
during the forward), "all" and a plain forward, each in a fresh subprocess (memory only, one
run). Results go to benchmarks/results/extract_dataset.json (one entry per preset and size).

    python benchmarks/extract_dataset.py                        # GPT-2 small shape, 512 x 64, 3 rounds
    python benchmarks/extract_dataset.py --clock cpu            # process CPU time (robust under load)
    python benchmarks/extract_dataset.py --quick                # tiny model, 64 x 32: checks the script runs
    python benchmarks/extract_dataset.py --only stats-memory    # just the save="stats" vs "all" memory row

`--clock cpu` times with `time.process_time()` (every thread of this process, torch's
intra-op threads included), which a loaded machine disturbs far less than wall time.
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


CLOCK = [time.perf_counter]  # --clock cpu: time.process_time


def plain(model, ids: torch.Tensor, batch: int) -> float:
    clock = CLOCK[0]
    t0 = clock()
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            model(ids[i:i + batch])
    return clock() - t0


def extract(model, ids: torch.Tensor, batch: int, sites: list[str], path: Path | None) -> float:
    import torchlens as tl

    if path is not None and path.exists():
        shutil.rmtree(path)
    clock = CLOCK[0]
    t0 = clock()
    with torch.no_grad():
        tl.extract_dataset(model, ids, sites, batch_size=batch, path=path, progress=False)
    return clock() - t0


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


def trace_peak_child(preset: str, tokens: int, batch: int, mode: str) -> None:
    """Subprocess body: the peak RSS over the RSS just before one `tl.trace(model, ids,
    save=mode)` of a `batch` x `tokens` batch under no_grad (mode "plain": the model's own
    forward), after a one-row warm-up in the same mode; sampled every 1 ms by a thread, in MiB."""
    import gc
    import threading

    import torchlens as tl

    model, _, vocab = build(preset, tokens)
    ids = data(batch, tokens, vocab)
    with torch.no_grad():  # warm-up, the same mode on one row: allocator pools, lazy imports, first-call costs
        model(ids)
        if mode != "plain":
            del_me = tl.trace(model, ids[:1], save=mode)
            del del_me
    gc.collect()
    base, top, stop = _rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            top[0] = max(top[0], _rss_mib())
            time.sleep(0.001)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    fold = None
    with torch.no_grad():
        if mode == "plain":
            model(ids)
        else:
            t = tl.trace(model, ids, save=mode)
            fold = t.provenance.extra.get("stats_fold")
            ops = len(t.labels)
    stop.set()
    th.join()
    hi = max(top[0], _rss_mib())
    print(json.dumps({"mode": mode, "peak_over_base_mib": hi - base, "peak_rss_mib": hi, "base_rss_mib": base,
                      "stats_fold": fold, **({"ops": ops} if mode != "plain" else {})}))


def trace_peaks(preset: str, tokens: int, batch: int) -> dict:
    """The save="stats" vs save="all" (vs plain forward) memory row, each mode in a fresh process."""
    rows = {}
    for mode in ("plain", "stats", "all"):
        out = subprocess.run([sys.executable, __file__, "--trace-peak-child", mode, "--preset", preset,
                              "--tokens", str(tokens), "--batch", str(batch)], capture_output=True, text=True, check=True)
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    plain_mib = max(rows["plain"]["peak_over_base_mib"], 1.0)
    return {"preset": preset, "batch": batch, "tokens": tokens, "runs": 1, "modes": rows,
            "stats_over_plain": rows["stats"]["peak_over_base_mib"] / plain_mib,
            "all_over_plain": rows["all"]["peak_over_base_mib"] / plain_mib,
            "stats_over_all": rows["stats"]["peak_over_base_mib"] / max(rows["all"]["peak_over_base_mib"], 1.0)}


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in __import__("os").getloadavg())
    except OSError:
        return "?"


def _save(key: str, result: dict) -> None:
    RESULTS.parent.mkdir(exist_ok=True)
    allres = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    allres[key] = result
    RESULTS.write_text(json.dumps(allres, indent=1, sort_keys=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpt2")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: time.perf_counter; cpu: time.process_time (this process's CPU, all threads)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny preset, 64 rows x 32 tokens, batch 16, 3 rounds: checks the whole script quickly")
    ap.add_argument("--only", choices=("throughput", "stats-memory"), default=None,
                    help="run one part (default: throughput + row-memory check, then the stats-memory row)")
    ap.add_argument("--stats-batch", type=int, default=8, help="batch rows of the save='stats' vs 'all' trace")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--peak-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trace-peak-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.preset, a.rows, a.tokens, a.batch, a.rounds, a.stats_batch = "tiny", 64, 32, 16, 3, 8
    if a.peak_child:
        peak_child(a.preset, a.rows, a.tokens, a.batch)
        return
    if a.trace_peak_child:
        trace_peak_child(a.preset, a.tokens, a.batch, a.trace_peak_child)
        return
    CLOCK[0] = time.process_time if a.clock == "cpu" else time.perf_counter
    if a.only != "stats-memory":
        throughput(a)
    if a.only != "throughput" and not a.no_memory:
        row = trace_peaks(a.preset, a.tokens, a.stats_batch)
        row.update(quick=a.quick, loadavg_before=_load(), torch=torch.__version__, threads=torch.get_num_threads())
        m = row["modes"]
        print(f"one trace of {a.stats_batch} x {a.tokens} ({a.preset}), peak RSS over base: plain "
              f"{m['plain']['peak_over_base_mib']:.1f} MiB, save='stats' {m['stats']['peak_over_base_mib']:.1f} MiB "
              f"(fold: {m['stats']['stats_fold']}), save='all' {m['all']['peak_over_base_mib']:.1f} MiB "
              f"-> stats/all {row['stats_over_all']:.3f}")
        _save(f"stats_memory_{a.preset}_{a.stats_batch}x{a.tokens}", row)


def throughput(a: argparse.Namespace) -> None:
    load_before = _load()
    model, sites, vocab = build(a.preset, a.tokens)
    ids = data(a.rows, a.tokens, vocab)
    times: dict[str, list[float]] = {"plain": [], "extract_disk": [], "extract_memory": []}
    with tempfile.TemporaryDirectory() as d:
        plain(model, ids[: a.batch], a.batch)  # warm-up
        extract(model, ids[: a.batch], a.batch, sites, None)
        for r in range(a.rounds):  # interleaved: each round runs all three, in a rotated order
            order = ["plain", "extract_disk", "extract_memory"]
            order = order[r % 3:] + order[: r % 3]
            for name in order:
                if name == "plain":
                    times[name].append(plain(model, ids, a.batch))
                else:
                    times[name].append(extract(model, ids, a.batch, sites,
                                               Path(d) / "run" if name == "extract_disk" else None))
    med = {k: statistics.median(v) for k, v in times.items()}
    # per-round ratios (same round, same load) next to the ratio of medians
    per_round = {k: [t / p for t, p in zip(times[k], times["plain"])] for k in ("extract_disk", "extract_memory")}
    result = {
        "preset": a.preset, "rows": a.rows, "tokens": a.tokens, "batch": a.batch, "sites": sites, "rounds": a.rounds,
        "clock": a.clock, "quick": a.quick, "times_s": times, "per_round_ratio": per_round,
        "median_s": med, "ratio_disk": med["extract_disk"] / med["plain"], "ratio_memory": med["extract_memory"] / med["plain"],
        "aim_ratio": 1.3, "rows_per_s_disk": a.rows / med["extract_disk"], "torch": torch.__version__,
        "python": platform.python_version(), "machine": platform.machine(), "threads": torch.get_num_threads(),
        "loadavg_before": load_before, "loadavg_after": _load(),
    }
    if not a.no_memory:
        small, big = peak(a.preset, a.rows // 2, a.tokens, a.batch), peak(a.preset, a.rows * 2, a.tokens, a.batch)
        result["peak_rss_mib"] = {str(a.rows // 2): small, str(a.rows * 2): big}
        result["peak_ratio"] = big["peak_rss_mib"] / small["peak_rss_mib"]
        result["peak_over_base_ratio"] = big["peak_over_base_mib"] / max(small["peak_over_base_mib"], 1e-9)
        result["peak_flat_within_10pct"] = result["peak_ratio"] <= 1.10
    print(f"{'variant':16} {'median s':>10} {'ratio':>7}   ({a.clock} clock, {a.rounds} interleaved rounds, "
          f"load {load_before})")
    for k in times:
        print(f"{k:16} {med[k]:10.3f} {med[k] / med['plain']:7.2f}x")
    if "peak_ratio" in result:
        print(f"peak RSS {a.rows // 2} vs {a.rows * 2} rows: {small['peak_rss_mib']:.1f} vs {big['peak_rss_mib']:.1f} MiB "
              f"-> ratio {result['peak_ratio']:.3f} (over base: {result['peak_over_base_ratio']:.3f}; "
              f"flat within 10%: {result['peak_flat_within_10pct']})")
    _save(f"{a.preset}_{a.rows}x{a.tokens}" + ("_quick" if a.quick else ""), result)


if __name__ == "__main__":
    main()
