"""Issue 14 part 2 on the torch backend: an uncalled module has no Module record (spec
glossary, "Module filters"), in a fresh trace and in a saved and loaded one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import TorchLensError


class WithSpare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 3)
        self.spare = nn.Sequential(nn.Linear(3, 5), nn.ReLU())  # never called

    def forward(self, x):
        return self.used(x).relu()


def _check(t) -> None:
    assert set(t.modules.uncalled) == {"spare", "spare.0", "spare.1"}
    for a in t.modules.uncalled:
        assert a not in t.modules.labels
        with pytest.raises(TorchLensError):
            t.modules[a]
    assert "spare" not in t.modules["self"].children and "used" in t.modules["self"].children
    assert all(m.calls for m in t.modules)  # every record is of a called module
    # the parameters stay, and the root still counts them as module.parameters() does
    model = WithSpare()
    assert "spare.0.weight" in t.params.labels
    assert t.modules["self"].num_params_total == sum(p.numel() for p in model.parameters())


def test_uncalled_module_has_no_record(tmp_path):
    torch.manual_seed(0)
    t = tl.trace(WithSpare(), torch.randn(2, 3))
    _check(t)
    t.save(tmp_path / "t.tl")
    _check(tl.load(tmp_path / "t.tl"))


# inputs named in core (§3) ----------------------------------------------------------------------


def test_the_same_call_names_its_inputs_alike_on_every_backend():
    """Torch's nn.Sequential names its forward parameter `input`, the reference backend's
    `x`: the input paths (and so tl.model_input(path)) no longer depend on it."""
    import numpy as np
    from torchlens_reference import nn as rnn

    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    traces = {
        "torch": tl.trace(nn.Sequential(nn.Linear(4, 2)), torch.from_numpy(x)),
        "reference": tl.trace(rnn.Sequential(rnn.Linear(4, 2)), x, backend="reference"),
    }
    try:
        import jax.numpy as jnp

        traces["jax"] = tl.trace(lambda v: jnp.tanh(v) * 2.0, jnp.asarray(x), backend="jax")
    except ImportError:  # jax is optional
        pass
    for name, t in traces.items():
        assert [o.path for o in t.input_ops] == ["args[0]"], name
        (label,) = t[tl.model_input("args[0]")].labels
        assert np.array_equal(np.asarray(t.ops[label].out), x), name


def test_keyword_and_nested_inputs_follow_the_convention():
    class M(nn.Module):
        def forward(self, first, second, *, scale):
            return first[0] * second["w"] * scale

    t = tl.trace(M(), (torch.ones(2),), {"w": torch.ones(2)}, input_kwargs={"scale": torch.ones(2)})
    assert [o.path for o in t.input_ops] == ["args[0][0]", "args[1]['w']", "kwargs['scale']"]


def test_backend_state_slot_holds_the_torch_capture_extras():
    t = tl.trace(WithSpare(), torch.randn(2, 3), capture=tl.CaptureOptions(backward_ready=True, save_grads=True))
    assert t.backend_state is not None and t.backend_state.save_grads
    f = t.fork()
    assert f.backend_state is t.backend_state  # shared by forks (documented on Trace.copy)
    t.backward(t.output_ops[0].out.sum())
    assert t.autograd.backward_passes == 1


def _load_with_rows_edited(tmp_path, monkeypatch, edit):
    """Save a WithSpare trace and load it with its decoded record rows changed by `edit`."""
    import torchlens.io.rebuild as rebuild

    real = rebuild.rebuild_trace

    def edited(rows, manifest, attach_backend=True):
        edit(rows)
        return real(rows, manifest, attach_backend=attach_backend)

    t = tl.trace(WithSpare(), torch.randn(2, 3))
    path = t.save(tmp_path / "t.tl")  # saved unedited (save reads its records back the way load does)
    monkeypatch.setattr(rebuild, "rebuild_trace", edited)
    return tl.load(path)


def test_a_file_holding_records_of_uncalled_modules_loads_without_them(tmp_path, monkeypatch):
    def add_old_style_records(rows):  # what a file written before this rule held
        used = next(r for r in rows["modules"] if r["address"] == "used")
        for address in ("spare", "spare.0", "spare.1"):
            rows["modules"].append({**used, "address": address, "parent": address.rpartition(".")[0] or "self",
                                    "all_addresses": (address,), "calls": [], "children": [],
                                    "param_addresses": [], "buffer_addresses": []})
        next(r for r in rows["modules"] if r["address"] == "self")["children"].append("spare")

    _check(_load_with_rows_edited(tmp_path, monkeypatch, add_old_style_records))


def test_a_file_listing_a_called_module_as_uncalled_is_refused(tmp_path, monkeypatch):
    def list_used(rows):
        rows["trace"][0]["uncalled_modules"] = [*rows["trace"][0]["uncalled_modules"], "used"]

    with pytest.raises(tl.errors.ArtifactError) as info:
        _load_with_rows_edited(tmp_path, monkeypatch, list_used)
    assert info.value.code == "record_reference_invalid" and info.value.fields["address"] == "used"
