"""Spec fidelity (issue 13) on the torch backend: armed gradient rules saved with their
count, a set_only gradient rule never silently missing from trace.backward, recipe tensors
round-tripping through the torch codec, the guarded fast rerun on a torch model."""

import json
import warnings

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import InterventionError


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)), torch.randn(2, 4)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_a_set_only_gradient_rule_is_never_silently_left_out_of_backward(mlp):
    model, x = mlp
    t = tl.trace(model, x, capture=tl.CaptureOptions(backward_ready=True, save_grads=True,
                                                           detach_saved_activations=True))  # no live graph to arm
    t.do(tl.grad("relu_1_2"), tl.zero_ablate(), intervention=tl.InterventionOptions(engine="set_only"))
    assert t.intervention_audit[-1]["armed_for"] == "trace_backward_pending"  # backward_ready: backward tries to arm it
    with pytest.raises(InterventionError) as info:
        t.backward(t.output.sum())
    assert info.value.code == "backward_armed_edit_unapplied"
    assert t.ops["linear_1_1"].grads is None  # nothing ran
    # the rerun applies it: the gradient reaching linear_1_1 through a zeroed relu gradient is zero
    t2 = tl.trace(model, x, capture=tl.CaptureOptions(backward_ready=True, save_grads=True))
    t2.do(tl.grad("relu_1_2"), tl.zero_ablate(), intervention=tl.InterventionOptions(engine="set_only"))
    t2.do(tl.grad("relu_1_2"), tl.scale(1.0), model=model, inputs=x, loss=lambda r: r.output_ops[0].out.sum())
    assert torch.equal(t2.ops["linear_1_1"].grad, torch.zeros(2, 5))


def test_armed_gradient_rules_are_saved_with_their_count(mlp, tmp_path):
    model, x = mlp
    t = tl.trace(model, x, capture=tl.CaptureOptions(backward_ready=True))
    t.do(tl.grad("relu_1_2"), tl.zero_ablate(), intervention=tl.InterventionOptions(engine="set_only"))
    t.save(tmp_path / "t.tlspec")
    loaded = tl.load(tmp_path / "t.tlspec")
    assert loaded.annotations["armed_gradient_edits"] == 1
    assert [repr(r.target) for r in loaded.armed_edits] == ["tl.grad('relu_1_2')"]
    assert "armed_gradient_edits" not in t.annotations  # saving does not write into the live trace


def test_recipe_tensors_round_trip_through_the_torch_codec(mlp, tmp_path):
    model, x = mlp
    v = torch.arange(5, dtype=torch.float32)
    fork = tl.trace(model, x).fork().do(tl.module("1"), tl.steer(v, 2.0))
    fork.save(tmp_path / "t.tlspec")
    files = json.loads((tmp_path / "t.tlspec" / "manifest.json").read_text())["files"]
    assert "blobs/recipe-0000.safetensors" in files
    loaded = tl.load(tmp_path / "t.tlspec")
    with torch.no_grad():
        expected = model[2](torch.relu(model[0](x)) + 2.0 * v)
    assert torch.allclose(loaded.run(model, x).output_ops[0].out, expected)


def test_the_guarded_fast_rerun_on_torch(mlp):
    model, x = mlp
    t = tl.trace(model, x, save=tl.module("1"), intervene=tl.when(tl.module("1"), tl.scale(0.5)))
    x2 = torch.randn(2, 4)
    out = t.run(model, x2)
    assert out.last_run["engine"] == "guarded_fast"
    with torch.no_grad():
        relu = torch.relu(model[0](x2)) * 0.5
        assert torch.equal(out["relu_1_2"].out, relu)
        assert torch.allclose(out.output, model[2](relu))


def test_an_alias_spelling_refuses_at_every_entry_point():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(4, 4)
            self.dec = self.enc  # one module under two names

        def forward(self, x):
            return self.dec(self.enc(x))

    model, x = Tied(), torch.randn(2, 4)
    t = tl.trace(model, x)
    assert t.find_sites(tl.module("enc")).labels == ("linear_1_1:1", "linear_1_1:2")
    for spelling in ("dec", "dec:2"):
        for attempt in (lambda: t.find_sites(tl.module(spelling)), lambda: t.fork().do(tl.module(spelling), tl.scale(2.0)),
                        lambda: tl.trace(model, x, intervene=tl.when(tl.module(spelling), tl.scale(2.0))),
                        lambda: t.find_sites(tl.in_module(spelling)),
                        lambda: tl.when(tl.module(spelling), tl.scale(2.0)).bind(model)(x)):
            with pytest.raises(tl.errors.SelectorCompositionError) as info:
                attempt()
            assert info.value.code == "bind_static_anchor_unresolved" and info.value.fields["canonical"] == "enc"


def test_zero_fire_on_a_distribution_output_says_why():
    class Policy(nn.Module):
        def __init__(self):
            super().__init__()
            self.mu, self.log_std = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return torch.distributions.Normal(self.mu(x), self.log_std(x).exp())

    class Agent(nn.Module):
        def __init__(self):
            super().__init__()
            self.policy = Policy()

        def forward(self, x):
            return self.policy(x)

    model, x = Agent(), torch.randn(3, 4)
    spec = tl.when(tl.module("policy"), tl.scale(2.0))
    with pytest.raises(InterventionError) as info:
        tl.trace(model, x, intervene=spec, on_zero_fire="error")
    assert info.value.code == "trace_zero_fire" and info.value.fields["reason"] == "module_output_not_tensor"
    assert "'policy' output is not a tensor" in info.value.fields["reason_detail"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tl.trace(model, x, intervene=spec)
    (w,) = [c.message for c in caught if isinstance(c.message, tl.errors.ZeroFireWarning)]
    assert w.code == "trace_zero_fire" and w.fields["reason"] == "module_output_not_tensor"
    assert isinstance(w, RuntimeWarning)


def test_autograd_group_counts_backward_passes_and_survives_save(mlp, tmp_path):
    """glossary l. 20: trace.autograd holds the backward records (issue 13, fact groups)."""
    model, x = mlp
    t = tl.trace(model, x, capture=tl.CaptureOptions(backward_ready=True, save_grads=True))
    assert t.autograd.backward_passes == 0 and not t.autograd.has_grads
    t.backward(t.output.sum())
    expect = tuple(o.label for o in t.ops if o.has_grad)
    assert expect and t.autograd.ops_with_grads == expect
    assert t.autograd.backward_passes == 1 and t.autograd.has_backward_pass and t.autograd.has_grads
    t.save(tmp_path / "t.tlspec")
    assert tl.load(tmp_path / "t.tlspec").autograd == t.autograd
