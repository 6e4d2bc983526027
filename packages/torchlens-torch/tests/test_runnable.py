"""The runnable artifact (issue 25): trace.save(level="runnable"), tl.load(...).runnable,
Readiness, Runnable.run with path faithfulness and numeric attestation.

Every run is checked against the original model's own forward on the same inputs, computed
before the model is deleted; a loaded artifact runs with no model in the process."""

from __future__ import annotations

import gc
import hashlib
import json

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.errors import ArtifactError, InvalidArgumentError

REPLAYABLE = tl.options.CaptureOptions(replayable=True)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class ResCNN(nn.Module):
    """A small CNN with a residual add and an in-place relu."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        h = self.bn(self.c1(x))
        h = torch.relu_(h)
        h = h + self.c2(h)  # residual
        h.relu_()
        return self.head(h.mean(dim=(2, 3)))


class Branchy(nn.Module):
    """A forward that branches on values it reads into Python (bool of a tensor, .item())."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            h = h * 2
        else:
            h = h - 1
        positives = (x > 0).sum().item()  # a Python int the rest of the forward uses as a literal
        return h + positives


def _save(model, x, path, capture=REPLAYABLE):
    t = tl.trace(model, x, capture=capture)
    t.save(path, level="runnable")
    return t


def _drop(*objs):
    del objs
    gc.collect()


@pytest.mark.parametrize("make,shape", [(MLP, (3, 6)), (ResCNN, (2, 2, 5, 5))])
def test_runnable_reproduces_the_model_on_new_inputs_without_it(tmp_path, make, shape):
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(*shape)
    new = [torch.randn(*shape) for _ in range(3)]
    with torch.no_grad():
        want = [model(n) for n in new]  # the independent computation, before the model is gone
    path = tmp_path / "m.tlspec"
    t = _save(model, x, path)
    del model, t
    gc.collect()
    loaded = tl.load(path)
    rn = loaded.runnable
    assert rn.readiness == "ready" and rn.reasons == ()
    for n, w in zip(new, want):
        r = rn.run(n)
        assert torch.equal(r.output, w)
        assert r.path_faithfulness == "verified"
        assert r.numeric_attestation == "not_applicable"
    r = rn.run(x.clone())  # the captured inputs: every saved activation byte-equal
    assert r.numeric_attestation == "attested" and r.attested_ops > 3
    assert r.path_faithfulness == "verified"


def test_descriptor_records_the_taken_path(tmp_path):
    torch.manual_seed(1)
    model = ResCNN().eval()
    x = torch.randn(1, 2, 4, 4)
    t = _save(model, x, tmp_path / "c.tlspec")
    doc = json.loads((tmp_path / "c.tlspec" / "runnable" / "descriptor.json").read_text())
    assert [o["label"] for o in doc["ops"]] == [o.label for o in t._ops.values()]
    inplace = {o["label"]: o["inplace_of"] for o in doc["ops"] if "inplace_of" in o}
    want = {o.label: o.parents[0] for o in t._ops.values() if o.is_inplace}
    assert inplace == want and len(want) == 2  # both relus wrote into their parent
    read = {a for o in t._ops.values() for a in o.params} | {o.path for o in t._ops.values() if o.kind == "buffer"}
    assert {r["address"] for r in doc["state"]} == read  # what the path reads (eval BN skips num_batches_tracked)
    assert read == set(t._params) | {"bn.running_mean", "bn.running_var"}
    conv = next(o for o in doc["ops"] if o["role"] == "op" and "conv" in o["label"])
    assert conv["callable"] and {"$state": "c1.weight"} in conv["args"]["$tuple"]
    assert doc["escapes"] == []


def test_branch_on_a_read_value_verifies_or_diverges(tmp_path):
    torch.manual_seed(2)
    model = Branchy().eval()
    x = torch.ones(2, 4)
    with torch.no_grad():
        if model.fc(x).sum() <= 0:
            model.fc.bias.add_(5.0)  # the captured branch is "sum > 0"
    same = x * 0.5
    flip = -x * 50
    fewer = x.clone()
    fewer[0, 0] = -0.01  # the branch holds, the .item() count (a literal of the last add) changes
    with torch.no_grad():
        want_same = model(same)
        assert model.fc(flip).sum() < 0 and model.fc(fewer).sum() > 0
    path = tmp_path / "b.tlspec"
    _save(model, x, path)
    del model
    gc.collect()
    rn = tl.load(path).runnable
    assert len(rn.escapes) == 2  # the bool() of the comparison and the .item() of the count
    r = rn.run(same)  # the same branch and the same count: verified, and the model's own output
    assert r.path_faithfulness == "verified" and torch.equal(r.output, want_same)
    r = rn.run(flip)  # the branch flips: the run stops at the comparison
    assert r.path_faithfulness == "diverged" and r.outputs is None
    assert r.diverged_at["read"] == "__bool__"
    assert r.diverged_at["captured"] is True and r.diverged_at["now"] is False
    r = rn.run(fewer)
    assert r.path_faithfulness == "diverged" and r.diverged_at["read"] == "item"
    assert (r.diverged_at["captured"], r.diverged_at["now"]) == (8, 7)


