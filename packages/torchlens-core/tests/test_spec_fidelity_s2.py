"""Spec fidelity (issue 13 leftovers, helper S2) on the reference backend: the Population
source of mean_ablate (glossary l. 774-779, interventions.md l. 92) and the partial-axis
refusal of a units-restricted subspace (interventions.md l. 98). Each value is checked
against an independent numpy computation; each refusal against its spec code."""

import warnings

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import InterventionError, OpaqueCallableError


@pytest.fixture
def mlp():
    from torchlens_reference import nn

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    return model, x


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def members():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((3, 8)).astype(np.float32) for _ in range(4)]


def _code(fn):
    with pytest.raises(InterventionError) as ei:
        fn()
    assert ei.value.remedy
    return ei.value.code


# Population + mean_ablate(dim="members") (glossary l. 774, 778-779) ---------------------------------
def test_population_members_mean_fills_the_site_with_the_member_shaped_mean(mlp, members):
    model, x = mlp
    t = tl.trace(model, x)
    pop = tl.intervention.Population(members)
    f = t.fork().do("linear_1_1", tl.mean_ablate(pop, dim="members"))
    want = np.stack(members).astype(np.float64).mean(axis=0)  # independent: numpy over a stacked member axis
    assert np.allclose(f["linear_1_1"].out, want, atol=1e-6)
    # downstream replay saw the filled value: relu of the mean
    assert np.allclose(f["relu_1_2"].out, np.maximum(want, 0.0), atol=1e-6)
    assert not np.allclose(t["linear_1_1"].out, want)  # the source trace is untouched


def test_population_dim_none_and_axes_reduce_the_member_mean(mlp, members):
    model, x = mlp
    t = tl.trace(model, x)
    pop = tl.intervention.Population(members)
    stacked = np.stack(members).astype(np.float64)
    out = t.fork().do("linear_1_1", tl.mean_ablate(pop, dim=None))["linear_1_1"].out
    assert np.allclose(out, np.full((3, 8), stacked.mean()), atol=1e-6)
    out = t.fork().do("linear_1_1", tl.mean_ablate(pop, dim=0))["linear_1_1"].out
    assert np.allclose(out, np.broadcast_to(stacked.mean(axis=(0, 1))[None, :], (3, 8)), atol=1e-6)
    out = t.fork().do("linear_1_1", tl.mean_ablate(pop, dim=(-1,)))["linear_1_1"].out
    assert np.allclose(out, np.broadcast_to(stacked.mean(axis=(0, 2))[:, None], (3, 8)), atol=1e-6)


def test_population_of_ops_reads_each_member_op_value(mlp):
    model, x = mlp
    t1 = tl.trace(model, x)
    t2 = tl.trace(model, x * 2.0)
    pop = tl.intervention.Population([t1["linear_1_1"], t2["linear_1_1"]])
    out = t1.fork().do("linear_1_1", tl.mean_ablate(pop, dim="members"))["linear_1_1"].out
    want = (np.asarray(t1["linear_1_1"].out, np.float64) + np.asarray(t2["linear_1_1"].out, np.float64)) / 2
    assert np.allclose(out, want, atol=1e-6)


def test_members_dim_refuses_any_source_but_a_population(mlp, members):
    assert _code(lambda: tl.mean_ablate(members[0], dim="members")) == "intervention_over_invalid"
    assert _code(lambda: tl.mean_ablate(dim="members")) == "intervention_over_invalid"
    assert _code(lambda: tl.mean_ablate(tl.intervention.Population(members), dim="rows")) == "intervention_over_invalid"
    assert _code(lambda: tl.mean_ablate(tl.intervention.Population(members), dim="batch")) == "axis_semantics_unknown"
    # an axis of the member shape that does not exist refuses at staging, nothing mutated
    model, x = mlp
    t = tl.trace(model, x)
    before = np.array(t["linear_1_1"].out)
    assert _code(lambda: t.do("linear_1_1", tl.mean_ablate(tl.intervention.Population(members), dim=2))) == \
        "intervention_over_invalid"
    assert np.array_equal(t["linear_1_1"].out, before) and not t.intervention_audit


def test_population_refuses_bad_members(members):
    assert _code(lambda: tl.intervention.Population([])) == "intervention_edit_invalid"
    assert _code(lambda: tl.intervention.Population(members[0])) == "intervention_edit_invalid"
    assert _code(lambda: tl.intervention.Population([members[0], members[1][:2]])) == "edit_argument_shape_mismatch"
    bad = members[0].copy()
    bad[0, 0] = np.nan
    assert _code(lambda: tl.intervention.Population([members[1], bad])) == "edit_argument_invalid"
    # a member-shaped mean that does not broadcast into the site refuses at staging
    assert _code(lambda: tl.mean_ablate(tl.intervention.Population([np.ones((2, 5))]), dim="members").check_site((3, 8))) \
        == "edit_argument_shape_mismatch"


