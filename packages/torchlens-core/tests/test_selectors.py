"""Selectors resolve to the right ops and compose with & | - ~."""

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import LookupMissError, SelectorCompositionError


@pytest.fixture(scope="module")
def t():
    from torchlens_reference import nn

    return tl.trace(nn.LoopNet(), np.ones((2, 4), dtype=np.float32))


def test_primitives(t):
    assert t[tl.func("linear")].labels == ("linear_1_1", "linear_2_2:1", "linear_2_2:2", "linear_2_2:3")
    assert t[tl.module("cell")].labels == ("linear_2_2:1", "linear_2_2:2", "linear_2_2:3")
    assert t[tl.module("cell:2")].labels == ("linear_2_2:2",)
    assert t[tl.in_module("act")].labels == ("tanh_1_3:1", "tanh_1_3:2", "tanh_1_3:3")
    assert t[tl.in_module("self")].labels == t.labels[1:-1]
    assert t[tl.label("tanh_1_3:last")].labels == ("tanh_1_3:3",)
    assert t[tl.label_contains("_2_")].labels == ("linear_2_2:1", "linear_2_2:2", "linear_2_2:3")
    assert t[tl.label_matches(r"^tanh.*:[12]$")].labels == ("tanh_1_3:1", "tanh_1_3:2")
    assert t[tl.model_input()].labels == ("input_1",)
    assert t[tl.model_output()].labels == ("output_1",)
    assert t[tl.all_sites()].labels == t.labels
    assert t[tl.where(lambda op: op.pass_number == 2)].labels == ("linear_2_2:2", "tanh_1_3:2")
    assert t[tl.where(func_name="tanh", pass_number=1)].labels == ("tanh_1_3:1",)


def test_composition(t):
    both = tl.func("linear") & tl.in_module("cell")
    assert t[both].labels == ("linear_2_2:1", "linear_2_2:2", "linear_2_2:3")
    assert t[tl.func("linear") - tl.module("cell")].labels == ("linear_1_1",)
    assert t[tl.module("inp") | tl.module("cell:1")].labels == ("linear_1_1", "linear_2_2:1")
    assert t[~tl.in_module("self")].labels == ("input_1", "output_1")
    assert repr(tl.func("relu") & ~tl.module("a")) == "(tl.func('relu') & ~tl.module('a'))"


def test_find_sites_first_and_table(t):
    sites = t.find_sites(tl.module("cell"))
    assert sites.first().label == "linear_2_2:1" and len(sites) == 3
    df = sites.to_dataframe()
    assert list(df["label"]) == ["linear_2_2:1", "linear_2_2:2", "linear_2_2:3"]
    with pytest.raises(SelectorCompositionError) as info:
        t.find_sites(tl.func("conv2d")).first()
    assert info.value.code == "selector_no_match"


def test_refusals(t):
    with pytest.raises(SelectorCompositionError) as info:
        tl.func("relu") & "linear_1_1"
    assert info.value.code == "selector_operand_invalid"
    with pytest.raises(SelectorCompositionError) as info:
        tl.where(colour="red")
    assert info.value.code == "selector_key_unknown"
    with pytest.raises(SelectorCompositionError) as info:
        tl.label_matches("(")
    assert info.value.code == "selector_pattern_invalid"
    with pytest.raises(LookupMissError) as info:
        t[tl.module("cel")]
    assert info.value.code == "label_unknown" and "cell" in info.value.fields["suggestions"]
    with pytest.raises(SelectorCompositionError):
        tl.module(3)
