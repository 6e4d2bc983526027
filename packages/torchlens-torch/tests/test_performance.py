"""The capture-overhead targets of benchmarks/capture.py, as an opt-in test.

Timing on shared CI machines is noisy, so this runs only with TORCHLENS_PERF=1:
save="all" on GPT-2 small at 128 tokens at most 1.5x a plain forward, save="none" at most
1.15x (medians of interleaved rounds).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TORCHLENS_PERF") != "1", reason="set TORCHLENS_PERF=1 to run")


def _benchmark_module():
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "capture.py"
    spec = importlib.util.spec_from_file_location("tl_capture_benchmark", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_gpt2_small_capture_overhead():
    pytest.importorskip("transformers")
    bench = _benchmark_module()
    model, x = bench.gpt2_small(128)
    summary = bench.summarize(bench.measure(bench.torchlens_variants(model, x), rounds=7), "plain forward")
    assert summary['tl.trace save="none"']["ratio"] <= 1.15, summary
    assert summary['tl.trace save="all"']["ratio"] <= 1.5, summary
