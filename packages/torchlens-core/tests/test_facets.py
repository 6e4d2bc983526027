"""Facets in core (issue 15, spec/facets.md): FacetSpec primitives and capability classes,
the registry's precedence and snapshots, the access surface's four statuses, multi-call
refusal and MissingGrad. Values are checked against numpy computations of the same model
on the reference backend."""

from __future__ import annotations

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import FacetError, FacetWarning, MissingFacetError
from torchlens.facets.spec import FacetSpec


@pytest.fixture(autouse=True)
def clean_registry():
    tl.facets.reset()
    yield
    tl.facets.reset()


@pytest.fixture
def loop():
    from torchlens_reference import nn

    model = nn.LoopNet(width=4, steps=3)
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    return model, x


def _home(shape=(2, 3, 12)):
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape)


# specs ----------------------------------------------------------------------------------------
def test_primitive_chain_reads_like_the_hand_written_slicing():
    x = _home()
    spec = FacetSpec(home_kind="op", home="h")
    assert np.array_equal(spec.split(3)[1].read(x), x[..., 4:8])
    assert np.array_equal(spec.split([6, 3, 3])[2].read(x), x[..., 9:12])
    assert np.array_equal(spec.split(3)[0].heads(2).read(x), x[..., 0:4].reshape(2, 3, 2, 2))
    assert np.array_equal(spec.heads(3, 4).transpose(1, 2).read(x), x.reshape(2, 3, 3, 4).swapaxes(1, 2))
    assert np.array_equal(spec.select(1, 2).read(x), x[:, 2])
    assert np.array_equal(spec[0, 1:].read(x), x[0, 1:])
    assert np.array_equal(spec.reshape(6, 12).read(x), x.reshape(6, 12))


def test_capability_is_the_weakest_primitive_of_the_chain():
    spec = FacetSpec(home_kind="op", home="h")
    assert spec.heads(3).capability == "bijective_view" and spec.heads(3).writable
    assert spec.split(3)[0].heads(2).capability == "selection"
    aliased = spec.heads(3).alias_head(4, 2)
    assert aliased.capability == "aliasing_selection" and not aliased.writable and aliased.flags["grad"]
    comp = tl.facets.computed_spec(lambda t: 0, ("a",))
    assert comp.capability == "computed" and not comp.writable and not comp.flags["grad"]
    param = FacetSpec(home_kind="parameter", home="fc.weight")
    assert not param.writable and not param.flags["grad"]


def test_scatter_update_writes_only_the_facet_region():
    x = _home()
    spec = FacetSpec(home_kind="op", home="h").split(3)[1].heads(2).select(-2, 1)
    edited = spec.scatter_update(x, np.zeros((2, 3, 2), dtype=np.float32))
    want = x.copy()
    want[..., 6:8] = 0  # section 1 is columns 4:8; its head 1 is 6:8
    assert np.array_equal(edited, want) and edited.dtype == x.dtype and edited.shape == x.shape
    assert np.array_equal(x, _home())  # the home value itself is never written
    t = FacetSpec(home_kind="op", home="h").heads(3).transpose(1, 2)
    assert np.array_equal(t.scatter_update(x, t.read(x) * 2), x * 2)


def test_bad_chains_refuse_with_codes():
    spec = FacetSpec(home_kind="op", home="h")
    with pytest.raises(FacetError) as exc:
        spec.heads(5).read(_home())  # 12 columns do not split into 5 heads
    assert exc.value.code == "facet_transform_invalid"
    with pytest.raises(FacetError) as exc:
        spec.split(3).read(_home())
    assert exc.value.code == "facet_spec_invalid"
    with pytest.raises(FacetError) as exc:
        spec.split(3)[3]
    assert exc.value.code == "facet_index_out_of_range"
    with pytest.raises(FacetError) as exc:
        tl.facets.computed_spec(lambda t: 0, ()).scatter_update(_home(), _home())
    assert exc.value.code == "facet_write_refused"
    with pytest.raises(FacetError) as exc:
        FacetSpec(home_kind="somewhere")
    assert exc.value.code == "facet_spec_invalid"


# access ---------------------------------------------------------------------------------------
def test_structural_facets_and_lookups(loop):
    model, x = loop
    log = tl.trace(model, x)
    f = log.modules["inp"].facets
    assert f.keys() == ["out"] and "out" in f and f.has("out")
    assert np.array_equal(f["out"].value, x @ model.inp.weight.value.T + model.inp.bias.value)
    assert np.array_equal(f.out.value, f["out"].value) and f["out"].shape == (2, 4)
    with pytest.raises(KeyError) as exc:
        f["q"]
    assert exc.value.code == "facet_unknown"
    assert f.get("q", "default") == "default"
    with pytest.raises(AttributeError):
        f.q


