"""save="stats" on torch folds each op's out DURING the forward (issue 23): the Recorder saves a
16-slot float64 summary in place of a payload and keeps no intermediate alive.

Oracles: NumPy statistics of forward-hook outputs and of the same tensors (`_hand`,
`tl.stats.RunningStats` over NumPy arrays), the graph of a `save="all"` capture of the same
forward, and the tensor storage alive inside the last module of a plain forward (counted
over `gc.get_objects()`)."""

from __future__ import annotations

import gc
import math
import os
import sys
import warnings

import numpy as np
import pytest
import torch

import torchlens as tl
import torchlens.backends.sdk as sdk
import torchlens_torch.stats_fold as stats_fold

sys.path.insert(0, os.path.dirname(__file__))
from extract_models import hooked, token_data, token_model  # noqa: E402
from test_stats_capture import _check, _hand  # noqa: E402


def test_torch_folds_during_the_forward_and_says_so():
    model, x = token_model(), token_data(n=5)
    t = tl.trace(model, x, save="stats")
    assert t.provenance.extra["stats_fold"] == "forward"
    assert t.options.save == "stats"
    assert "stats_fold_late" not in t.provenance.extra  # every saved slot was a folded summary
    assert all(o is None for op in t.ops for o in op._outputs)  # no payload and no summary left on the ops
    want = hooked(model, x, ["emb", "fc1", "act", "fc2"])
    stats = tl.stats.site_stats(t)
    for name, out in want.items():
        (label,) = [o.label for o in t.ops if o.module == name]
        _check(stats[label], _hand(out.numpy()))


def test_forward_fold_equals_the_after_capture_fold(monkeypatch):
    """The same capture with the offer declined (as a backend without the hook does) is
    folded after the capture from payloads: both paths give the same statistics."""
    model, x = token_model(), token_data(n=9)
    during = tl.stats.site_stats(tl.trace(model, x, save="stats"))
    monkeypatch.setattr(sdk, "take_stats_fold", lambda: False)
    t_after = tl.trace(model, x, save="stats")
    assert t_after.provenance.extra["stats_fold"] == "after_capture"
    after = tl.stats.site_stats(t_after)
    assert list(during) == list(after)
    for label in during:
        a, b = during[label].vector, after[label].vector
        assert np.allclose(a, b, rtol=1e-12, atol=1e-12, equal_nan=True), (label, a, b)


def _odd_tensor(n: int = 5003) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    a = torch.randn(n, generator=g) * 4 + 2
    a[[3, 17, 4000]] = float("nan")
    a[[5, 2500]] = float("inf")
    a[[11]] = -float("inf")
    a[100:130] = 0.0
    return a


@pytest.mark.parametrize("chunk", [1 << 20, 1000, 7])
def test_chunked_fold_equals_numpy(monkeypatch, chunk):
    """A tensor folded in chunks (combined with the pairwise formulas) equals NumPy's summary
    of the whole tensor, non-finite values and zeros included."""
    monkeypatch.setattr(stats_fold, "CHUNK", chunk)
    strided = _odd_tensor(6000).view(20, 30, 10).permute(2, 0, 1)  # non-contiguous: read in views, not copied whole
    for a in (_odd_tensor(), _odd_tensor().to(torch.float16), torch.arange(-50, 2000, dtype=torch.int64),
              torch.rand(3001) > 0.3, torch.full((1500,), float("nan")), strided, strided[:, 3:, ::2]):
        got = stats_fold.vector(a).numpy()
        host = a.contiguous().float() if a.dtype == torch.float16 else a.contiguous()
        want = tl.stats.RunningStats().update(host.numpy()).vector
        assert got.shape == (16,)
        _close(got, want, a.dtype)


def _close(got: np.ndarray, want: np.ndarray, what: object) -> None:
    """rel 1e-9; m3 (a sum of signed cubes, near 0 for symmetric data) against its scale
    sqrt(m2 * m4), which bounds |m3| (Cauchy-Schwarz)."""
    atol = np.full(16, 1e-9)
    atol[3] = 1e-9 * math.sqrt(abs(want[2] * want[4]))
    assert np.allclose(got, want, rtol=1e-9, atol=atol, equal_nan=True), (what, got, want)


def test_unreadable_and_empty_outs_fold_to_the_empty_summary():
    empty = tl.stats.RunningStats().vector
    for t in (torch.zeros(0, 3), torch.randn(4, dtype=torch.complex64), torch.empty(3, device="meta")):
        assert np.array_equal(stats_fold.vector(t).numpy(), empty), t.dtype


def test_a_traced_op_folded_in_chunks_equals_the_hook_output(monkeypatch):
    monkeypatch.setattr(stats_fold, "CHUNK", 64)

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 40)

        def forward(self, x):
            return torch.log(self.lin(x))  # negative -> nan, the rest finite

    torch.manual_seed(0)
    model, x = Odd().eval(), torch.randn(30, 16)
    want = hooked(model, x, ["lin"])["lin"]
    t = tl.trace(model, x, save="stats", capture=tl.options.CaptureOptions(on_nonfinite="ignore"))
    stats = tl.stats.site_stats(t)
    (lin,) = [o.label for o in t.ops if o.module == "lin"]
    _check(stats[lin], _hand(want.numpy()))
    (log,) = [o.label for o in t.ops if o.func_name.endswith("log")]
    _check(stats[log], _hand(torch.log(want).numpy()))


