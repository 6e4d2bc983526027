"""Named structural outputs (facets spec, "Structural output names come from the captured
ContainerSpec"): names recorded at capture from the returned container, values checked
against forward hooks on the same modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import FacetLookupError


class TopK(nn.Module):
    def forward(self, x):
        return torch.topk(x, 3, dim=-1)


class Nested(nn.Module):
    def forward(self, x):
        return x * 2, (x + 1, (x - 1, x * 3))


class Dicty(nn.Module):
    def forward(self, x):
        return {"logits": x.sum(-1), "hidden": x.tanh()}


class OneTuple(nn.Module):
    def forward(self, x):
        return (x.relu(),)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.gru = nn.GRU(4, 3, batch_first=True)
        self.topk = TopK()
        self.nested = Nested()
        self.dicty = Dicty()
        self.one = OneTuple()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        o, (h, c) = self.lstm(x)
        g, gh = self.gru(x)
        t = self.topk(o)
        n = self.nested(x)
        d = self.dicty(x)
        (r,) = self.one(x)
        return o.sum() + h.sum() + c.sum() + gh.sum() + t.values.sum() + n[1][1][0].sum() + d["logits"].sum() \
            + r.sum() + self.lin(x).sum()


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 3, 4)
    log = tl.trace(model, x)
    seen = {}
    handles = [getattr(model, a).register_forward_hook(lambda m, i, o, a=a: seen.__setitem__(a, o))
               for a in ("lstm", "gru", "topk", "nested", "dicty", "one", "lin")]
    model(x)
    for h in handles:
        h.remove()
    return log, seen


def test_lstm_h_n_c_n_equal_a_forward_hook(captured):
    log, seen = captured
    f = log.modules["lstm"].facets
    assert f.keys() == ["output", "h_n", "c_n"]
    out, (h_n, c_n) = seen["lstm"]
    assert torch.equal(f["output"].value, out)
    assert torch.equal(f["h_n"].value, h_n) and torch.equal(f.h_n.value, h_n)
    assert torch.equal(f["c_n"].value, c_n)
    # the positional path still resolves, as a string and as a typed path
    assert torch.equal(f["out1.1"].value, c_n) and torch.equal(f[(1, 0)].value, h_n)
    assert "out1.0" not in f.declared()  # listed once, under its documented name


def test_gru_h_n(captured):
    log, seen = captured
    f = log.modules["gru"].facets
    assert f.keys() == ["output", "h_n"]
    assert torch.equal(f["h_n"].value, seen["gru"][1])
    assert torch.equal(f["output"].value, seen["gru"][0])


def test_topk_values_indices(captured):
    log, seen = captured
    f = log.modules["topk"].facets
    assert f.keys() == ["values", "indices"]
    assert torch.equal(f["values"].value, seen["topk"].values)
    assert torch.equal(f["indices"].value, seen["topk"].indices)
    assert torch.equal(f["out1"].value, seen["topk"].indices)


def test_nested_tuple_positional_names(captured):
    log, seen = captured
    f = log.modules["nested"].facets
    assert f.keys() == ["out0", "out1.0", "out1.1.0", "out1.1.1"]
    a, (b, (c, d)) = seen["nested"]
    for name, want in zip(f.keys(), (a, b, c, d)):
        assert torch.equal(f[name].value, want), name
    assert torch.equal(f[(1, 1, 0)].value, c)
    with pytest.raises(FacetLookupError) as exc:
        f["out2"]
    assert exc.value.code == "facet_unknown"


def test_dict_output_keys_and_single_tensor_names(captured):
    log, seen = captured
    f = log.modules["dicty"].facets
    assert f.keys() == ["logits", "hidden"]
    assert torch.equal(f["hidden"].value, seen["dicty"]["hidden"])
    assert torch.equal(f["logits"].value, seen["dicty"]["logits"])
    assert log.modules["lin"].facets.keys() == ["out"]
    assert torch.equal(log.modules["lin"].facets["out"].value, seen["lin"])
    one = log.modules["one"].facets  # a one-tensor tuple reads like a single tensor output
    assert one.keys() == ["out"] and torch.equal(one["out0"].value, seen["one"][0])


def test_names_are_recorded_only_for_containers(captured):
    log, _ = captured
    names = log.annotations["module_output_names"]
    assert "lin:1" not in names and "lstm:1" in names


class NamedNest(nn.Module):
    def forward(self, x):
        return {"enc": (x + 1, x - 1), "keys": x * 2}


def test_typed_paths_of_field_names(captured):
    """A tuple path of field names (and positions under a field) names the same leaf as its
    string name; a name that collides with a FacetView method (`keys`) reads by path too."""
    log, seen = captured
    lstm = log.modules["lstm"].facets
    assert torch.equal(lstm[("h_n",)].value, seen["lstm"][1][0])
    assert torch.equal(lstm[("output",)].value, seen["lstm"][0])
    assert torch.equal(log.modules["topk"].facets[("indices",)].value, seen["topk"].indices)
    assert torch.equal(log.modules["dicty"].facets[["hidden"]].value, seen["dicty"]["hidden"])

    x = torch.randn(2, 3)
    nest = tl.trace(NamedNest(), x).modules["self"].facets
    assert nest.keys() == ["enc.0", "enc.1", "keys"]
    assert torch.equal(nest[("enc", 1)].value, x - 1) and torch.equal(nest[("keys",)].value, x * 2)
    assert torch.equal(nest[(0, 0)].value, x + 1)  # positions still resolve
    for bad in [("enc", 2), ("nope",), (), (1.5,), (True,)]:
        with pytest.raises(FacetLookupError) as exc:
            nest[bad]
        assert exc.value.code == "facet_unknown" and isinstance(exc.value, KeyError), bad
