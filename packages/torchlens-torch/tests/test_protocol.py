"""The torch backend's registration and its BackendProtocol members."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import numpy as np
import torch
from torch import nn

import torchlens as tl
from torchlens.backends import BackendProtocol, REFUSAL_CODES, get_protocol, get_spec, missing_members


def test_registered_only_through_the_entry_point():
    eps = [ep for ep in metadata.entry_points(group="torchlens") if ep.name == "torch"]
    assert [ep.value for ep in eps] == ["torchlens_torch.plugin"]
    spec = get_spec("torch")
    assert spec.maturity == "stable" and spec.package == "torchlens-torch" and spec.namespace == "torchlens_torch"
    assert spec.modules == ("torch",)
    fw = spec.framework
    assert (fw.distributions, fw.minimum, fw.below, fw.tested_through, fw.pinned, fw.extra) == (
        ("torch",), "2.1", "3", "2.13.0", "2.13.0", "torch")
    assert fw.contains(fw.pinned)
    zoo = spec.zoo()
    assert {"mlp", "conv", "attention", "loop", "constant", "random"} <= set(zoo)
    assert all({"model", "args", "kwargs", "reseed"} <= set(e) for e in zoo.values())


def test_plugin_module_imports_no_torch():
    code = "import sys, torchlens_torch.plugin as p; p.torchlens_backends(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_protocol_members():
    proto = get_protocol("torch")
    assert isinstance(proto, BackendProtocol) and missing_members(proto) == []
    assert (proto.name, proto.maturity, proto.materialization) == ("torch", "stable", "eager")
    caps = proto.capabilities()
    assert caps.backward_capture and caps.structure_only_capture and caps.payload_materialization
    assert caps.validation_replay and caps.interventions
    assert proto.runtime_available() is None
    assert proto.refusal_codes() <= REFUSAL_CODES
    assert {"save", "capture"} <= proto.trace_options()
    assert tl.backends.torch.__name__ == "torchlens_torch"


def test_can_handle_modules_and_bound_methods_only():
    proto = get_protocol("torch")
    m = nn.Linear(2, 2)
    assert proto.can_handle(m, (), {})
    assert proto.can_handle(m.forward, (), {})
    assert not proto.can_handle(lambda x: x, (), {})
    assert not proto.can_handle(torch.relu, (), {})


def test_reference_output_is_a_plain_forward():
    proto = get_protocol("torch")
    m = nn.Linear(2, 2)
    x = torch.ones(1, 2)
    assert torch.equal(proto.reference_output(m, (x,), {}), m(x))


def test_validate_returns_a_status_naming_a_registered_reason():
    proto = get_protocol("torch")
    t = tl.trace(nn.Linear(2, 2), torch.ones(1, 2))
    assert proto.validate(t).ok
    op = t.ops["linear_1_1"]
    op._outputs = (op.out * 2,)
    status = proto.validate(t)
    assert not status.ok and status.first_failure == "linear_1_1" and status.reason in tl.backends.VALIDATION_REASONS


def test_value_members():
    proto = get_protocol("torch")
    assert proto.is_tensor(torch.ones(1)) and not proto.is_tensor(np.ones(1))
    x = torch.tensor(2.5, requires_grad=True)
    h = proto.host_copy(x * 2)
    assert isinstance(h, np.ndarray) and h.shape == () and h == 5.0
    b = proto.host_copy(torch.ones(2, 3, dtype=torch.bfloat16))
    assert b.dtype == np.float32 and b.shape == (2, 3)
    src = torch.arange(3.0)
    copy = proto.host_copy(src)
    src.add_(1)
    assert copy.tolist() == [0.0, 1.0, 2.0]
    values = [torch.ones(1)]
    assert proto.realize_once(values) is values


def test_provenance():
    t = tl.trace(nn.Linear(2, 2), torch.ones(1, 2))
    p = t.provenance
    assert p.backend == "torch" and p.framework_version == torch.__version__ and p.model_class == "Linear"
    assert p.root_entry_point == "module" and p.duration > 0 and p.extra["outcome"] == "COMPLETE"
