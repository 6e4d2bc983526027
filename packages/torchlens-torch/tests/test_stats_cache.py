"""`tl.stats.aggregate(..., cache=True, cache_dir=)` (issue 23): a rerun keyed by value restores
the saved states (equal to the uncached run, bit for bit) and skips the loop; any change to
the model, a batch, a metric's starting state, its encoder or loss_fn is a miss; what cannot
be keyed refuses with stats_aggregate_cache_unkeyable; a forged entry is not trusted."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import torchlens as tl
from torchlens.errors import InvalidArgumentError

sys.path.insert(0, os.path.dirname(__file__))
from extract_models import token_data, token_model  # noqa: E402


@pytest.fixture(autouse=True)
def _state_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the HMAC secret lives here, not in cache_dir


class _Calls:
    n = 0  # outside the model: a capture restores attribute writes the forward makes on its modules


class Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = token_model()

    @property
    def calls(self) -> int:
        return _Calls.n

    @calls.setter
    def calls(self, n: int) -> None:
        _Calls.n = n

    def forward(self, ids):
        _Calls.n += 1
        return self.inner(ids)


def _batches(n=24, bs=6, seed=1):
    x = token_data(n=n, seed=seed)
    return [x[i:i + bs] for i in range(0, n, bs)]


def _metrics():
    return {"inner.fc1": tl.stats.Mean(), "inner.act": tl.stats.Covariance()}


def _states(res):
    return {k: v.state_dict() for k, v in res.items()}


def _equal(a, b):
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(np.array_equal(a[k][n], b[k][n]) for n in a[k]) for k in a)


def encode_relu(a):
    return np.maximum(a, 0.0)


def encode_abs(a):
    return np.abs(a)


def test_rerun_restores_states_and_skips_the_loop(tmp_path):
    model, data = Counted(), _batches()
    model.calls = 0
    plain = _states(tl.stats.aggregate(model, data, _metrics()))
    calls = model.calls
    first = _states(tl.stats.aggregate(model, data, _metrics(), cache=True, cache_dir=tmp_path / "c"))
    assert _equal(first, plain)
    assert len(list((tmp_path / "c").glob("*.tlagg"))) == 1
    model.calls = 0
    again = _states(tl.stats.aggregate(model, data, _metrics(), cache=True, cache_dir=tmp_path / "c"))
    assert _equal(again, plain)
    assert model.calls == 1  # only the keying probe ran; the loop over 4 batches did not
    assert calls == len(data)


def test_any_change_is_a_miss(tmp_path):
    model, data = Counted(), _batches()
    c = tmp_path / "c"
    tl.stats.aggregate(model, data, _metrics(), cache=True, cache_dir=c)
    changes = [
        lambda: (model, [d.clone() for d in data[:-1]] + [data[-1].flip(0)], _metrics(), None),  # a batch
        lambda: (model, data, {"inner.fc1": tl.stats.Mean(), "inner.act": tl.stats.Covariance().update(np.ones((2, 12)))},
                 None),  # a starting state
        lambda: (model, data, {"inner.fc1": tl.stats.Mean(), "inner.act": tl.stats.TopK(k=3)}, None),  # a metric
    ]
    for n, change in enumerate(changes, start=2):
        m, d, metrics, _ = change()
        got = _states(tl.stats.aggregate(m, d, metrics, cache=True, cache_dir=c))
        assert len(list(c.glob("*.tlagg"))) == n  # a new entry: it was a miss
        assert _equal(got, _states(tl.stats.aggregate(m, d, change()[2])))
    with torch.no_grad():
        model.inner.fc1.weight.mul_(2.0)  # the model's contents
    tl.stats.aggregate(model, data, _metrics(), cache=True, cache_dir=c)
    assert len(list(c.glob("*.tlagg"))) == len(changes) + 2


def test_encoder_and_loss_fn_are_keyed_by_value(tmp_path):
    model, data = Counted(), _batches(n=12)
    c = tmp_path / "c"
    got = [tl.stats.aggregate(model, data, {"inner.fc1": tl.stats.TopK(k=2, encoder=enc)}, cache=True, cache_dir=c)
           for enc in (encode_relu, encode_abs, encode_relu)]
    assert len(list(c.glob("*.tlagg"))) == 2  # the third run is the first one's hit
    assert got[2]["inner.fc1"].encoder is encode_relu  # the restored state gets the caller's encoder back
    assert _equal(_states(got[2]), _states(got[0]))
    for fn in (lambda out: out.sum(), lambda out: (out ** 2).sum()):
        tl.stats.aggregate(model, data, {tl.grad("inner.fc1"): tl.stats.Mean()}, loss_fn=fn, cache=True, cache_dir=c)
    assert len(list(c.glob("*.tlagg"))) == 4


def test_unkeyable_runs_refuse_before_running(tmp_path):
    model, data = Counted(), _batches(n=12)
    weight = torch.ones(1)
    cases = [
        (iter(data), _metrics(), None),  # one-shot iterator
        (data, {tl.grad("inner.fc1"): tl.stats.Mean()}, lambda out: (out * weight).sum()),  # closure over a tensor
        (data, {tl.grad("inner.fc1"): tl.stats.Mean()}, model.inner),  # a module as loss_fn
    ]
    for loader, metrics, loss in cases:
        model.calls = 0
        with pytest.raises(InvalidArgumentError) as e:
            tl.stats.aggregate(model, loader, metrics, loss_fn=loss, cache=True, cache_dir=tmp_path / "c")
        assert e.value.code == "stats_aggregate_cache_unkeyable"
        assert model.calls == 0
    assert not (tmp_path / "c").exists()


def test_a_forged_or_damaged_entry_is_a_miss(tmp_path):
    model, data = Counted(), _batches(n=12)
    c = tmp_path / "c"
    plain = _states(tl.stats.aggregate(model, data, _metrics(), cache=True, cache_dir=c))
    (entry,) = c.glob("*.tlagg")
    raw = bytearray(entry.read_bytes())
    raw[-1] ^= 0xFF  # the body no longer matches its HMAC
    entry.write_bytes(bytes(raw))
    model.calls = 0
    got = _states(tl.stats.aggregate(model, data, _metrics(), cache=True, cache_dir=c))
    assert _equal(got, plain) and model.calls == 1 + len(data)  # recomputed, not read from the forged entry
