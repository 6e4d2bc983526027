"""tl.recording's framework-free parts (issue 22): reducers on numpy against hand formulas, the
generation stream's eviction and byte budget driven by a numpy fake driver, options refusals,
capture outcomes, and the no-public-constructor rule."""

from __future__ import annotations

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import RecordingError
from torchlens.recording import generation as gen
from torchlens.recording import reducers


def test_norm_reducer_is_one_norm_per_position():
    x = np.random.default_rng(0).normal(size=(1, 5, 8))
    got = reducers.norm()(x)
    assert got.shape == (5,) and np.allclose(got, np.sqrt((x[0] ** 2).sum(-1)))
    got1 = reducers.norm(ord=1.0)(x)
    assert np.allclose(got1, np.abs(x[0]).sum(-1))
    with pytest.raises(RecordingError) as exc:
        reducers.norm(dim=1, position_dim=1)(x)
    assert exc.value.code == "record_generation_reducer_invalid"


def test_top_k_reducer_gives_the_largest_indices_per_position():
    x = np.random.default_rng(1).random(size=(1, 2, 3, 6))  # [batch, heads, queries, keys]
    got = reducers.top_k(2)(x)
    assert got.shape == (3, 1, 2, 2)
    for q in range(3):
        for h in range(2):
            assert list(got[q, 0, h]) == list(np.argsort(-x[0, h, q])[:2])
    with pytest.raises(RecordingError) as exc:
        reducers.top_k(0)
    assert exc.value.code == "record_generation_options_invalid"


def test_probe_reducer_is_the_decision_function():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(1, 4, 6)).astype(np.float32)

    class Fitted:
        coef_ = rng.normal(size=(1, 6))
        intercept_ = np.array([0.5])

    got = reducers.probe(Fitted())(x)
    assert got.shape == (4,) and np.allclose(got, x[0] @ Fitted.coef_[0] + 0.5, atol=1e-5)
    w, b = rng.normal(size=(3, 6)), rng.normal(size=3)
    assert np.allclose(reducers.probe((w, b))(x), x[0] @ w.T + b, atol=1e-5)
    with pytest.raises(RecordingError) as exc:
        reducers.probe(object())
    assert exc.value.code == "record_generation_options_invalid"
    with pytest.raises(RecordingError):
        reducers.probe((w, b))(np.zeros((1, 4, 5), dtype=np.float32))


@pytest.mark.parametrize("kwargs", [
    {"reducers": ["norm"]}, {"reducers": {"h.1": 3}}, {"kv_sites": "all"}, {"kv_sites": [-1]}, {"keep_last": 0},
    {"keep_last": True}, {"spill": "/tmp/x"}, {"spill": 3, "keep_last": 2}, {"max_saved_bytes": -1},
])
def test_generation_options_refuse_malformed_values(kwargs):
    with pytest.raises(RecordingError) as exc:
        gen.GenerationOptions(**kwargs)
    assert exc.value.code == "record_generation_options_invalid"


def test_generation_without_generate_kwargs_refuses():
    with pytest.raises(RecordingError) as exc:
        tl.record(object(), np.zeros(3), generation=gen.GenerationOptions())
    assert exc.value.code == "record_generation_options_invalid"


class NumpyDriver:
    def __init__(self):
        self.spilled = {}

    def is_tensor(self, v):
        return isinstance(v, np.ndarray)

    def concat(self, parts):
        return np.concatenate(parts)

    def spill_save(self, obj, path):
        self.spilled[path] = {k: v.copy() for k, v in obj.items()}

    def spill_load(self, path):
        return self.spilled[path]


def _run(options, steps=6, prompt=4, d=8, reducers_=None):
    driver = NumpyDriver()
    stream = gen._Stream(options, reducers_ or {}, driver)
    stream.max_new = steps
    values = []
    for k in range(steps):
        n = prompt if k == 0 else 1
        start = 0 if k == 0 else prompt + k - 1
        v = np.full((1, n, d), float(k), dtype=np.float32)
        values.append(v)
        stream.on_forward(gen.ForwardData(range(start, start + n), {"h": v}))
    return stream, values


def test_stream_keep_last_spills_and_reads_back(tmp_path):
    stream, values = _run(gen.GenerationOptions(keep_last=2, spill=tmp_path))
    assert stream.evicted == {0: "spilled", 1: "spilled", 2: "spilled", 3: "spilled"}
    assert stream.retained == 2 * 8 * 4  # two one-position steps
    assert stream.peak == 4 * 8 * 4 + 8 * 4  # the prefill plus the first decode step
    assert stream.passes[0].records[0].value is None and stream.passes[0].records[0].meta["payload"] == "spilled"


def test_stream_budget_refuses_after_the_first_decode_step():
    calls = []
    options = gen.GenerationOptions(max_saved_bytes=4 * 8 * 4 + 3 * 8 * 4)
    driver = NumpyDriver()
    stream = gen._Stream(options, {}, driver)
    stream.max_new = 6
    stream.on_forward(gen.ForwardData(range(0, 4), {"h": np.zeros((1, 4, 8), np.float32)}))
    calls.append(0)
    with pytest.raises(RecordingError) as exc:
        stream.on_forward(gen.ForwardData(range(4, 5), {"h": np.zeros((1, 1, 8), np.float32)}))
    assert exc.value.code == "record_generation_budget_exceeded"
    assert exc.value.fields["projected_bytes"] == 4 * 8 * 4 + 5 * 8 * 4


def test_stream_reducer_checks():
    with pytest.raises(RecordingError) as exc:
        _run(gen.GenerationOptions(), reducers_={"h": lambda v: v[0, 0]})  # first axis is features, not positions
    assert exc.value.code == "record_generation_reducer_invalid"
    with pytest.raises(RecordingError) as exc:
        _run(gen.GenerationOptions(), reducers_={"missing": reducers.norm()})
    assert exc.value.code == "record_generation_reducer_invalid"
    stream, values = _run(gen.GenerationOptions(), reducers_={"h": reducers.norm()})
    r = stream.passes[0].records[0]
    assert r.meta["reduced_from_shape"] == (1, 4, 8) and r.meta["reducer"].startswith("norm")
    stream = gen._Stream(gen.GenerationOptions(), {}, NumpyDriver())
    with pytest.raises(RecordingError) as exc:
        stream.on_forward(gen.ForwardData(range(0, 1), {"h": np.zeros((1, 1, 2))}, duplicates=("h",)))
    assert exc.value.code == "record_generation_reducer_invalid"


def test_outcome_and_constructors():
    from torchlens.records.outcome import CaptureOutcome
    from torchlens.records.trace import Trace

    assert Trace().outcome.status == "UNKNOWN"
    with pytest.raises(ValueError):
        CaptureOutcome("DONE")
    assert CaptureOutcome("STOPPED").ok and not CaptureOutcome("FAILED").ok
    for cls in (tl.recording.Recording, tl.recording.RecordingSettings):
        with pytest.raises(TypeError):
            cls()
    with pytest.raises(TypeError):
        tl.recording.GenerationRecording(None)