def test_population_spec_is_opaque_audit_and_its_fire_record_says_not_stochastic(mlp, members, tmp_path):
    model, x = mlp
    t = tl.trace(model, x)
    edit = tl.mean_ablate(tl.intervention.Population(members), dim="members")
    assert edit.portability == "opaque_audit" and edit.signal == "forward"
    assert tl.mean_ablate(members[0], dim=0).portability == "builtin"  # a plain tensor source stays builtin
    f = t.fork().do("linear_1_1", edit)
    assert f.intervention_audit[-1]["stochastic"] is False
    assert "stochastic" not in t.fork().do("linear_1_1", tl.zero_ablate()).intervention_audit[-1]
    with pytest.raises(OpaqueCallableError):
        tl.io.save_intervention(f, tmp_path / "p.tlspec", level="portable")
    tl.io.save_intervention(f, tmp_path / "a.tlspec", level="audit")  # audit level keeps a placeholder


def test_population_member_changed_after_staging_refuses(mlp, members, tmp_path):
    model, x = mlp
    t = tl.trace(model, x)
    f = t.fork().do("linear_1_1", tl.mean_ablate(tl.intervention.Population(members), dim="members"))
    members[2][0, 0] += 1.0
    with pytest.raises(InterventionError) as ei:
        tl.io.save_intervention(f, tmp_path / "a.tlspec", level="audit")
    assert ei.value.code == "helper_tensor_changed_since_capture"


def test_population_identity_follows_member_content(members):
    a = tl.mean_ablate(tl.intervention.Population(members), dim="members").identity()
    b = tl.mean_ablate(tl.intervention.Population(members[:3] + [members[3] + 1]), dim="members").identity()
    assert a != b and "Population n=4" in a


def test_population_mean_is_a_value_verb_under_a_subspace(mlp, members):
    model, x = mlp
    t = tl.trace(model, x)
    basis = np.eye(8)[:2]
    f = t.fork().do(tl.subspace("linear_1_1", basis, origin="e01"),
                    tl.mean_ablate(tl.intervention.Population(members), dim="members"))
    xv = np.asarray(t["linear_1_1"].out, np.float64)
    v = np.stack(members).astype(np.float64).mean(axis=0)
    want = xv + (v - xv) @ basis.T @ basis  # its component along the span becomes the mean's
    assert np.allclose(f["linear_1_1"].out, want, atol=1e-6)
    assert f.intervention_audit[-1]["stochastic"] is False


# subspace_projection_partial_axis (interventions.md l. 98) -----------------------------------------
SPARSE = np.array([[0.6, 0.8, 0, 0, 0, 0, 0, 0]])  # support: features 0 and 1


