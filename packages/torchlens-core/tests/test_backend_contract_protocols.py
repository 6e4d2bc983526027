"""The typed backend contract (issue 14 §1): capability protocols checked at registration
against `capabilities()`, refusal codes derived in core, the SDK, and no `getattr` probe for
an optional backend member in core."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

import torchlens as tl
from torchlens.backends import (
    CAPABILITY_PROTOCOLS,
    CAPABILITY_REFUSALS,
    BackendCapabilities,
    SupportsBackward,
    SupportsCallableTable,
    SupportsInterventions,
    SupportsOpRebinding,
    SupportsPersistence,
    refusal_codes_for,
    registry,
    supports,
)
from torchlens.errors import BackendUnsupportedError
from torchlens.plugins import manager as manager_mod

ROOT = Path(__file__).resolve().parents[3]
CORE = ROOT / "packages" / "torchlens-core" / "src" / "torchlens"


@pytest.fixture
def fresh_registry(monkeypatch):
    monkeypatch.setattr(manager_mod, "_MANAGER", None)
    monkeypatch.setattr(registry, "_protocols", {})


def _register(backend_cls, name: str):
    """Register `backend_cls()` under `name` through a plugin, like an entry point would."""
    from torchlens_reference.plugin import FRAMEWORK

    spec = tl.backends.BackendSpec(name=name, maturity="preview", framework=FRAMEWORK, protocol=backend_cls)

    class Plugin:
        @tl.hookimpl
        def torchlens_backends(self):
            return [spec]

    manager_mod.get_plugin_manager().register(Plugin(), f"{name}_plugin")


def _reference_like(caps: dict, **members):
    from torchlens_reference.backend import ReferenceBackend

    base_caps = ReferenceBackend().capabilities()
    new_caps = dataclasses.replace(base_caps, **caps)

    body = {"capabilities": lambda self: new_caps, "refusal_codes": lambda self: refusal_codes_for(self), **members}
    return type("FakeBackend", (ReferenceBackend,), body)


def _refused(name: str) -> BackendUnsupportedError:
    with pytest.raises(BackendUnsupportedError) as info:
        tl.backends.get_protocol(name)
    return info.value


def test_declared_capability_without_its_members_is_refused(fresh_registry):
    # backward_capture declared, but the backend has no backward(trace, loss)
    _register(_reference_like({"backward_capture": True}), "fake_nobackward")
    exc = _refused("fake_nobackward")
    assert exc.code == "backend_capability_members_missing"
    assert exc.fields["protocol"] == "SupportsBackward" and exc.fields["missing"] == ["backward"]


def test_members_of_an_undeclared_capability_are_refused(fresh_registry):
    # the reference backend has edit_ops/attach_module_edits: declaring interventions=False contradicts them
    _register(_reference_like({"interventions": False}), "fake_undeclared")
    exc = _refused("fake_undeclared")
    assert exc.code == "backend_capability_undeclared" and exc.fields["protocol"] == "SupportsInterventions"
    assert set(exc.fields["members"]) == {"edit_ops", "attach_module_edits"}


def test_an_extension_that_needs_a_flag_is_refused_without_it(fresh_registry):
    cls = _reference_like({"validation_replay": False}, validation_session=lambda self, num_threads=None: None)
    _register(cls, "fake_session")
    exc = _refused("fake_session")
    assert exc.code == "backend_capability_undeclared" and exc.fields["protocol"] == "SupportsValidationSession"


def test_refusal_codes_that_contradict_capabilities_are_refused(fresh_registry):
    cls = _reference_like({}, refusal_codes=lambda self: frozenset({"trace_option_unsupported",
                                                                    "interventions_unsupported"}))
    _register(cls, "fake_codes")
    exc = _refused("fake_codes")
    assert exc.code == "backend_refusal_codes_inconsistent"


def test_a_consistent_fake_backend_registers_and_traces(fresh_registry):
    _register(_reference_like({}), "fake_ok")
    proto = tl.backends.get_protocol("fake_ok")
    from torchlens_reference.zoo import zoo

    entry = zoo()["mlp"]
    t = tl.trace(entry["model"], *entry["args"], backend="fake_ok")
    np.testing.assert_array_equal(t.output_ops[0].out, entry["model"](*entry["args"]))
    assert supports(proto, SupportsInterventions) and not supports(proto, SupportsBackward)


def test_shipped_backends_satisfy_their_declared_protocols():
    for name in ("torch", "jax", "reference"):
        proto = tl.backends.get_protocol(name)
        caps = proto.capabilities()
        for cp in CAPABILITY_PROTOCOLS:
            if cp.flag is not None and getattr(caps, cp.flag):
                assert isinstance(proto, cp.protocol), (name, cp.protocol.__name__)
        assert set(proto.refusal_codes()) >= {CAPABILITY_REFUSALS[f] for f, v in caps.as_dict().items() if not v}
        assert not set(proto.refusal_codes()) & {CAPABILITY_REFUSALS[f] for f, v in caps.as_dict().items() if v}
    assert supports(tl.backends.get_protocol("jax"), SupportsOpRebinding)
    assert supports(tl.backends.get_protocol("torch"), SupportsCallableTable)
    assert supports(tl.backends.get_protocol("reference"), SupportsPersistence)


def test_refusal_codes_are_derived_from_capabilities():
    class B:
        maturity = "preview"

        def capabilities(self):
            return BackendCapabilities(validation_replay=True, interventions=True)

    codes = refusal_codes_for(B(), {"foreign_tensor_input"})
    off = {CAPABILITY_REFUSALS[f] for f, v in B().capabilities().as_dict().items() if not v}
    assert codes == frozenset(off | {"trace_option_unsupported", "runtime_missing", "runtime_version_unsupported",
                                     "explicit_seed_unsupported", "foreign_tensor_input"})
    B.maturity = "stable"
    assert "explicit_seed_unsupported" not in refusal_codes_for(B())
    with pytest.raises(ValueError):
        refusal_codes_for(B(), {"not_a_refusal_code"})
    with pytest.raises(ValueError):
        refusal_codes_for(B(), {"interventions_unsupported"})  # declared supported


# no probing in core ---------------------------------------------------------------------------

#: Members every backend has: looking one of these up is no probe.
REQUIRED_MEMBERS = set(tl.backends.PROTOCOL_MEMBERS)

#: Probes still allowed (file, member or "<dynamic>"): none since issue 14 part 2. Core reads
#: optional members through capability protocols (and the edit ops through `EditOps`).
REMAINING_PROBES: set[tuple[str, str]] = set()  # empty since issue 14 part 2: keep it so


def _probes(root: Path) -> set[tuple[str, str]]:
    found = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
                continue
            target = ast.unparse(node.args[0])
            if "proto" not in target and "backend" not in target:
                continue
            key = node.args[1]
            member = key.value if isinstance(key, ast.Constant) else "<dynamic>"
            if member not in REQUIRED_MEMBERS:
                found.add((str(path.relative_to(root)), member))
    return found


def test_no_getattr_probe_for_an_optional_backend_member_in_core():
    found = _probes(CORE)
    new = found - REMAINING_PROBES
    assert not new, f"probe(s) for optional backend members; use tl.backends.supports(proto, Supports...): {sorted(new)}"
    gone = REMAINING_PROBES - found
    assert not gone, f"these probes are gone: remove them from REMAINING_PROBES: {sorted(gone)}"


def test_the_probe_scanner_finds_probes(tmp_path):
    (tmp_path / "a.py").write_text("def f(proto, backend, n):\n    getattr(proto, 'payload_codec', None)\n"
                                   "    hasattr(type(backend), 'rebind_op')\n    getattr(backend, n)\n"
                                   "    getattr(proto, 'name')\n    getattr(other, 'edit_ops')\n"
                                   "    getattr(proto, 'some_new_member', None)\n")
    assert _probes(tmp_path) == {("a.py", "payload_codec"), ("a.py", "rebind_op"), ("a.py", "<dynamic>"),
                                 ("a.py", "some_new_member")}
