"""Reduce and discard (issue 23): `tl.trace(model, x, save="stats")` keeps one RunningStats per
op and no payload. Each op's summary is checked against statistics computed by hand (NumPy)
from forward-hook outputs of a plain forward; payload reads, replay and validation refuse."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

import torchlens as tl
from torchlens.errors import InvalidArgumentError, PayloadUnavailableError

sys.path.insert(0, os.path.dirname(__file__))
from extract_models import hooked, token_data, token_model  # noqa: E402


def _hand(a: np.ndarray) -> dict[str, float]:
    a = a.astype(np.float64).ravel()
    f = a[np.isfinite(a)]
    return {"numel": a.size, "count": f.size, "mean": f.mean(), "min": f.min(), "max": f.max(),
            "var": f.var(ddof=1), "abs_mean": np.abs(f).mean(), "abs_max": np.abs(f).max(),
            "m3": ((f - f.mean()) ** 3).sum(), "m4": ((f - f.mean()) ** 4).sum(),
            "nan_count": np.isnan(a).sum(), "posinf_count": np.isposinf(a).sum(), "neginf_count": np.isneginf(a).sum(),
            "zero_count": (a == 0).sum(), "positive_count": (a > 0).sum(), "negative_count": (a < 0).sum()}


def _check(rs: tl.stats.RunningStats, want: dict[str, float]) -> None:
    got = rs.result()
    for k, v in want.items():
        assert math.isclose(got[k], float(v), rel_tol=1e-9, abs_tol=1e-12), (k, got[k], v)


def test_site_stats_equal_hand_computed_stats_of_hook_outputs():
    model, x = token_model(), token_data(n=7)
    want = hooked(model, x, ["emb", "fc1", "act", "fc2"])
    t = tl.trace(model, x, save="stats")
    stats = tl.stats.site_stats(t)
    assert list(stats) == list(t.labels)  # one RunningStats per op, in execution order
    for name in want:
        (label,) = [o.label for o in t.ops if o.module == name]  # one op per module in this model
        assert stats[label].vector.shape == (16,)
        _check(stats[label], _hand(want[name].numpy()))
    assert all(not op.saved for op in t.ops)  # no payload kept


def test_nonfinite_and_zero_counts_follow_the_hook_output():
    class Odd(torch.nn.Module):
        def forward(self, x):
            return torch.log(x)  # log(0) = -inf, log(-1) = nan, log(1) = 0

    x = torch.tensor([[0.0, -1.0, 1.0, 2.0], [3.0, 0.5, 0.0, -2.0]])
    t = tl.trace(Odd(), x, save="stats", capture=tl.options.CaptureOptions(on_nonfinite="ignore"))
    log_label = [o.label for o in t.ops if o.func_name.endswith("log")][0]
    _check(tl.stats.site_stats(t)[log_label], _hand(torch.log(x).numpy()))


def test_payload_reads_replay_and_validation_refuse_typed():
    model, x = token_model(), token_data(n=3)
    t = tl.trace(model, x, save="stats")
    label = [o.label for o in t.ops if o.module == "act"][0]
    with pytest.raises(PayloadUnavailableError) as e:
        t.ops[label].out
    assert e.value.code == "activation_reduced_to_stats" and "site_stats" in e.value.remedy
    with pytest.raises(PayloadUnavailableError) as e:
        t.layers[t.ops[label].layer_label].out
    assert e.value.code == "activation_reduced_to_stats"
    for call in (t.validate_forward_pass, lambda: t.do(label, tl.zero_ablate()), t.fork,
                 lambda: t.run(model, x)):
        with pytest.raises(InvalidArgumentError) as e:
            call()
        assert e.value.code == "stats_capture_not_replayable"
    assert torch.equal(t.output, model(x))  # the forward's return is still given back


def test_site_stats_refuses_a_payload_trace_and_save_stats_is_trace_only():
    model, x = token_model(), token_data(n=2)
    with pytest.raises(InvalidArgumentError) as e:
        tl.stats.site_stats(tl.trace(model, x))
    assert e.value.code == "stats_capture_required"
    from torchlens.build.save import save_plan

    with pytest.raises(InvalidArgumentError) as e:
        save_plan("stats")
    assert e.value.code == "save_spec_invalid"


def test_site_stats_are_copies():
    model, x = token_model(), token_data(n=2)
    t = tl.trace(model, x, save="stats")
    a = tl.stats.site_stats(t)
    first = next(iter(a))
    before = a[first].vector
    a[first].update(np.ones(100))
    assert np.array_equal(tl.stats.site_stats(t)[first].vector, before)


def test_a_copy_stays_reduced():
    model, x = token_model(), token_data(n=2)
    t = tl.trace(model, x, save="stats")
    c = t.copy()
    assert {k: v.vector.tolist() for k, v in tl.stats.site_stats(c).items()} == \
        {k: v.vector.tolist() for k, v in tl.stats.site_stats(t).items()}
    with pytest.raises(PayloadUnavailableError) as e:
        c.ops[c.labels[1]].out
    assert e.value.code == "activation_reduced_to_stats"
    with pytest.raises(InvalidArgumentError) as e:
        c.fork()
    assert e.value.code == "stats_capture_not_replayable"
