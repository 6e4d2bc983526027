"""Spec fidelity (issue 13, round 3): tied-parameter aliases and params.numel_by_path
(glossary l. 26), promoted provenance facts (l. 15-17), each checked live and after save/load."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import torchlens as tl

transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def gpt2_trace():
    model = _gpt2()
    ids = torch.randint(0, 50, (1, 5))
    return model, tl.trace(model, ids)


def _independent_counts(model):
    once = sum(p.numel() for p in model.parameters())  # torch dedups shared parameters
    per_path = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    return once, per_path


def test_gpt2_tie_is_recorded_and_counted(gpt2_trace):
    model, trace = gpt2_trace
    once, per_path = _independent_counts(model)
    assert per_path - once == model.transformer.wte.weight.numel()  # the independent view of the tie
    assert trace.params.numel == once
    assert trace.params.numel_by_path == per_path
    wte = trace.params["transformer.wte.weight"]
    assert wte.aliases == ("lm_head.weight",)
    assert trace.params["lm_head.weight"] is wte  # an alias address finds the one record
    assert trace.graph.tied_param_groups == (("transformer.wte.weight", "lm_head.weight"),)


def test_gpt2_tie_survives_save_load(gpt2_trace, tmp_path):
    model, trace = gpt2_trace
    once, per_path = _independent_counts(model)
    trace.save(tmp_path / "g.tlspec")
    loaded = tl.load(tmp_path / "g.tlspec")
    assert loaded.params["transformer.wte.weight"].aliases == ("lm_head.weight",)
    assert (loaded.params.numel, loaded.params.numel_by_path) == (once, per_path)
    assert loaded.graph.tied_param_groups == (("transformer.wte.weight", "lm_head.weight"),)


class _SharedModule(nn.Module):
    """One Linear registered at two paths: every one of its parameters is tied."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = self.a
        self.c = nn.Linear(3, 2)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def test_shared_module_paths_and_untied_filters(tmp_path):
    model = _SharedModule()
    trace = tl.trace(model, torch.randn(2, 3))
    once, per_path = _independent_counts(model)
    assert (trace.params.numel, trace.params.numel_by_path) == (once, per_path)
    assert trace.params["a.weight"].aliases == ("b.weight",)
    assert trace.params["c.weight"].aliases == ()
    assert trace.params.trainable.numel_by_path == per_path
    assert sorted(trace.graph.tied_param_groups) == [("a.bias", "b.bias"), ("a.weight", "b.weight")]
    trace.save(tmp_path / "s.tlspec")
    loaded = tl.load(tmp_path / "s.tlspec")
    assert (loaded.params.numel, loaded.params.numel_by_path) == (once, per_path)
    assert loaded.params["b.weight"].address == "a.weight"
    assert sorted(loaded.graph.tied_param_groups) == [("a.bias", "b.bias"), ("a.weight", "b.weight")]


def test_an_alias_repeating_an_address_refuses_on_load(tmp_path):
    """A file whose alias names another parameter's address would count that path twice:
    the loader refuses it typed (record_reference_invalid) instead of building the trace."""
    import sys
    from pathlib import Path

    from torchlens.errors import ArtifactError

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torchlens-core" / "tests"))
    from security_artifacts import cell, rewrite_records

    trace = tl.trace(_SharedModule(), torch.randn(2, 3))
    path = tmp_path / "s.tlspec"
    trace.save(path)

    def edit(tables):
        row, col = cell(tables, "params", "c.bias", "aliases")
        row[col] = ["a.weight"]  # c.bias claims a.weight's path

    rewrite_records(path, edit)
    with pytest.raises(ArtifactError) as err:
        tl.load(path)
    assert err.value.code == "record_reference_invalid" and err.value.fields["at"] == "params[3].aliases"


def test_provenance_thread_and_identity_facts(tmp_path):
    model = nn.Linear(3, 2)
    before = threading.active_count()
    trace = tl.trace(model, torch.randn(2, 3))
    prov = trace.provenance
    assert prov.owner_thread_id == threading.get_ident()
    assert prov.thread_activity_detected is False
    assert prov.thread_count_start == before and prov.thread_count_end == threading.active_count()
    assert prov.model_object_id == id(model)
    trace.save(tmp_path / "p.tlspec")
    loaded = tl.load(tmp_path / "p.tlspec").provenance
    assert (loaded.owner_thread_id, loaded.thread_activity_detected, loaded.thread_count_start,
            loaded.thread_count_end, loaded.model_object_id) == (
        prov.owner_thread_id, False, prov.thread_count_start, prov.thread_count_end, id(model))


class _Owner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x)

    def encode(self, x):
        return torch.relu(self.fc(x)) * 2


def test_rerunning_a_bound_method_capture_refuses_and_replay_still_works():
    """glossary l. 130: rerunning a bound-method capture raises rerun_entry_point_unsupported
    before anything changes (today a rerun with the owner module silently runs forward, a
    different graph); replay is unaffected."""
    from torchlens.errors import InterventionError

    m, x = _Owner(), torch.randn(2, 3)
    trace = tl.trace(m.encode, x)
    fork = trace.fork()
    for model in (m, m.encode):
        with pytest.raises(InterventionError) as err:
            fork.do("relu_1_2", tl.zero_ablate(), model=model, inputs=x)
        assert err.value.code == "rerun_entry_point_unsupported"
        assert err.value.fields["root_entry_point"] == "bound_method:_Owner.encode"
        assert fork.is_pristine
    with pytest.raises(InterventionError) as err:
        tl.trace(m.encode, x).fork().do("relu_1_2", tl.zero_ablate(), intervention=tl.InterventionOptions(
            engine="set_only")).run(m.encode, x)
    assert err.value.code == "rerun_entry_point_unsupported"
    replayed = trace.fork().do("relu_1_2", tl.zero_ablate())  # replay: unaffected
    assert torch.equal(replayed["mul_1_3"].out, torch.zeros_like(replayed["mul_1_3"].out))


def test_cost_totals_are_unit_quantities_live_and_loaded(tmp_path):
    """glossary l. 970: tl.types.Quantity and its Bytes / Duration / Flops / Macs; trace.cost
    carries them, with the values an independent count gives, after save/load too."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    trace = tl.trace(model, torch.randn(3, 4))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    trace.save(tmp_path / "c.tlspec")
    for cost in (trace.cost, tl.load(tmp_path / "c.tlspec").cost):
        assert isinstance(cost.total_param_memory, tl.types.Bytes) and cost.total_param_memory == param_bytes
        assert isinstance(cost.forward_duration, tl.types.Duration) and cost.forward_duration > 0
        assert isinstance(cost.total_flops, tl.types.Flops) and isinstance(cost.total_macs, tl.types.Macs)
        assert all(isinstance(q, tl.types.Quantity) for q in (cost.total_flops, cost.total_activation_memory))
        assert str(cost.total_param_memory) == f"{param_bytes} B"
    assert str(tl.types.Bytes(1_500_000)) == "1.5 MB" and str(tl.types.Duration(0.002)) == "2 ms"
    assert f"{tl.types.Flops(1234):,}" == "1,234" and tl.types.Macs(3) + 1 == 4
