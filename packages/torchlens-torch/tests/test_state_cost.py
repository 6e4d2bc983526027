"""Issue 26 (session 8): the cheaper model-state passes of a repeated capture.

`describe_model` first tries `_Quick` (a column-wise identity / type / shape test over the
whole model) before the fingerprint; `ModelStateSnapshot` answers "was anything touched?"
once for the whole model and keeps its per-module attribute classification in the
description's scratch. Each test changes what such a shortcut could miss and checks the result
against an independent computation: a fresh walk of the model (`describe._describe`, no cache),
the module's own registries and tensors read directly, or a plain forward."""

from __future__ import annotations

import enum

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens_torch import describe as D
from torchlens_torch import state as S


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU()
        self.fc = nn.Linear(4, 5)
        self.a = torch.zeros(5)  # two module-held tensors (their order is the description's)
        self.b = torch.ones(5)
        self.pair = (1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn(self.conv(x))).mean(dim=(2, 3))
        return self.fc(h) + self.a + self.b


def _summary(desc) -> tuple:
    info = desc.info
    return ([(m.address, m.class_name, m.class_qualname, m.all_addresses, m.training) for m in info.modules],
            [(p.address, p.module, p.name, p.shape, p.dtype, p.trainable, id(p.value), p.device, p.aliases)
             for p in info.params],
            [(b.address, b.module, b.name, b.shape, b.dtype, id(b.value), b.persistent, b.device) for b in info.buffers],
            [(a, id(t)) for a, t in desc.held], desc.module_address, desc.param_address, desc.buffer_address)


class _ReLU2(nn.ReLU):
    pass


class _Mode(enum.IntEnum):
    ONE = 1


CHANGES = [
    ("parameter strides through .data", lambda m: setattr(m.fc.weight, "data", torch.zeros(4, 5).t())),
    ("parameter shape through .data", lambda m: setattr(m.fc.weight, "data", torch.zeros(4, 5))),
    ("parameter dtype through .data", lambda m: setattr(m.conv.weight, "data", m.conv.weight.data.double())),
    ("parameter frozen", lambda m: m.fc.weight.requires_grad_(False)),
    ("buffer resized in place", lambda m: m.bn.running_mean.resize_(2)),
    ("held tensor resized in place", lambda m: m.a.resize_(3)),
    ("held tensor rebound", lambda m: setattr(m, "a", torch.zeros(5))),
    ("held tensors reordered", lambda m: (delattr(m, "a"), setattr(m, "a", m.b.clone()))),
    ("scalar tuple -> tuple with a tensor", lambda m: setattr(m, "pair", (1, torch.ones(2)))),
    ("non-persistent buffer", lambda m: m.bn._non_persistent_buffers_set.add("running_var")),
    ("class swapped", lambda m: setattr(m.act, "__class__", _ReLU2)),
    ("train mode", lambda m: m.train()),
    ("bias removed", lambda m: setattr(m.fc, "bias", None)),
    ("buffer registered", lambda m: m.fc.register_buffer("extra", torch.ones(1))),
    ("submodule replaced", lambda m: setattr(m, "act", nn.ReLU())),
    ("parameter moved between modules", lambda m: (m.conv.register_parameter("moved", m.fc._parameters.pop("bias")))),
    ("scalar attribute -> enum", lambda m: setattr(m.act, "inplace", _Mode.ONE)),
    ("scalar attribute -> list holding a tensor", lambda m: setattr(m.act, "inplace", [torch.ones(1)])),
]


