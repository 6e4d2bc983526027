"""The backend contract, part 2 (issue 14): core reads optional backend members through typed
protocols only (no probe left), the edit ops a backend returns are checked at registration,
and capability refusals are the capability's own code."""

from __future__ import annotations

import numpy as np
import pytest

import torchlens as tl
from torchlens.backends import DifferentiableEditOps, EditOps, refusal_codes_for, registry
from torchlens.errors import BackendUnsupportedError
from torchlens.plugins import manager as manager_mod


@pytest.fixture
def fresh_registry(monkeypatch):
    monkeypatch.setattr(manager_mod, "_MANAGER", None)
    monkeypatch.setattr(registry, "_protocols", {})


def _register(backend_cls, name: str):
    from torchlens_reference.plugin import FRAMEWORK

    spec = tl.backends.BackendSpec(name=name, maturity="preview", framework=FRAMEWORK, protocol=backend_cls)

    class Plugin:
        @tl.hookimpl
        def torchlens_backends(self):
            return [spec]

    manager_mod.get_plugin_manager().register(Plugin(), f"{name}_plugin")


def _mlp_trace():
    from torchlens_reference import nn

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    return tl.trace(model, x, backend="reference")


def test_edit_ops_lacking_a_member_are_refused_at_registration(fresh_registry):
    from torchlens_reference.backend import ReferenceBackend
    from torchlens_reference.edit_ops import ReferenceEditOps

    class NoStamp:  # every EditOps member but param_stamp
        def __getattr__(self, name):
            if name == "param_stamp":
                raise AttributeError(name)
            return getattr(ReferenceEditOps(), name)

    cls = type("HalfOps", (ReferenceBackend,), {"edit_ops": lambda self: NoStamp(),
                                                  "refusal_codes": lambda self: refusal_codes_for(self)})
    _register(cls, "fake_halfops")
    with pytest.raises(BackendUnsupportedError) as info:
        tl.backends.get_protocol("fake_halfops")
    assert info.value.code == "backend_capability_members_missing"
    assert info.value.fields["protocol"] == "EditOps" and "param_stamp" in info.value.fields["missing"]


def test_shipped_edit_ops_satisfy_the_protocols():
    ref = tl.backends.get_protocol("reference")
    assert isinstance(ref.edit_ops(), EditOps)
    torch_backend = tl.backends.get_protocol("torch")
    assert isinstance(torch_backend.edit_ops(), DifferentiableEditOps)


def test_differentiable_replay_refuses_on_a_backend_without_gradients():
    # before: the reference backend's edit ops had no grad_enabled, so differentiable replay
    # silently ran without gradients; now it names the missing capability
    t = _mlp_trace()
    with pytest.raises(BackendUnsupportedError) as info:
        t.do(tl.module("1"), tl.zero_ablate(),
             intervention=tl.InterventionOptions(engine="replay", differentiable=True))
    assert info.value.code == "backward_capture_unsupported"


def test_backward_on_a_backend_without_it_refuses_with_the_capability_code():
    t = _mlp_trace()
    with pytest.raises(BackendUnsupportedError) as info:
        t.backward(t.output_ops[0].out)
    assert info.value.code == "backward_capture_unsupported"


def test_validation_scope_needs_the_scope_protocol():
    from torchlens_reference import nn

    model = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(BackendUnsupportedError) as info:
        tl.validate(model, np.ones((1, 4), np.float32), backend="reference", scope="receptive_field")
    assert info.value.code == "validation_replay_unsupported"


# Trace owns its state (§4) ----------------------------------------------------------------------


def test_copy_gives_independent_records_sharing_payloads():
    t = _mlp_trace()
    c = t.copy("c")
    assert c.name == "c" and c.labels == t.labels
    for label in t.labels:
        new, old = c.ops[label], t.ops[label]
        assert new is not old and new._trace is c and old._trace is t
        assert new._outputs is old._outputs  # payloads shared until an edit replaces them
    assert c._intervention is None and c._scopes == [] and c.is_pristine
    # annotations are the copy's own (a fork used to share the dict with its root)
    c.annotations["note"] = 1
    assert "note" not in t.annotations
    f = t.fork()
    f.annotations["note"] = 2
    assert "note" not in t.annotations


def test_fork_edits_leave_the_root_alone_through_copy():
    t = _mlp_trace()
    before = {lb: [np.array(v, copy=True) for v in t.ops[lb].outs] for lb in t.labels if t.ops[lb].saved}
    f = t.fork("f")
    f.do(tl.module("1"), tl.zero_ablate())
    assert not f.is_pristine and t.is_pristine
    for lb, outs in before.items():
        assert all(np.array_equal(a, b) for a, b in zip(outs, t.ops[lb].outs)), lb
    assert f.last_run["engine"] == "replay" and t.last_run is None


def test_state_lives_in_declared_slots():
    t = _mlp_trace()
    declared = {"_intervention", "_backend_state", "_param_stamps", "_scopes", "_backward_passes", "_output_reason",
                "_edit_plan"}
    assert declared <= set(vars(t))
    t.fork().do(tl.module("1"), tl.zero_ablate())
    with t.fork() as scoped:
        scoped.do(tl.module("1"), tl.zero_ablate())
    assert set(vars(t)) == set(vars(tl.records.Trace()))  # nothing parked outside the declared slots