def _storage_bytes() -> int:
    """Bytes of CPU tensor storage reachable from live Python tensor objects right now."""
    seen: dict[int, int] = {}
    with warnings.catch_warnings(), torch._C.DisableTorchFunction():  # not recorded as ops
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and o.device.type == "cpu":
                try:  # fake / functional tensors other tests left alive have no data pointer
                    s = o.untyped_storage()
                    seen[s.data_ptr()] = s.nbytes()
                except (RuntimeError, NotImplementedError, TypeError):
                    continue
    return sum(seen.values())


PROBES: list[int] = []


class _Probe(torch.nn.Module):
    def forward(self, x):
        PROBES.append(_storage_bytes())
        return x.sum()


class _Big(torch.nn.Module):
    """Eighteen 1 MiB intermediates, each dead once the next one exists."""

    def __init__(self):
        super().__init__()
        self.probe = _Probe()

    def forward(self, x):
        for _ in range(6):
            x = torch.relu(x * 1.5 - 0.1)
        return self.probe(x)


def test_save_stats_keeps_no_intermediate_alive_during_the_forward(monkeypatch):
    """Storage alive inside the last module: a plain forward's, plus at most 128 KiB (the
    fold's scratch buffers, 2 x 4096 x 9 bytes here, and the summaries) under save="stats"; a
    save="all" capture (payloads) holds the intermediates."""
    monkeypatch.setattr(stats_fold, "CHUNK", 4096)
    model, x = _Big(), torch.randn(1 << 18)
    seen = {}
    with torch.no_grad():
        for mode in ("plain", "stats", "all", "stats"):
            gc.collect()
            if mode == "plain":
                model(x)
            else:
                t = tl.trace(model, x, save=mode)
                if mode == "stats":
                    assert all(o is None for op in t.ops for o in op._outputs)
                del t
            seen[mode] = PROBES[-1]
    mib = 1 << 20
    assert seen["all"] - seen["plain"] >= 12 * mib  # the measure sees kept payloads
    assert seen["stats"] - seen["plain"] <= 128 * 1024, (seen["stats"] - seen["plain"])


def test_graph_equals_a_save_all_capture_although_ids_are_reused():
    """Freed intermediates give their ids to later tensors; a dropped tag keeps the graph
    right: labels and parents equal a save="all" capture (which keeps every out alive)."""

    class Churn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = x
            for i in range(12):
                tmp = torch.tanh(self.lin(h)) * (i + 1)
                h = h + tmp.mean(dim=-1, keepdim=True) - tmp
                del tmp  # its id is free now: the next tensor object likely takes it
                with torch._C.DisableTorchFunction():  # a tensor no recorded op made (read as a constant)
                    c = torch.full((4, 8), 0.5 + i)
                h = h * c
            return h

    torch.manual_seed(1)
    model, x = Churn().eval(), torch.randn(4, 8)
    with torch.no_grad():
        ts, ta = tl.trace(model, x, save="stats"), tl.trace(model, x, save="all")
    assert ts.labels == ta.labels
    assert [ts.ops[lab].parents for lab in ts.labels] == [ta.ops[lab].parents for lab in ta.labels]
    stats = tl.stats.site_stats(ts)
    for lab in ta.labels:
        op = ta.ops[lab]
        if op.saved and isinstance(op.out, torch.Tensor):
            want = tl.stats.RunningStats().update(op.out.detach().numpy()).vector
            assert np.allclose(stats[lab].vector, want, rtol=1e-9, atol=1e-12, equal_nan=True), lab


def test_a_failed_stats_capture_leaves_no_offer_behind():
    class Boom(torch.nn.Module):
        def forward(self, x):
            y = torch.relu(x)
            raise ValueError("boom")

    with pytest.raises(Exception):
        tl.trace(Boom(), torch.randn(3), save="stats")
    assert sdk.take_stats_fold() is False  # the offer closed with the capture
    model, x = token_model(), token_data(n=2)
    t = tl.trace(model, x)  # a plain capture afterwards keeps real payloads
    assert all(isinstance(op.out, torch.Tensor) for op in t.ops if op.saved)


def test_fold_math_is_not_in_the_trace():
    """The fold's own torch calls are not recorded: the op list equals a save='none' capture's."""
    model, x = token_model(), token_data(n=3)
    assert tl.trace(model, x, save="stats").labels == tl.trace(model, x, save="none").labels
    assert math.isfinite(tl.stats.site_stats(tl.trace(model, x, save="stats"))[
        tl.trace(model, x, save="none").labels[1]].result()["mean"])


def test_an_intervened_stats_capture_folds_after_capture_and_sees_the_edit():
    """intervene= runs core's live capture (two backend captures): the fold is not offered, so
    it runs after the capture, on the edited values (a zero ablation: every element is 0)."""
    model, x = token_model(), token_data(n=3)
    t = tl.trace(model, x, save="stats", intervene=tl.when(tl.module("act"), tl.zero_ablate()))
    assert t.provenance.extra["stats_fold"] == "after_capture"
    (act,) = [o.label for o in t.ops if o.module == "act"]
    got = tl.stats.site_stats(t)[act].result()
    assert got["zero_count"] == got["numel"] == 3 * 6 * 12