@pytest.mark.parametrize("what,change", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_repeated_description_follows_each_change(what, change, monkeypatch) -> None:
    model = Net().eval()
    first = D.describe_model(model)
    assert D._CACHE[id(model)].quick is not None
    # unchanged: served by the quick test alone (the fingerprint is not taken)
    calls = []
    real = D._fingerprint
    monkeypatch.setattr(D, "_fingerprint", lambda mods: calls.append(1) or real(mods))
    again = D.describe_model(model)
    assert calls == [] and _summary(again) == _summary(first)
    change(model)
    got = D.describe_model(model)
    assert _summary(got) == _summary(D._describe(model)), what
    assert _summary(D.describe_model(model)) == _summary(D._describe(model)), what  # and once more (cache refreshed)


class _Config:
    def __init__(self) -> None:
        self.width = 4
        self.names = ["a", "b"]


class Holding(nn.Module):
    """Module state that can change in place: a list, a nested dict, a set, a plain object."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.items = [torch.zeros(1)]
        self.table = {"x": {"y": torch.ones(2)}}
        self.tags = {"t"}
        self.config = _Config()
        self.lin.config = self.config  # (one object held by two modules)


HOLDING_CHANGES = [
    ("tensor appended to a list", lambda m: m.items.append(torch.ones(3))),
    ("list item replaced", lambda m: m.items.__setitem__(0, torch.ones(4))),
    ("list item resized in place", lambda m: m.items[0].resize_(5)),
    ("dict entry added", lambda m: m.table.__setitem__("z", torch.ones(1))),
    ("nested dict entry replaced", lambda m: m.table["x"].__setitem__("y", torch.zeros(2))),
    ("tensor in a set", lambda m: m.tags.add(torch.ones(1))),
    ("public tensor on the held object", lambda m: setattr(m.config, "bias", torch.ones(2))),
    ("private tensor on the held object", lambda m: setattr(m.config, "_cache", torch.ones(2))),
    ("held object rebound", lambda m: setattr(m, "config", _Config())),
    ("list -> dict", lambda m: setattr(m, "items", {"0": m.items[0]})),
]


@pytest.mark.parametrize("what,change", HOLDING_CHANGES, ids=[c[0] for c in HOLDING_CHANGES])
def test_held_containers_and_objects_are_walked_at_every_repeated_description(what, change, monkeypatch) -> None:
    model = Holding()
    first = D.describe_model(model)
    assert first.held and D._CACHE[id(model)].fingerprint is not None
    calls = []
    real = D._fingerprint
    monkeypatch.setattr(D, "_fingerprint", lambda mods: calls.append(1) or real(mods))
    assert _summary(D.describe_model(model)) == _summary(first) and calls == []  # (the quick test)
    change(model)
    assert _summary(D.describe_model(model)) == _summary(D._describe(model)), what
    assert _summary(D.describe_model(model)) == _summary(D._describe(model)), what


def test_a_rebound_scalar_or_tuple_keeps_the_cached_walk(monkeypatch) -> None:
    model = Net().eval()
    D.describe_model(model)
    calls = []
    real = D._fingerprint
    monkeypatch.setattr(D, "_fingerprint", lambda mods: calls.append(1) or real(mods))
    model.bn.eps = 1e-3  # not part of the description: its type is all the quick test reads
    desc = D.describe_model(model)
    assert calls == [] and desc.scratch is not None
    model.conv.padding = (1, 1)  # a new tuple (identity): checked by the fingerprint, which holds
    desc = D.describe_model(model)
    assert calls == [1] and desc.scratch is not None
    D.describe_model(model)
    assert calls == [1]  # the quick test was retaken
    assert _summary(D.describe_model(model)) == _summary(D._describe(model))


class Writer(nn.Module):
    """A forward that changes registrations and attributes of its modules."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.lin = nn.Linear(3, 3)
        self.other = nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros(()))
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.what == "register_buffer":
            self.lin.register_buffer("seen", x.detach().clone())
        elif self.what == "rebind_parameter":
            self.lin._parameters["bias"] = nn.Parameter(torch.zeros(3))
        elif self.what == "swap_registries":
            self.other._parameters["weight"], self.lin._parameters["weight"] = (self.lin._parameters["weight"],
                                                                              self.other._parameters["weight"])
        elif self.what == "rebind_attribute":
            self.other.note = "seen"
            self.scale = 3.0
        elif self.what == "rebind_only":
            self.lin.in_features = 4
        elif self.what == "buffer_write":
            self.count.add_(1)
        elif self.what == "buffer_data_write":
            self.count.data.fill_(5)
        return self.other(self.lin(x)) * self.scale