def test_units_mask_covering_part_of_the_support_at_a_position_refuses(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    mask = np.zeros((3, 8), dtype=bool)
    mask[1, 0] = True  # feature 0 of the support at row 1, but not feature 1
    with pytest.raises(InterventionError) as ei:
        tl.subspace(tl.units("linear_1_1", mask), SPARSE, origin="sparse")
    assert ei.value.code == "subspace_projection_partial_axis" and ei.value.fields["position"] == (1,)
    # built directly (no tl.subspace), staging refuses the same way before anything changes
    from torchlens.intervention.subspace import SubspaceSite

    before = np.array(t["linear_1_1"].out)
    with pytest.raises(InterventionError) as ei:
        t.do(SubspaceSite(tl.units("linear_1_1", mask), SPARSE, "sparse"), tl.zero_ablate())
    assert ei.value.code == "subspace_projection_partial_axis"
    assert np.array_equal(t["linear_1_1"].out, before) and not t.intervention_audit


def test_units_mask_on_whole_positions_edits_those_positions_only(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    mask = np.zeros((3, 8), dtype=bool)
    mask[2, :] = True  # every feature of row 2
    mask[0, 5] = True  # outside the support at row 0: no projection meaning lost, allowed
    f = t.fork().do(tl.subspace(tl.units("linear_1_1", mask), SPARSE, origin="sparse"), tl.zero_ablate())
    xv = np.asarray(t["linear_1_1"].out, np.float64)
    q = SPARSE / np.linalg.norm(SPARSE)
    projected = xv - (xv @ q.T) @ q
    want = np.where(mask, projected, xv)
    assert np.allclose(f["linear_1_1"].out, want, atol=1e-6)
    assert np.allclose(f["linear_1_1"].out[:2], xv[:2], atol=1e-6)  # rows 0 and 1 unchanged
    # a width-1 mask on the feature axis picks whole positions by broadcasting
    col = np.array([[False], [True], [False]])
    f = t.fork().do(tl.subspace(tl.units("linear_1_1", col), SPARSE, origin="sparse"), tl.zero_ablate())
    assert np.allclose(f["linear_1_1"].out, np.where(col, projected, xv), atol=1e-6)


def test_a_saved_population_edit_loads_as_a_placeholder_that_refuses_to_rerun(mlp, members, tmp_path):
    """opaque_audit: Trace.save keeps the edit as an audit placeholder (with its stochastic=False
    audit row); a rerun of the loaded trace refuses rather than run without the edit."""
    model, x = mlp
    f = tl.trace(model, x).fork().do("linear_1_1", tl.mean_ablate(tl.intervention.Population(members), dim="members"))
    f.save(tmp_path / "t.tlspec")
    loaded = tl.load(tmp_path / "t.tlspec")
    assert loaded.intervention_audit[-1]["stochastic"] is False
    assert np.allclose(loaded["linear_1_1"].out, np.stack(members).mean(axis=0), atol=1e-6)  # the edited values
    assert loaded.recipe.rules[0].edit.portability == "placeholder"
    with pytest.raises(InterventionError) as ei:
        loaded.fork().run(model, x)
    assert ei.value.code == "run_intervention_spec_not_persisted"


# tl.grad refusals (glossary l. 734) -----------------------------------------------------------------
def test_grad_over_a_facet_or_head_selector_refuses_at_construction():
    from torchlens.errors import SelectorCompositionError

    for site in (tl.head(0), tl.facet("q"), tl.head(1, "k").in_module("blocks.0.attn"), tl.head(0) | tl.facet("k")):
        with pytest.raises(SelectorCompositionError) as ei:
            tl.grad(site)
        assert ei.value.code == "grad_facet_unsupported" and ei.value.remedy, site
    # a facet selector mixed with an op selector refuses earlier, when the two are combined
    for combine in (lambda: tl.head(0) | tl.func("relu"), lambda: tl.func("relu") | tl.head(0),
                    lambda: tl.head(0) | tl.label("a")):
        with pytest.raises(SelectorCompositionError) as ei:
            tl.grad(combine())
        assert ei.value.code == "facet_selector_unsupported" and ei.value.remedy
    assert tl.grad(tl.func("relu") | tl.label("a")).universe == "gradient"  # no facet: still fine


# scramble_elements(seed=..., source=...) (glossary l. 766, interventions.md l. 91) --------------------
def test_scramble_elements_from_a_source_draws_iid_from_its_flattened_elements(mlp, tmp_path):
    model, x = mlp
    t = tl.trace(model, x)
    src = np.arange(5, dtype=np.float32) * 10.0
    edit = tl.intervention.scramble_elements(seed=3, source=src)
    assert edit.signal is None and edit.portability == "builtin"  # neutral, portable
    f = t.fork().do("linear_1_1", edit)
    idx = np.random.default_rng(3).integers(0, 5, 24)  # independent: the documented draw
    assert np.array_equal(f["linear_1_1"].out, src[idx].reshape(3, 8))
    # the portable spec saves the source and reloads the same edit
    f.save(tmp_path / "t.tlspec")
    loaded = tl.load(tmp_path / "t.tlspec")
    again = t.fork().do(loaded.recipe)["linear_1_1"].out
    assert np.array_equal(again, f["linear_1_1"].out)
    # without source= it stays the permutation of the site's own elements, identity unchanged
    own = tl.intervention.scramble_elements(seed=3)
    assert own.identity() == "scramble_elements(seed=3)"
    out = t.fork().do("linear_1_1", own)["linear_1_1"].out
    assert np.array_equal(np.sort(out.ravel()), np.sort(np.asarray(t["linear_1_1"].out).ravel()))


def test_scramble_elements_source_refusals(mlp):
    assert _code(lambda: tl.intervention.scramble_elements(seed=0, source=np.zeros((0,)))) == "edit_argument_invalid"
    assert _code(lambda: tl.intervention.scramble_elements(seed=0, source=np.array([1.0, np.inf]))) == \
        "edit_argument_invalid"
    assert _code(lambda: tl.intervention.scramble_elements(seed=0, source="abc")) == "edit_argument_invalid"
    model, x = mlp
    t = tl.trace(model, x)
    # a coordinate verb only without source=: under tl.subspace the source form refuses, naming what works
    with pytest.raises(InterventionError) as ei:
        t.do(tl.subspace("linear_1_1", np.eye(8)[:2], origin="e01"),
             tl.intervention.scramble_elements(seed=0, source=np.ones(4, np.float32)))
    assert ei.value.code == "subspace_edit_unsupported" and "without source=" in ei.value.remedy
    assert not t.intervention_audit
