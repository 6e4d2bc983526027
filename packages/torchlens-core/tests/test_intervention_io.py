"""Portable intervention specs and recipes: round trips and refusals."""

import hashlib
import json

import numpy as np
import pytest

import torchlens as tl


@pytest.fixture
def setup():
    from torchlens_reference import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    rng = np.random.default_rng(0)
    return model, rng.standard_normal((3, 4)).astype(np.float32), rng


def test_subspace_interchange_round_trips_bit_for_bit(setup, tmp_path):
    model, x, rng = setup
    site = "linear_1_1"
    rotation = np.linalg.qr(rng.standard_normal((4, 4)))[0].T
    donor = tl.trace(model, rng.standard_normal((3, 4)).astype(np.float32))[site].out
    fork = tl.trace(model, x).fork()
    fork.do(tl.subspace(site, rotation[:2], origin="DAS", method="das"), tl.replace_with(donor))
    tl.io.save_intervention(fork, tmp_path / "s.tlspec")
    spec = tl.io.load_intervention_spec(tmp_path / "s.tlspec")
    fresh = tl.trace(model, x).fork().do(spec, intervention=tl.InterventionOptions())
    assert np.array_equal(fresh[site].out, fork[site].out)
    assert np.array_equal(fresh["linear_2_3"].out, fork["linear_2_3"].out)
    helper = spec.hook_specs[0].helper
    assert (helper.name, dict(helper.kwargs)["origin"], helper.portability) == ("subspace_edit", "DAS", "builtin")


def test_recipe_round_trip_keeps_digest(tmp_path):
    r = tl.when("relu_1_2", tl.steer(np.ones(4, np.float32), 2.0)) & tl.when(tl.module("2") | tl.func("relu"), tl.zero_ablate())
    r.save(tmp_path / "r.tlspec")
    loaded = tl.load(tmp_path / "r.tlspec")
    assert isinstance(loaded, tl.Recipe) and loaded.digest == r.digest


def test_user_callables_are_not_portable(tmp_path, setup):
    model, x, _ = setup
    with pytest.raises(tl.errors.InterventionError) as info:
        tl.when("relu_1_2", lambda v, *, ctx: v).save(tmp_path / "bad.tlspec")
    assert info.value.code == "intervention_spec_not_portable"
    assert not (tmp_path / "bad.tlspec").exists()
    t = tl.trace(model, x).fork().do("relu_1_2", lambda v, *, ctx: v * 2)
    tl.io.save_intervention(t, tmp_path / "audit.tlspec", level="audit")
    spec = tl.io.load_intervention_spec(tmp_path / "audit.tlspec")
    with pytest.raises(tl.errors.InterventionError) as info:
        tl.trace(model, x).fork().do(spec)
    assert info.value.code == "run_intervention_spec_not_persisted"


def test_tampering_is_refused(tmp_path, setup):
    model, x, rng = setup
    fork = tl.trace(model, x).fork().do(tl.subspace("linear_1_1", rng.standard_normal((1, 4))), tl.zero_ablate())
    path = tl.io.save_intervention(fork, tmp_path / "t.tlspec")
    blob = path / "blobs" / "recipe-0000.safetensors"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(tl.errors.ArtifactError) as info:
        tl.io.load_intervention_spec(path)
    assert info.value.code == "artifact_digest_mismatch"
    # a hand-edited record whose manifest digest was patched to match
    path2 = tl.io.save_intervention(tl.when("relu_1_2", tl.scale(2.0)), tmp_path / "h.tlspec")
    doc = json.loads((path2 / "intervention.json").read_bytes())
    doc["rules"][0]["edit"]["name"] = "format_disk"
    body = json.dumps(doc).encode()
    (path2 / "intervention.json").write_bytes(body)
    m = json.loads((path2 / "manifest.json").read_bytes())
    m["files"]["intervention.json"] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
    (path2 / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(tl.errors.ArtifactError) as info:
        tl.load(path2)
    assert info.value.code == "recipe_record_malformed"
