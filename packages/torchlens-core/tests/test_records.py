"""Records built from the toy backend: labels, edges, modules, passes, lookup coherence.

Values are checked against an independent numpy computation of the same model.
"""

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import AmbiguousOpLookupError, InvalidArgumentError, LookupMissError, PayloadUnavailableError


@pytest.fixture
def loop():
    from torchlens_reference import nn

    model = nn.LoopNet(width=4, steps=3)
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    return model, x, tl.trace(model, x)


def _lin(layer, x):
    return x @ layer.weight.value.T + layer.bias.value


def test_labels_and_pass_grouping(loop):
    _, _, t = loop
    assert t.labels == ("input_1", "linear_1_1", "linear_2_2:1", "tanh_1_3:1", "linear_2_2:2", "tanh_1_3:2",
                        "linear_2_2:3", "tanh_1_3:3", "output_1")
    assert t.layer_labels == ("input_1", "linear_1_1", "linear_2_2", "tanh_1_3", "output_1")
    layer = t.layers["linear_2_2"]
    assert layer.num_passes == 3 and [o.pass_number for o in layer.ops] == [1, 2, 3]
    assert all(o.num_passes == 3 for o in layer.ops)
    assert t.layers["linear_1_1"].num_passes == 1 and t["linear_1_1"].label == "linear_1_1"


def test_values_match_an_independent_computation(loop):
    model, x, t = loop
    h = _lin(model.inp, x)
    assert np.array_equal(t["linear_1_1"].out, h)
    for n in (1, 2, 3):
        pre = _lin(model.cell, h)
        assert np.array_equal(t[f"linear_2_2:{n}"].out, pre)
        h = np.tanh(pre)
        assert np.array_equal(t[f"tanh_1_3:{n}"].out, h)
    assert np.array_equal(t.output, h) and np.array_equal(t["output_1"].out, h)


def test_parents_and_children_agree(loop):
    _, _, t = loop
    assert t.ops["linear_2_2:2"].parents == ("tanh_1_3:1",)
    assert t.ops["linear_2_2:1"].parents == ("linear_1_1",)
    assert t.ops["input_1"].children == ["linear_1_1"]
    for op in t.ops:
        for p in op.parents:
            assert op.label in t.ops[p].children
        for c in op.children:
            assert op.label in t.ops[c].parents
    assert t.layers["tanh_1_3"].children == ["linear_2_2", "output_1"]


def test_module_records_and_calls(loop):
    _, _, t = loop
    assert t.modules.labels == ("self", "inp", "cell", "act")
    cell = t.modules["cell"]
    assert cell.num_calls == 3 and cell.class_name == "Linear" and cell.parent == "self"
    assert [c.label for c in cell.calls] == ["cell:1", "cell:2", "cell:3"]
    assert t["cell:2"].output_labels == ["linear_2_2:2"]
    assert t["cell:2"].input_labels == ["tanh_1_3:1"]
    assert t.modules["self"].children == ["inp", "cell", "act"]
    assert t.ops["cell:3"].label == "linear_2_2:3"
    assert t.modules["tanh_1_3:2"].address == "act"
    assert t.module_calls["tanh_1_3:2"].label == "act:2"
    assert t.modules["self"].layer_labels == ["linear_1_1", "linear_2_2", "tanh_1_3"]
    assert t.ops["linear_2_2:1"].modules == ("self", "cell") and t.ops["linear_2_2:1"].module == "cell"


def test_params(loop):
    _, _, t = loop
    assert t.params.labels == ("inp.weight", "inp.bias", "cell.weight", "cell.bias")
    assert t.params["cell.weight"].num_calls == 3 and t.params["inp.bias"].num_calls == 1
    assert t.params.numel == 2 * (16 + 4)
    assert t.ops["linear_2_2:1"].params == ("cell.weight", "cell.bias")
    with pytest.raises(AmbiguousOpLookupError) as info:
        t.params["cell"]
    assert info.value.code == "ambiguous_op_lookup" and "cell.weight" in info.value.fields["candidates"]


def test_indexing_coherence(loop):
    _, _, t = loop
    assert isinstance(t["linear_2_2"], tl.Layer)
    assert isinstance(t["linear_2_2:2"], tl.Op)
    assert t["linear_2_2:last"].label == "linear_2_2:3"
    assert isinstance(t["cell"], tl.Module) and isinstance(t["cell:1"], tl.ModuleCall)
    assert isinstance(t["cell.weight"], tl.Param)
    assert t["linear_2_2:all"].labels == ("linear_2_2:1", "linear_2_2:2", "linear_2_2:3")
    assert t.layers["linear_2_2:2"] is t.layers["linear_2_2"]
    assert t[0].label == "input_1" and t.ops[-1].label == "output_1"