def _state(model: nn.Module) -> tuple:
    regs = [(a, dict(m._parameters), dict(m._buffers), dict(m._modules)) for a, m in model.named_modules()]
    attrs = [(a, {k: v for k, v in vars(m).items() if not k.startswith("_")}) for a, m in model.named_modules()]
    values = [(k, t.detach().clone()) for k, t in model.state_dict(keep_vars=True).items()]
    return regs, attrs, values


@pytest.mark.parametrize("what", ["register_buffer", "rebind_parameter", "swap_registries", "rebind_attribute", "rebind_only",
                                  "buffer_write", "buffer_data_write", "none"])
def test_every_capture_leaves_registrations_attributes_and_bytes_as_they_were(what) -> None:
    torch.manual_seed(0)
    model, x = Writer(what), torch.randn(2, 3)
    for _ in range(3):  # the first capture walks afresh, the later ones use the cached description
        before = _state(model)
        trace = tl.trace(model, x)
        after = _state(model)
        assert [r[:1] + tuple({k: id(v) for k, v in d.items()} for d in r[1:]) for r in after[0]] == \
            [r[:1] + tuple({k: id(v) for k, v in d.items()} for d in r[1:]) for r in before[0]], what
        assert after[1] == before[1], what
        assert [(k, v.shape) for k, v in after[2]] == [(k, v.shape) for k, v in before[2]]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(after[2], before[2])), what
    writes = {a: {k: w.kind for k, w in rec.attribute_writes.items()} for a, rec in trace.modules.items()}
    if what == "rebind_attribute":
        assert writes == {"self": {"scale": "replaced"}, "lin": {}, "other": {"note": "added"}}
    elif what == "rebind_only":
        assert writes == {"self": {}, "lin": {"in_features": "replaced"}, "other": {}}
    else:
        assert all(not w for w in writes.values()), writes


def test_the_kept_classification_follows_a_rebound_attribute() -> None:
    """`ModelStateSnapshot` keeps which attributes can hold a tensor (`reach_plan`) in the
    scratch; an attribute rebound from a scalar to an object holding a tensor must show up."""

    class Holder:
        def __init__(self) -> None:
            self.t = torch.ones(2)

    model = Net().eval()
    modules = [("self", model)] + [(a, m) for a, m in model.named_modules() if a]
    scratch: dict = {}
    snap = S.ModelStateSnapshot(modules, scratch)
    assert "snapshot_classes" in scratch
    reach = dict((id(m), r) for m, r in snap.reach_plan())
    assert list(reach[id(model)]) == [model.a, model.b]  # (a list of tensors: by identity)
    snap.restore()
    held = Holder()
    model.act.inplace = held  # same keys, a new type
    snap = S.ModelStateSnapshot(modules, scratch)
    reach = dict((id(m), r) for m, r in snap.reach_plan())
    assert len(reach[id(model.act)]) == 1 and reach[id(model.act)][0] is held
    snap.restore()


def test_buffer_bytes_changed_by_the_forward_are_put_back_one_by_one() -> None:
    """The model-wide comparison of the buffers finds the one the forward changed (without a
    version bump: through `.data`) and only that one is written back."""
    model = Writer("buffer_data_write")
    modules = [(a or "self", m) for a, m in model.named_modules()]
    snap = S.ModelStateSnapshot(modules, {})
    model.count.data.fill_(5)
    version = model.count._version
    snap.restore()
    assert model.count.item() == 0.0 and model.count._version == version  # (through .data: no bump)