def test_multi_call_module_refuses_module_facets_and_reads_each_call(loop):
    model, x = loop
    log = tl.trace(model, x)
    cell = log.modules["cell"]
    with pytest.raises(FacetError) as exc:
        cell.facets
    assert exc.value.code == "facet_module_multi_call"
    h = x @ model.inp.weight.value.T + model.inp.bias.value
    for call in cell.calls:
        pre = h @ model.cell.weight.value.T + model.cell.bias.value
        assert np.allclose(call.facets["out"].value, pre)
        h = np.tanh(pre)


def _halves(module):
    out = tl.facets.call_output_spec(tl.facets.current_call(module), "test.halves")
    return {"lo": out.split(2)[0], "hi": out.split(2)[1], "nothing": None}


def test_registered_recipe_values_statuses_and_snapshot(loop):
    model, x = loop
    tl.facets.register(class_name="LoopNet", recipe_id="test.halves", facets=("lo", "hi", "nothing", "later"))(_halves)
    log = tl.trace(model, x)
    tl.facets.stamp(log)  # what the capture entry point does (pending: notes/s4/F.md)
    f = log.modules["self"].facets
    out = log.output_ops[0].out
    assert np.array_equal(f["lo"].value, out[:, :2]) and np.array_equal(f.hi.value, out[:, 2:])
    declared = f.declared()
    assert declared["lo"] == "available_now" and declared["nothing"] == "structurally_absent"
    assert declared["later"] == "declared_not_produced"
    with pytest.raises(KeyError) as exc:
        f["nothing"]
    assert exc.value.code == "facet_structurally_absent"
    # a registration after capture does not change what this trace's facets mean
    tl.facets.register(class_name="LoopNet", recipe_id="test.late")(lambda m: {"late": FacetSpec("op", home="x")})
    assert "late" not in log.modules["self"].facets.declared()
    log2 = tl.trace(model, x)
    tl.facets.stamp(log2)
    assert "late" in log2.modules["self"].facets.declared()


def test_needs_capture_raises_missing_facet_error_with_a_recapture_hint(loop):
    model, x = loop
    tl.facets.register(class_name="LoopNet", recipe_id="test.halves")(_halves)
    log = tl.trace(model, x, save=["inp"])
    tl.facets.stamp(log)
    f = log.modules["self"].facets
    assert f.declared()["lo"] == "needs_capture" and "lo" not in f
    with pytest.raises(MissingFacetError) as exc:
        f["lo"]
    assert exc.value.code == "facet_needs_capture" and "save" in exc.value.remedy
    assert isinstance(exc.value, KeyError) and f.get("lo") is None


def test_missing_grad_is_a_falsy_sentinel_that_refuses_tensor_use(loop):
    model, x = loop
    log = tl.trace(model, x)
    g = log.modules["inp"].facets["out"].grad
    assert isinstance(g, tl.facets.MissingGrad) and not g and "save_grads=True" in g.recapture
    with pytest.raises(FacetError) as exc:
        np.asarray(g)
    assert exc.value.code == "facet_grad_unavailable"
    with pytest.raises(FacetError):
        g + 1


def test_precedence_tiers_and_same_tier_collision_warning(loop):
    model, x = loop
    tl.facets.register(predicate=lambda m: m.address == "self", recipe_id="p")(
        lambda m: {"which": tl.facets.parameter_spec(m, "inp.weight", "p")})
    tl.facets.register(class_name="LoopNet", recipe_id="n")(
        lambda m: {"which": tl.facets.parameter_spec(m, "cell.weight", "n")})
    tl.facets.register(class_qualname="LoopNet", recipe_id="q")(
        lambda m: {"which": tl.facets.parameter_spec(m, "cell.bias", "q")})
    log = tl.trace(model, x)
    tl.facets.stamp(log)
    assert np.array_equal(log.modules["self"].facets["which"].value, model.cell.bias.value)
    tl.facets.reset()
    tl.facets.register(class_name="LoopNet", recipe_id="a")(lambda m: {"x": tl.facets.parameter_spec(m, "inp.bias")})
    tl.facets.register(class_name="LoopNet", recipe_id="b")(lambda m: {"x": tl.facets.parameter_spec(m, "cell.bias")})
    log = tl.trace(model, x)
    tl.facets.stamp(log)
    with pytest.warns(FacetWarning) as rec:
        v = log.modules["self"].facets["x"].value
    assert rec[0].message.code == "facet_recipe_collision"
    assert np.array_equal(v, model.cell.bias.value)  # the later registration wins