def test_state_is_the_capture_time_snapshot(tmp_path):
    torch.manual_seed(3)
    model = MLP().eval()
    x, n = torch.randn(2, 6), torch.randn(2, 6)
    with torch.no_grad():
        before = model(n)
    t = tl.trace(model, x, capture=REPLAYABLE)
    with torch.no_grad():  # an optimizer-like step after the capture, before the save
        for p in model.parameters():
            p.add_(1.0)
        after = model(n)
    assert not torch.equal(before, after)
    t.save(tmp_path / "s.tlspec", level="runnable")
    rn = tl.load(tmp_path / "s.tlspec").runnable
    assert torch.equal(rn.run(n).output, before)
    assert rn.run(x).numeric_attestation == "attested"
    tl.load(tmp_path / "s.tlspec").save(tmp_path / "again.tlspec", level="runnable")  # re-save keeps the state
    again = tl.load(tmp_path / "again.tlspec").runnable
    assert torch.equal(again.run(n).output, before) and again.run(x).numeric_attestation == "attested"


def _repin(path, name):
    m = json.loads((path / "manifest.json").read_text())
    data = (path / name).read_bytes()
    m["runnable"]["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (path / "manifest.json").write_text(json.dumps(m, indent=1) + "\n")


def test_tampered_runnable_files_refuse_on_load(tmp_path):
    torch.manual_seed(4)
    model = MLP().eval()
    x = torch.randn(2, 6)
    path = tmp_path / "t.tlspec"
    _save(model, x, path)
    st = path / "runnable" / "state.safetensors"
    raw = bytearray(st.read_bytes())
    raw[-1] ^= 0x01
    st.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError) as exc:
        tl.load(path)
    assert exc.value.code == "artifact_digest_mismatch"
    _save(model, x, tmp_path / "d.tlspec")
    d = tmp_path / "d.tlspec"
    desc = d / "runnable" / "descriptor.json"
    text = desc.read_bytes()
    assert b'"callable":"torch.nn.functional.linear"' in text
    desc.write_bytes(text.replace(b'"callable":"torch.nn.functional.linear"', b'"callable":"torch.tanh"', 1))
    with pytest.raises(ArtifactError) as exc:
        tl.load(d)
    assert exc.value.code == "artifact_size_mismatch"  # the manifest pins its size and sha256
    _repin(d, "runnable/descriptor.json")  # the digest re-pinned: the descriptor still disagrees with the records
    with pytest.raises(ArtifactError) as exc:
        tl.load(d)
    assert exc.value.code == "runnable_descriptor_invalid"
    (d / "runnable" / "extra.json").write_text("{}")
    with pytest.raises(ArtifactError) as exc:
        tl.load(d)
    assert exc.value.code == "artifact_file_unlisted"


def test_refusals_before_anything_is_written(tmp_path):
    torch.manual_seed(5)
    model = MLP().eval()
    x = torch.randn(2, 6)
    plain = tl.trace(model, x)
    with pytest.raises(ArtifactError) as exc:
        plain.save(tmp_path / "p.tlspec", level="runnable")
    assert exc.value.code == "runnable_capture_not_replayable" and exc.value.remedy
    assert not (tmp_path / "p.tlspec").exists()
    t = tl.trace(model, x, capture=REPLAYABLE)
    edited = t.fork()
    edited.do("tanh_1_2", tl.zero_ablate())
    with pytest.raises(ArtifactError) as exc:
        edited.save(tmp_path / "e.tlspec", level="runnable")
    assert exc.value.code == "runnable_trace_edited"
    assert not (tmp_path / "e.tlspec").exists()
    t.save(tmp_path / "ok.tlspec", level="runnable")  # the unedited root still saves
    m = json.loads((tmp_path / "ok.tlspec" / "manifest.json").read_text())
    assert m["level"] == "runnable" and set(m["runnable"]["files"]) == {"runnable/descriptor.json",
                                                                          "runnable/state.safetensors"}
    m.pop("runnable")  # a runnable level without its runnable object refuses
    (tmp_path / "ok.tlspec" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError) as exc:
        tl.load(tmp_path / "ok.tlspec")
    assert exc.value.code == "runnable_descriptor_invalid"
    plain.save(tmp_path / "f.tlspec")  # level "full": no runnable
    assert tl.load(tmp_path / "f.tlspec").runnable is None


def test_buffers_not_saved_refuse(tmp_path):
    model = ResCNN().eval()
    t = tl.trace(model, torch.randn(1, 2, 4, 4), save="none", capture=REPLAYABLE)
    with pytest.raises(ArtifactError) as exc:
        t.save(tmp_path / "n.tlspec", level="runnable")
    assert exc.value.code == "runnable_payload_missing"