def test_the_snapshot_reads_the_description_facts_as_it_would_read_the_model() -> None:
    """A description rebuilt from the cache hands what its quick test read to the state
    snapshot; that snapshot holds exactly what one reading the model itself holds."""
    model = Writer("none")
    D.describe_model(model)
    desc = D.describe_model(model)
    assert desc.modules.facts is not None
    with_facts = S.ModelStateSnapshot(desc.modules, desc.scratch)
    assert desc.modules.facts is None  # (used once)
    plain = S.ModelStateSnapshot(list(desc.modules), None)
    for name in ("keys", "plans", "reg_lens", "reg_keys"):
        assert getattr(with_facts, name) == getattr(plain, name), name
    for name in ("rows", "reg_values", "regs", "buffers"):
        a, b = getattr(with_facts, name), getattr(plain, name)
        assert len(a) == len(b) and all(
            (x is y) if not isinstance(x, tuple) else all(map(lambda p, q: p is q, x, y)) for x, y in zip(a, b)), name
    model.lin.in_features = 7  # a rebound attribute after both snapshots: both see it touched
    assert with_facts.untouched_flags() == plain.untouched_flags() == [True, False, True]
    plain.restore()
    with_facts._flags = None
    with_facts.restore()
    assert model.lin.in_features == 3


class Branchy(nn.Module):
    """Which submodules run depends on the input (so which have a record does too)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.side = nn.Linear(3, 3)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self._modules.values()  # (by position: a renamed submodule still runs)
        return second(first(x)) * self.scale if x.sum() > 0 else first(x)


def _expected_custom(trace, model: nn.Module) -> dict:
    """Public plain attributes of each module that has a record (read from the live model)."""
    out = {}
    for a, m in model.named_modules():
        a = a or "self"
        if a in trace._modules:
            attrs = {k: v for k, v in vars(m).items() if not k.startswith("_") and type(v) in (bool, int, float, str)}
            if attrs:
                out[a] = attrs
    return out


def _rename(model: nn.Module, old: str, new: str) -> None:
    """Rename a submodule in place (the same `_modules` dict, no attribute of the model changes)."""
    items = [(new if k == old else k, v) for k, v in model._modules.items()]
    model._modules.clear()
    model._modules.update(items)


def test_custom_attributes_of_a_whole_model_follow_every_change() -> None:
    model, pos, neg = Branchy(), torch.ones(1, 3), -torch.ones(1, 3)
    steps = [("first", pos, None), ("again", pos, None), ("after a caller changed the last result", pos, None),
             ("a submodule not called", neg, None), ("called again", pos, None),
             ("renamed in place", pos, lambda m: _rename(m, "side", "other")),
             ("a value rebound", pos, lambda m: setattr(m.lin, "in_features", 4)),
             ("an attribute added", pos, lambda m: setattr(m.other, "note", 1.5))]
    for what, x, change in steps:
        if change is not None:
            change(model)
        trace = tl.trace(model, x)
        got = trace.annotations.get("module_custom_attributes", {})
        assert got == _expected_custom(trace, model), what
        assert set(got) == set(trace._modules), what
        for attrs in got.values():  # a trace's records are its own: a caller may change them
            attrs["changed_by_caller"] = True


class SharedStorage(nn.Module):
    """Two parameters over one storage (the second a view of the first's), one written in place."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.arange(6.0)
        self.a = nn.Parameter(base)
        self.b = nn.Parameter(base[2:5])
        self.c = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.a.mul_(10)
        return x * self.b + self.c


def test_parameters_sharing_a_storage_are_both_guarded_and_restored() -> None:
    model, x = SharedStorage(), torch.ones(3)
    want = {k: v.detach().clone() for k, v in model.named_parameters()}
    guard = S.ParamWriteGuard([], {}, params=list(model.named_parameters()))
    assert [len(v) for v in guard.by_storage.values()] == [2, 1]  # a and b together, c alone
    for _ in range(2):
        trace = tl.trace(model, x)
        assert sorted(trace.provenance.extra["params_restored"]) == ["a", "b"]
        assert all(torch.equal(p.detach(), want[k]) for k, p in model.named_parameters())
        assert torch.equal(trace.output, x * want["b"] * 10 + want["c"])  # (b saw a's write)
