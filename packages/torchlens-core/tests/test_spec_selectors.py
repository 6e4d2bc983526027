"""Selector statements of spec/glossary.md (universes, tl.grad's accepted inputs, signals,
removed capture arguments), each checked against the trace's own labels."""

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import SelectorCompositionError


@pytest.fixture(scope="module")
def t():
    from torchlens_reference import nn

    return tl.trace(nn.LoopNet(), np.ones((2, 4), dtype=np.float32))


def _code(fn):
    with pytest.raises(SelectorCompositionError) as info:
        fn()
    return info.value.code


def test_and_across_universes_refuses():
    a = tl.func("linear")
    assert _code(lambda: tl.grad(a) & a) == "selector_cross_universe_and"
    assert _code(lambda: a & tl.grad(a)) == "selector_cross_universe_and"
    assert _code(lambda: tl.grad(a) - a) == "selector_cross_universe_and"
    assert _code(lambda: (tl.grad(a) | a) & a) == "selector_cross_universe_and"


def test_and_inside_one_universe_works(t):
    sel = tl.grad(tl.func("linear")) & tl.grad(tl.module("cell:2"))
    assert t.find_sites(sel).labels == ("linear_2_2:2",)
    assert t.find_sites(sel).signal == "backward"


def test_not_of_grad_normalises_to_grad_of_not(t):
    neg = ~tl.grad(tl.in_module("self"))
    assert isinstance(neg, tl.select.selectors.GradSelector)
    assert repr(neg) == repr(tl.grad(~tl.in_module("self")))
    assert t.find_sites(neg).labels == ("input_1", "output_1")


def test_not_over_a_mixed_union_refuses():
    a = tl.func("linear")
    assert _code(lambda: ~(tl.grad(a) | a)) == "selector_cross_universe_not"


def test_grad_union_is_one_gradient_branch(t):
    u = tl.grad("linear_1_1") | tl.grad(tl.module("cell:3"))
    assert isinstance(u, tl.select.selectors.GradSelector)
    assert t.find_sites(u).labels == ("linear_1_1", "linear_2_2:3")


def test_grad_refuses_a_selection_and_accepts_records(t):
    assert _code(lambda: tl.grad(t[tl.func("tanh")])) == "grad_selection_unsupported"
    op = t.ops["linear_1_1"]
    assert t.find_sites(tl.grad(op)).labels == ("linear_1_1",)
    layer = t.layers["tanh_1_3"]
    assert t.find_sites(tl.grad(layer)).labels == ("tanh_1_3:1", "tanh_1_3:2", "tanh_1_3:3")


def test_find_sites_signal_and_column(t):
    pytest.importorskip("pandas")
    g = t.find_sites(tl.grad(tl.func("tanh")))
    assert g.signal == "backward"
    assert list(g.to_dataframe()["signal"]) == ["backward"] * 3
    f = t.find_sites(tl.func("tanh"))
    assert f.signal == "forward" and list(f.to_dataframe()["signal"]) == ["forward"] * 3
    mixed = t.find_sites(tl.grad("tanh_1_3:1") | tl.func("tanh") | tl.grad("linear_1_1"))
    assert mixed.signal == "both"
    assert dict(zip(mixed.labels, mixed.to_dataframe()["signal"])) == {
        "linear_1_1": "backward", "tanh_1_3:1": "both", "tanh_1_3:2": "forward", "tanh_1_3:3": "forward"}


def test_rule_signal_follows_the_site():
    edit = tl.zero_ablate()
    assert tl.intervention.Rule(tl.func("relu"), edit).signal == "forward"
    assert tl.intervention.Rule(tl.grad("relu_1_1"), edit).signal == "backward"
    assert tl.intervention.Rule(tl.grad("relu_1_1") | tl.func("relu"), edit).signal == "both"


@pytest.mark.parametrize("removed", ["keep_op", "keep_module"])
def test_removed_capture_arguments_raise_type_error(removed):
    from torchlens_reference import nn

    with pytest.raises(TypeError, match=removed):
        tl.trace(nn.LoopNet(), np.ones((2, 4), dtype=np.float32), **{removed: ["linear_1_1"]})


def test_layer_ops_and_module_calls_take_keys(t):
    """Indexing coherence (glossary l. 693): keyed like the typed entry points, own members only."""
    from torchlens.errors import LookupMissError

    layer = t.layers["linear_2_2"]
    assert layer.ops[1].label == "linear_2_2:2"                      # still a list by position
    assert layer.ops["linear_2_2:3"] is t.ops["linear_2_2:3"]
    assert layer.ops["cell:2"] is t.ops["cell:2"] and layer.ops["cell:2"].label == "linear_2_2:2"
    with pytest.raises(LookupMissError):
        layer.ops["tanh_1_3:1"]                                      # another layer's op
    cell = t.modules["cell"]
    assert cell.calls["linear_2_2:3"].label == "cell:3"
    assert cell.calls["cell:1"] is cell.calls[0]
    with pytest.raises(LookupMissError):
        cell.calls["tanh_1_3:1"]                                     # run by another module
    root = t.modules["self"]
    assert root.calls["tanh_1_3:2"].label == "self:1"
