"""Spec fidelity (issue 13 leftovers, session 4), framework-free: the provenance identity
fields core computes for every backend (glossary l. 16), the record-derived cost fields
(l. 20) and how they survive pickle, copy, save and load. Checked on the numpy reference
backend against hand computations."""

from __future__ import annotations

import hashlib
import json
import warnings

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import ArtifactError
from torchlens.records.trace import Cost


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _mlp(seed=0):
    from torchlens_reference import nn

    return nn.Sequential(nn.Linear(4, 8, seed=seed), nn.ReLU(), nn.Linear(8, 2, seed=seed))


def _x(rows=3):
    return np.linspace(-1, 1, rows * 4, dtype=np.float32).reshape(rows, 4)


def test_identity_fields_on_a_backend_that_records_no_timing():
    x = _x()
    t = tl.trace(_mlp(), x)
    p = t.provenance
    assert p.input_structure == "args[0]: ndarray[3, 4] float32"
    assert p.input_signature_hash == hashlib.sha256(p.input_structure.encode()).hexdigest()
    assert p.input_object_id == id(x)
    assert len(p.fingerprint) == 64
    assert tl.trace(_mlp(1), _x() * 3).provenance.fingerprint == p.fingerprint  # weights and values do not enter
    assert tl.trace(_mlp(), _x(5)).provenance.fingerprint != p.fingerprint  # shapes do
    # what this backend does not record is None, with the reason (never guessed)
    assert p.setup_duration is None and "setup_duration" in p.unavailable
    assert p.param_hash_quick is None and "param_hash_quick" in p.unavailable
    for name in ("cache_hit", "cache_key", "cache_path", "recording_kept", "param_source", "backend_config",
                 "distributed_scope", "observer_spans", "is_appended"):
        assert getattr(p, name) is None and name in p.unavailable, name
    assert "fingerprint" not in p.unavailable and "param_hash_full" not in p.unavailable


def test_param_hash_full_covers_every_byte():
    a, b = _mlp(), _mlp(7)
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        pb.value[...] = pa.value
    ha = tl.trace(a, _x()).provenance.param_hash_full
    assert ha is not None and ha == tl.trace(b, _x()).provenance.param_hash_full
    assert tl.trace(_mlp(7), _x()).provenance.param_hash_full != ha
    next(iter(b.named_parameters()))[1].value.flat[5] += 1.0
    assert tl.trace(b, _x()).provenance.param_hash_full != ha


def test_liveness_peak_and_grad_memory_from_the_records():
    t = tl.trace(_mlp(), _x())
    # x 48 | +96 = 144, x freed | +96 = 192, first linear freed | +24 = 120 -> 192
    assert t.cost.forward_peak_memory == 192
    # independent replay of the definition over the public records
    ops = [o for o in t.ops if o.kind != "output"]
    last = {o.label: max([i] + [len(ops) if t.ops[c].kind == "output" else [q.label for q in ops].index(c)
                                for c in o.children]) for i, o in enumerate(ops)}
    live = peak = 0
    for i, o in enumerate(ops):
        live += o.nbytes
        peak = max(peak, live)
        live -= sum(q.nbytes for q in ops if last[q.label] == i)
    assert peak == t.cost.forward_peak_memory
    # the reference backend does not record which outputs required grad: None, not a made-up 0
    assert t.cost.total_grad_memory is None and "total_grad_memory" in t.cost.unavailable
    assert t.cost.saved_grad_memory == 0 and t.cost.backward_durations == ()


def test_record_derived_cost_fields_follow_the_trace_through_copy_save_and_load(tmp_path):
    t = tl.trace(_mlp(), _x())
    full = t.provenance.param_hash_full
    copy = t.copy()
    assert copy.cost.forward_peak_memory == 192
    detached = Cost()
    assert detached.forward_peak_memory is None and "forward_peak_memory" in detached.unavailable
    t.save(tmp_path / "t.tlspec")
    loaded = tl.load(tmp_path / "t.tlspec")
    assert loaded.cost.forward_peak_memory == 192 and loaded.provenance.param_hash_full == full
    assert loaded.provenance.fingerprint == t.provenance.fingerprint


def test_quantities_save_as_plain_numbers(tmp_path):
    t = tl.trace(_mlp(), _x())
    t.annotations["peak"] = t.cost.forward_peak_memory  # a tl.types.Bytes
    t.save(tmp_path / "q.tlspec")
    loaded = tl.load(tmp_path / "q.tlspec")
    assert loaded.annotations["peak"] == 192 and type(loaded.annotations["peak"]) is int


def test_damaged_backward_durations_refuse(tmp_path):
    saved = tl.trace(_mlp(), _x()).save(tmp_path / "d.tlspec")
    f = saved / "records" / "cost.json"
    table = json.loads(f.read_text())
    col = [c[0] if isinstance(c, list) else c for c in table["columns"]].index("backward_durations")
    table["rows"][0][col] = [-1.0]
    data = json.dumps(table).encode()
    f.write_bytes(data)
    m = json.loads((saved / "manifest.json").read_text())
    m["files"]["records/cost.json"].update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    (saved / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError) as info:
        tl.load(saved)
    assert info.value.code == "record_schema_invalid" and "backward_durations" in str(info.value)


# --- spec surface (glossary l. 317, 928) ----------------------------------------------------

def _direct_write_warnings(quiet: bool) -> list:
    t = tl.trace(_mlp(), _x())
    op = t.ops["relu_1_2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if quiet:
            tl.errors.quiet()
        op.out = op.out * 0
    return [w for w in caught if issubclass(w.category, tl.errors.TraceMutationWarning)]


def test_errors_quiet_silences_the_mutation_warning():
    assert len(_direct_write_warnings(quiet=False)) == 1
    assert _direct_write_warnings(quiet=True) == []
    assert len(_direct_write_warnings(quiet=False)) == 1  # the filter ended with the catch_warnings block


def test_trace_is_a_tracelike():
    t = tl.trace(_mlp(), _x())
    assert isinstance(t, tl.types.TraceLike) and isinstance(t.fork(), tl.types.TraceLike)
    assert not isinstance(t.ops["relu_1_2"], tl.types.TraceLike)