def test_bare_multipass_label_refusals(loop):
    _, _, t = loop
    with pytest.raises(AmbiguousOpLookupError) as info:
        t.ops["linear_2_2"]
    assert info.value.code == "ambiguous_op_lookup"
    with pytest.raises(AmbiguousOpLookupError) as info:
        t[tl.label("linear_2_2")]
    assert info.value.code == "multipass_bare_label_ambiguous"
    with pytest.raises(AmbiguousOpLookupError) as info:
        t["linear_2_2"].out
    assert info.value.code == "layer_pass_ambiguous"
    with pytest.raises(AmbiguousOpLookupError):
        t.ops["linear_2_2:all"]
    with pytest.raises(AmbiguousOpLookupError) as info:
        t.ops["cell"]
    assert "cell:1" in info.value.fields["candidates"]
    with pytest.raises(LookupMissError) as info:
        t["linear_2_2:4"]
    assert info.value.code == "pass_out_of_range"


def test_unknown_keys_are_typed_errors_with_suggestions(loop):
    _, _, t = loop
    with pytest.raises(LookupMissError) as info:
        t["linear_2_3"]
    assert info.value.code == "label_unknown" and "linear_2_2" in info.value.fields["suggestions"]
    assert isinstance(info.value, KeyError)
    with pytest.raises(InvalidArgumentError):
        t[3.5]


def test_count_by(loop):
    _, _, t = loop
    assert t.ops.count_by("module") == {None: 2, "inp": 1, "cell": 3, "act": 3}
    assert t.layers.count_by("kind") == {"input": 1, "linear": 2, "tanh": 1, "output": 1}
    assert t.modules.count_by("class_name") == {"LoopNet": 1, "Linear": 2, "Tanh": 1}
    with pytest.raises(InvalidArgumentError) as info:
        t.ops.count_by()
    assert info.value.code == "accessor_count_by_key_required"
    with pytest.raises(InvalidArgumentError) as info:
        t.ops.count_by("colour")
    assert info.value.code == "accessor_count_by_key_unknown"


def test_filters(loop):
    _, _, t = loop
    assert len(t.ops.compute) == 7 and len(t.layers.compute) == 3
    assert t.layers.recurrent.labels == ("linear_2_2", "tanh_1_3")
    assert len(t.params.trainable) == 4 and len(t.params.frozen) == 0 and len(t.params.unexecuted) == 0


def test_save_none_keeps_structure_only():
    from torchlens_reference import nn

    model = nn.LoopNet()
    x = np.ones((2, 4), dtype=np.float32)
    t = tl.trace(model, x, save="none")
    assert t.labels[2] == "linear_2_2:1" and t["linear_2_2:1"].shape == (2, 4)
    with pytest.raises(PayloadUnavailableError) as info:
        t["linear_2_2:1"].out
    assert info.value.code == "activation_not_saved" and "save=" in info.value.remedy


def test_save_selector_keeps_only_matches():
    from torchlens_reference import nn

    t = tl.trace(nn.LoopNet(), np.ones((2, 4), dtype=np.float32), save=tl.module("cell:2") | tl.func("tanh"))
    assert {o.label for o in t.ops if o.saved} == {"linear_2_2:2", "tanh_1_3:1", "tanh_1_3:2", "tanh_1_3:3"}
    t2 = tl.trace(nn.LoopNet(), np.ones((2, 4), dtype=np.float32), save=["linear_1_1", "cell:3", 0])
    assert {o.label for o in t2.ops if o.saved} == {"linear_1_1", "linear_2_2:3", "input_1"}
    with pytest.raises(InvalidArgumentError) as info:
        tl.trace(nn.LoopNet(), np.ones((2, 4), dtype=np.float32), save=3.0)
    assert info.value.code == "save_spec_invalid"


def test_failing_forward_carries_partial_trace():
    from torchlens_reference import nn, ops

    class Boom(nn.Module):
        def forward(self, x):
            y = ops.relu(x)
            raise ValueError("boom")

    with pytest.raises(tl.errors.TraceCaptureError) as info:
        tl.trace(Boom(), np.ones(3, dtype=np.float32))
    assert info.value.code == "forward_failed"
    partial = info.value.partial_trace
    assert partial.labels == ("input_1", "relu_1_1")
    with pytest.raises(PayloadUnavailableError) as info2:
        partial.output
    assert info2.value.code == "output_forward_failed"


def test_constants_and_literal_producers():
    from torchlens_reference import nn, ops

    bias = np.full(3, 2.0, dtype=np.float32)

    class C(nn.Module):
        def forward(self, x):
            z = ops.zeros((3,))
            return ops.add(ops.add(x, bias), z)

    t = tl.trace(C(), np.ones(3, dtype=np.float32))
    const = [o for o in t.ops if o.kind == "constant"]
    assert len(const) == 1 and np.array_equal(const[0].out, bias) and const[0].parents == ()
    zeros = t[tl.func("zeros")].first()
    assert zeros.parents == () and zeros.is_source
    assert t.ops["add_1_3"].parents == ("input_1", const[0].label)


def test_count_by_kind_uses_the_op_family_token():
    from torchlens_reference import nn, ops

    class Twice(nn.Module):
        def forward(self, x):
            return ops.add(ops.add(x, x), x)

    t = tl.trace(Twice(), np.ones(2, np.float32))
    assert t.ops.count_by("kind") == {"input": 1, "add": 2, "output": 1}
    assert t.ops["add_2_2"].func_name == "add"