def test_run_refuses_other_shapes_and_unavailable_readiness(tmp_path, monkeypatch):
    torch.manual_seed(6)
    model = MLP().eval()
    path = tmp_path / "r.tlspec"
    _save(model, torch.randn(2, 6), path)
    rn = tl.load(path).runnable
    for bad in ((torch.randn(3, 6),), (torch.randn(2, 6).double(),), ()):
        with pytest.raises(InvalidArgumentError) as exc:
            rn.run(*bad)
        assert exc.value.code == "runnable_input_mismatch"
    import torchlens_torch.callables as callables

    real = callables.resolve_callable
    monkeypatch.setattr(callables, "resolve_callable", lambda name: None if name == "torch.tanh" else real(name))
    rn = tl.load(path).runnable  # a callable the table no longer holds: unavailable, nothing executed
    assert rn.readiness == "unavailable" and any("torch.tanh" in r for r in rn.reasons)
    with pytest.raises(InvalidArgumentError) as exc:
        rn.run(torch.randn(2, 6))
    assert exc.value.code == "runnable_unavailable"


def test_attestation_compares_saved_activations_and_never_upgrades_faithfulness(tmp_path):
    torch.manual_seed(7)
    model = Branchy().eval()
    x = torch.ones(2, 4)
    with torch.no_grad():
        if model.fc(x).sum() <= 0:
            model.fc.bias.add_(5.0)
    path = tmp_path / "a.tlspec"
    _save(model, x, path)
    loaded = tl.load(path)
    assert loaded.runnable.run(x).numeric_attestation == "attested"
    op = loaded._ops["linear_1_1"]
    op._outputs = (op._outputs[0] + 1e-3,)  # a saved activation that no longer matches a recomputation
    r = loaded.runnable.run(x)
    assert r.numeric_attestation == "numeric_attestation_failed" and r.mismatches == ("linear_1_1[0]",)
    assert r.path_faithfulness == "verified"
    r = loaded.runnable.run(x * 0.5)
    assert r.numeric_attestation == "not_applicable"
    none = tmp_path / "none.tlspec"
    tl.trace(model, x, save="none", capture=REPLAYABLE).save(none, level="runnable")
    r = tl.load(none).runnable.run(x)  # no activations saved: nothing to attest, reads unverifiable
    assert r.numeric_attestation == "not_present"
    assert r.path_faithfulness == "unverifiable"


class ViewThenInplace(nn.Module):
    """A view taken before an in-place write into its base: the view sees the write."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        h = self.fc(x)
        v = h.view(-1)
        h.relu_()
        return v * 3


def test_alias_topology_is_reproduced_by_the_run(tmp_path):
    torch.manual_seed(8)
    model = ViewThenInplace().eval()
    x, n = torch.randn(2, 4), torch.randn(2, 4)
    with torch.no_grad():
        want = model(n)
    assert (want == 0).any()  # the relu reached the view
    path = tmp_path / "v.tlspec"
    _save(model, x, path)
    del model
    gc.collect()
    r = tl.load(path).runnable.run(n)
    assert torch.equal(r.output, want) and r.path_faithfulness == "verified"


def test_overwrite_replaces_a_runnable_artifact_and_refuses_a_foreign_directory(tmp_path):
    """`overwrite=True` replaces an artifact this version wrote (the runnable/ files included)
    and the new one loads; a directory holding anything else is left alone."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(3, 6)
    path = tmp_path / "m.tlspec"
    _save(model, x, path)
    with torch.no_grad():
        model.fc1.weight.mul_(2.0)  # a different model state for the second save
    t2 = tl.trace(model, x, capture=REPLAYABLE)
    t2.save(path, level="runnable", overwrite=True)
    expected = model(x).detach()
    got = tl.load(path).runnable.run(x)
    assert torch.equal(got.outputs if isinstance(got.outputs, torch.Tensor) else got.outputs[0], expected)
    (path / "runnable" / "stray.bin").write_bytes(b"x")  # not an artifact this version wrote any more
    with pytest.raises(tl.errors.ArtifactError):
        t2.save(path, level="runnable", overwrite=True)
    assert (path / "runnable" / "stray.bin").exists()


def test_param_value_basis_says_where_a_value_comes_from(tmp_path):
    """Param.value_basis (glossary "Parameter value basis"): live_ref while the live handle
    resolves, snapshot with capture-time snapshots (snapshot_params, replayable, a loaded
    runnable's state), absent(not_persisted) for a loaded trace whose model is gone."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(3, 6)
    live = tl.trace(model, x)
    assert live.params["fc1.weight"].value_basis == "live_ref"
    assert live.params["fc1.weight"].value is model.fc1.weight  # the read itself is unchanged
    snap = tl.trace(model, x, capture=tl.CaptureOptions(snapshot_params=True))
    assert snap.params["fc1.weight"].value_basis == "snapshot"
    live.save(tmp_path / "full.tlspec")
    _save(model, x, tmp_path / "run.tlspec")
    del model, live, snap
    gc.collect()
    full = tl.load(tmp_path / "full.tlspec")
    # a full save writes the values the parameters held when it was saved (not a capture-time claim)
    assert full.params["fc1.weight"].value_basis == "persisted(save_time)"
    assert full.params["fc1.weight"].value is not None
    full._params["fc1.weight"].value = None  # an artifact holding no bytes for it
    assert full.params["fc1.weight"].value_basis == "absent(not_persisted)"
    assert tl.load(tmp_path / "run.tlspec").params["fc1.weight"].value_basis == "snapshot"
