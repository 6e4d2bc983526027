"""save="stats" without a framework (issue 23): the fold offer core makes a backend, the
after-capture fold of a backend that does not take it (the numpy reference backend), and how
core reads a during-forward fold. Oracle: NumPy statistics of the `save="all"` payloads."""

from __future__ import annotations

import numpy as np
import pytest

import torchlens as tl
from torchlens.backends.sdk import FoldedStats, STATS_FOLD_SLOTS, take_stats_fold
from torchlens.backends.sdk_stats import StatsFoldOffer
from torchlens.errors import PluginError
from torchlens.stats.reduce import reduce_trace


def _model():
    from torchlens_reference import nn

    return nn.LoopNet(width=4, steps=3), np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)


def test_the_offer_is_taken_once_and_only_inside_its_capture():
    assert take_stats_fold() is False
    offer = StatsFoldOffer()
    assert offer.mode == "after_capture"
    with offer:
        assert take_stats_fold() is True
        assert take_stats_fold() is False  # one capture takes it
    assert offer.mode == "forward"
    with StatsFoldOffer() as untaken:
        pass
    assert untaken.mode == "after_capture" and take_stats_fold() is False  # closed with the capture
    assert STATS_FOLD_SLOTS == tl.stats.RUNNING_SLOTS


def test_a_backend_without_the_hook_folds_after_capture():
    model, x = _model()
    t = tl.trace(model, x, save="stats")
    assert t.provenance.extra["stats_fold"] == "after_capture"
    assert not hasattr(t.options, "save")  # this backend stores CaptureOptions: the fact is in provenance
    full = tl.trace(model, x)
    stats = tl.stats.site_stats(t)
    assert list(stats) == list(full.labels)
    for op in full.ops:
        want = tl.stats.RunningStats().update(np.asarray(op.out, dtype=np.float64)).vector
        assert np.allclose(stats[op.label].vector, want, rtol=1e-12, atol=0, equal_nan=True), op.label


def _forward_offer() -> StatsFoldOffer:
    offer = StatsFoldOffer()
    offer.mode = "forward"
    return offer


def test_core_reads_folded_vectors_and_folds_a_payload_that_slipped_through():
    model, x = _model()
    t = tl.trace(model, x)
    ops = list(t.ops)
    want = {op.label: tl.stats.RunningStats().update(np.asarray(op.out, dtype=np.float64)).vector for op in ops}
    for op in ops[1:]:  # the first keeps its payload, as a backend path that forgot to fold would
        op._outputs = tuple(FoldedStats(tl.stats.RunningStats().update(np.asarray(v, dtype=np.float64)).vector)
                            for v in op._outputs)
    reduce_trace(t, _forward_offer())
    assert t.provenance.extra["stats_fold"] == "forward"
    assert t.provenance.extra["stats_fold_late"] == [ops[0].label]
    got = tl.stats.site_stats(t)
    for label, v in want.items():
        assert np.array_equal(got[label].vector, v), label


def test_a_folded_vector_of_the_wrong_shape_refuses_typed():
    model, x = _model()
    t = tl.trace(model, x)
    first = next(iter(t.ops))
    first._outputs = (FoldedStats(np.zeros(3)),)
    with pytest.raises(PluginError) as e:
        reduce_trace(t, _forward_offer())
    assert e.value.code == "backend_stats_fold_invalid" and "FoldedStats" in e.value.remedy
