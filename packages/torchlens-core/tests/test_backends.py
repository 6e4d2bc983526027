"""The backend contract and backend selection."""

import numpy as np
import pytest

import torchlens as tl
from torchlens.backends import (
    PROTOCOL_MEMBERS,
    REFUSAL_CODES,
    BackendProtocol,
    BackendUnsupportedError,
    FrameworkRequirement,
    ValidationStatus,
)
from torchlens.errors import ERROR_CODES, InvalidArgumentError


def test_reference_protocol_is_complete_and_runtime_checkable():
    proto = tl.backends.get_protocol("reference")
    assert isinstance(proto, BackendProtocol)
    for member in PROTOCOL_MEMBERS:
        assert hasattr(proto, member), member
    assert proto.refusal_codes() <= REFUSAL_CODES
    assert proto.runtime_available() is None


def test_every_refusal_code_is_a_registered_error_code():
    for code in REFUSAL_CODES:
        assert ERROR_CODES[code][0] == "BackendUnsupportedError"


def test_unknown_backend_name():
    from torchlens_reference import nn

    with pytest.raises(BackendUnsupportedError) as info:
        tl.trace(nn.ReLU(), np.ones(2), backend="nope")
    assert info.value.code == "backend_unknown"


def test_known_but_absent_backend_names_its_extra():
    from torchlens_reference import nn

    absent = [n for n in ("tinygrad", "paddle", "tf", "mlx") if n not in tl.backends.specs()]
    if not absent:
        pytest.skip("every known backend is installed here")
    name = absent[0]
    with pytest.raises(BackendUnsupportedError) as info:
        tl.trace(nn.ReLU(), np.ones(2), backend=name)
    assert info.value.code == "runtime_missing"
    assert f'torchlens[{name}]' in info.value.remedy
    with pytest.raises(BackendUnsupportedError) as info:
        getattr(tl.backends, name)
    assert info.value.code == "runtime_missing"


def test_object_no_backend_handles_is_model_type_unsupported():
    import torchlens_reference.nn  # noqa: F401  (makes the reference backend a candidate)

    with pytest.raises(InvalidArgumentError) as info:
        tl.trace(object(), np.ones(2))
    assert info.value.code == "model_type_unsupported"


def test_backend_namespace_resolves_lazily():
    ns = tl.backends.reference
    assert ns.__name__ == "torchlens_reference.nn" and hasattr(ns, "Linear")


def test_unknown_trace_option_is_refused_before_running():
    from torchlens_reference import nn

    calls = []

    class Spy(nn.Module):
        def forward(self, x):
            calls.append(1)
            return x

    with pytest.raises(BackendUnsupportedError) as info:
        tl.trace(Spy(), np.ones(2), stop_after="relu")
    assert info.value.code == "trace_option_unsupported"
    assert calls == []


def test_framework_requirement_range():
    fw = FrameworkRequirement(("numpy",), minimum="1.24", below="3")
    assert fw.contains("2.4.6") and fw.contains("1.24.0") and not fw.contains("1.23.9") and not fw.contains("3.0")
    assert fw.contains("2.13.0+cpu")
    assert fw.installed_version() == np.__version__


def test_validation_status_reason_must_be_registered():
    with pytest.raises(ValueError):
        ValidationStatus(False, "x", "made_up_reason")
    assert not ValidationStatus(False, "x", "replay_mismatch")