def test_adding_is_context_local_and_reset_restores_builtins(loop):
    model, x = loop
    extra = tl.facets.recipe(class_name="LoopNet", recipe_id="ctx")(
        lambda m: {"ctx": tl.facets.parameter_spec(m, "inp.bias", "ctx")})
    with tl.facets.adding(extra):
        inside = tl.trace(model, x)
        tl.facets.stamp(inside)
    outside = tl.trace(model, x)
    tl.facets.stamp(outside)
    assert "ctx" in inside.modules["self"].facets and "ctx" not in outside.modules["self"].facets
    log = tl.trace(model, x)
    tl.facets.stamp(log, facets=[extra])  # what tl.trace(..., facets=[extra]) does
    assert "ctx" in log.modules["self"].facets
    tl.facets.register(class_name="LoopNet", recipe_id="gone")(lambda m: {})
    assert any(r["recipe_id"] == "gone" for r in tl.facets.functions())
    assert [r["recipe_id"] for r in tl.facets.describe("LoopNet") if r["recipe_id"] == "gone"] == ["gone"]
    tl.facets.reset()
    assert not any(r["recipe_id"] == "gone" for r in tl.facets.functions())


def test_registration_and_helper_misuse_refuse(loop):
    model, x = loop
    with pytest.raises(FacetError) as exc:
        tl.facets.register(class_name="A", predicate=lambda m: True)(lambda m: {})
    assert exc.value.code == "facet_registration_invalid"
    tl.facets.register(class_name="LoopNet", recipe_id="bad")(lambda m: ["not a dict"])
    log = tl.trace(model, x)
    tl.facets.stamp(log)
    with pytest.raises(FacetError) as exc:
        log.modules["self"].facets.keys()
    assert exc.value.code == "facet_recipe_invalid"
    m = log.modules["self"]
    with pytest.raises(FacetError) as exc:
        tl.facets.config_value(m, "num_heads", "n_head")
    assert exc.value.code == "facet_config_missing"
    assert tl.facets.config_value(m, "num_heads", default=4) == 4
    assert tl.facets.config_value(m, "class_name") == "LoopNet"
    with pytest.raises(FacetError) as exc:
        tl.facets.child_output_spec(log.modules["inp"], "nope")
    assert exc.value.code == "facet_child_unknown"


def test_transformer_lens_aliases_are_off_by_default(loop):
    model, x = loop
    tl.facets.register(class_name="LoopNet", recipe_id="r")(
        lambda m: {"resid_post": tl.facets.call_output_spec(tl.facets.current_call(m))})
    log = tl.trace(model, x)
    tl.facets.stamp(log)
    f = log.modules["self"].facets
    assert not tl.facets.transformer_lens_aliases_enabled() and "hook_resid_post" not in f
    tl.facets.enable_transformer_lens_aliases()
    try:
        assert np.array_equal(f["hook_resid_post"].value, f["resid_post"].value)
    finally:
        tl.facets.enable_transformer_lens_aliases(False)
    assert "hook_resid_post" not in f


def test_forks_keep_the_capture_time_snapshot(loop):
    model, x = loop
    tl.facets.register(class_name="LoopNet", recipe_id="lam")(
        lambda m: {"lam": tl.facets.parameter_spec(m, "inp.bias", "lam")})
    log = tl.trace(model, x)
    tl.facets.stamp(log)
    assert "lam" in log.modules["self"].facets
    fork = log.fork("f")
    tl.facets.reset()  # the fork keeps its parent's capture-time snapshot
    assert "lam" in fork.modules["self"].facets
    assert "lam" not in tl.trace(model, x).modules["self"].facets  # a trace captured after reset() does not


def test_capture_stamps_the_snapshot_and_takes_facets_keyword(loop):
    """tl.trace freezes the registry at capture (no explicit stamp) and `facets=` adds recipes
    only that trace sees; a bad `facets=` refuses before the model runs."""
    model, x = loop
    extra = tl.facets.recipe(class_name="LoopNet", recipe_id="ctx2")(
        lambda m: {"ctx": tl.facets.parameter_spec(m, "inp.bias", "ctx")})
    with tl.facets.adding(extra):
        inside = tl.trace(model, x)
    assert np.array_equal(inside.modules["self"].facets["ctx"].value, model.inp.bias.value)
    own = tl.trace(model, x, facets=[extra])
    plain = tl.trace(model, x)
    tl.facets.register(class_name="LoopNet", recipe_id="late2")(lambda m: {"late": tl.facets.parameter_spec(m, "cell.bias")})
    assert "ctx" in own.modules["self"].facets and "ctx" not in plain.modules["self"].facets
    assert "late" not in plain.modules["self"].facets  # registered after capture: not seen
    with pytest.raises(FacetError) as e:
        tl.trace(model, x, facets=extra)
    assert e.value.code == "facet_registration_invalid"
