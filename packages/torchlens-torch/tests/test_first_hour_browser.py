"""Issue 27: the notebook HTML of a GPT-2 trace, rendered by a real browser (headless Chromium).

A screenshot lands in the test's tmp dir (its path is printed and recorded as the test
property `screenshot`), and Chromium's serialised DOM (`--dump-dom`, after parsing and
layout) is checked for the structure: the headings, one table row per op, the collapsible
module sections and the attention heatmaps. Skips cleanly when no Chromium is installed
(scripts/setup.sh installs Debian's `chromium` when run as root).
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess

import pytest
import torch

import torchlens as tl

transformers = pytest.importorskip("transformers")

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)")


def _chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--hide-scrollbars", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def gpt2_page(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg).eval()
    trace = tl.trace(model, torch.randint(0, 100, (1, 8)))
    probs = next(o for o in trace if o.func_name == "softmax")
    parts = [trace._repr_html_(), probs._repr_html_(), trace.modules["transformer.h.0"]._repr_html_()]
    page = tmp_path_factory.mktemp("notebook") / "gpt2.html"
    page.write_text("<!doctype html><html><head><meta charset='utf-8'><title>gpt2 trace</title></head><body>"
                    + "".join(parts) + "</body></html>", encoding="utf-8")
    return trace, probs, page


def test_gpt2_notebook_html_screenshot(gpt2_page, record_property):
    _, _, page = gpt2_page
    shot = page.with_suffix(".png")
    res = _chromium(f"--screenshot={shot}", "--window-size=1400,2000", page.as_uri())
    assert shot.exists(), res.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1400, 2000) and len(data) > 20_000  # a rendered page, not a blank one
    record_property("screenshot", str(shot))
    print(f"\nscreenshot: {shot}")


def test_gpt2_notebook_dom_has_table_headings_sections_and_heatmaps(gpt2_page):
    trace, probs, page = gpt2_page
    res = _chromium("--dump-dom", page.as_uri())
    dom = res.stdout
    assert "</html>" in dom, res.stderr[-2000:]
    headings = re.findall(r"<h3>(.*?)</h3>", dom)
    assert headings == ["Trace of GPT2LMHeadModel", f"Op {probs.label}", "Module transformer.h.0"]
    # the browser kept every op row inside a table: one <tr> whose first cell is the op label
    first_cells = re.findall(r"<tr><td class=\"m\">([^<]+)</td>", dom)
    assert [op.label for op in trace] == first_cells[:trace.num_ops]
    calls = {c for op in trace for c in op.module_calls if not c.startswith("self:")}
    assert len(re.findall(r"<details open=\"\" class=\"mod\">", dom)) == len(calls)
    assert "<summary>transformer.h.1:1<span" in dom
    n_softmax = sum(1 for o in trace if o.func_name == "softmax")
    # one compact heatmap per attention softmax row, one per head (2) on the Op card
    assert len(re.findall(r"<svg class=\"attn\"", dom)) == n_softmax + cfg_heads(probs)
    assert "<script" not in dom


def cfg_heads(op) -> int:
    return int(op.shape[1])
