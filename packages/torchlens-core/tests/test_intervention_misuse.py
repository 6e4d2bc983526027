"""Intervention misuse on the numpy reference backend (no framework): user callables never
write into a payload another trace holds, helpers refuse bad arguments at construction and
sites they do not fit at staging (typed codes, nothing mutated), and the option objects
refuse malformed values. Expected values come from plain numpy forwards."""

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import InterventionError
from torchlens.intervention import Edit
from torchlens.options import InterventionOptions, ReplayOptions

pytestmark = pytest.mark.filterwarnings("ignore::torchlens.errors.TraceMutationWarning")


@pytest.fixture
def mlp():
    from torchlens_reference import nn

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    return model, x


def _snapshot(t):
    return {o.label: tuple(np.array(v, copy=True) for v in o.outs) for o in t.ops if o.saved}


def _same(a, b):
    return a.keys() == b.keys() and all(all(np.array_equal(x, y) for x, y in zip(a[k], b[k])) for k in a)


def _zero_in_place(v, *, ctx):
    np.multiply(v, 0, out=v)


def _expected_zeroed_relu(model, x):
    return model[2](np.zeros((3, 8), np.float32))


# fork isolation ---------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["replay", "rerun"])
def test_in_place_hook_on_a_fork_leaves_the_parent_alone(mlp, engine):
    model, x = mlp
    parent = tl.trace(model, x)
    before = _snapshot(parent)
    kw = {"model": model, "inputs": x} if engine == "rerun" else {}
    fork = parent.fork().do("relu_1_2", _zero_in_place, **kw)
    assert _same(_snapshot(parent), before)
    assert np.array_equal(fork["linear_2_3"].out, _expected_zeroed_relu(model, x))


def test_a_hand_built_edit_is_untrusted_and_edits_a_copy(mlp):
    model, x = mlp
    parent = tl.trace(model, x)
    before = _snapshot(parent)
    mine = Edit("mine", (), lambda v, ctx: np.multiply(v, 0, out=v))  # claims "builtin", runs user code
    assert not mine.trusted and tl.scale(2.0).trusted and not tl.intervention.hook(abs).trusted
    assert not tl.positions(tl.intervention.hook(_zero_in_place), [0]).trusted
    fork = parent.fork().do("relu_1_2", mine)
    assert _same(_snapshot(parent), before)
    assert np.array_equal(fork["linear_2_3"].out, _expected_zeroed_relu(model, x))


def test_in_place_hook_at_capture_time_and_bound_leaves_inputs_alone(mlp):
    model, x = mlp
    x_before = x.copy()
    earlier = tl.trace(model, x)
    before = _snapshot(earlier)
    live = tl.trace(model, x, intervene=tl.when("relu_1_2", _zero_in_place))
    bound = tl.when(tl.module("1"), _zero_in_place).bind(model)(x)
    assert np.array_equal(x, x_before) and _same(_snapshot(earlier), before)
    for got in (live["linear_2_3"].out, bound):
        assert np.array_equal(got, _expected_zeroed_relu(model, x))


# helper arguments -------------------------------------------------------------------------

NAN = float("nan")

BAD = {
    "scale('2.0')": (lambda: tl.scale("2.0"), "edit_argument_invalid"),
    "scale(nan)": (lambda: tl.scale(NAN), "edit_argument_invalid"),
    "scale(True)": (lambda: tl.scale(True), "edit_argument_invalid"),
    "scale(None)": (lambda: tl.scale(None), "edit_argument_invalid"),
    "add(nan)": (lambda: tl.add(NAN), "edit_argument_invalid"),
    "add(inf array)": (lambda: tl.add(np.array([1.0, np.inf])), "edit_argument_invalid"),
    "add(object array)": (lambda: tl.add(np.array(["a"])), "edit_argument_invalid"),
    "clamp()": (lambda: tl.clamp(), "intervention_edit_invalid"),
    "clamp(max<min)": (lambda: tl.clamp(min=2, max=1), "edit_argument_invalid"),
    "clamp(max='1')": (lambda: tl.clamp(max="1"), "edit_argument_invalid"),
    "add_noise(nan)": (lambda: tl.add_noise(NAN), "edit_argument_invalid"),
    "add_noise(seed=-1)": (lambda: tl.add_noise(1.0, seed=-1), "edit_argument_invalid"),
    "add_noise(seed=1.5)": (lambda: tl.add_noise(1.0, seed=1.5), "edit_argument_invalid"),
    "replace_with(None)": (lambda: tl.replace_with(None), "edit_argument_invalid"),
    "replace_with(nan array)": (lambda: tl.replace_with(np.full(3, np.nan)), "edit_argument_invalid"),
    "steer(str)": (lambda: tl.steer("up"), "steer_direction_invalid"),
    "steer(nan)": (lambda: tl.steer(np.array([NAN, 1.0])), "steer_direction_invalid"),
    "steer(strength nan)": (lambda: tl.steer(np.ones(8), NAN), "edit_argument_invalid"),
    "steer(2d, dim)": (lambda: tl.steer(np.ones((2, 8)), dim=0), "steer_direction_invalid"),
    "steer(dim True)": (lambda: tl.steer(np.ones(8), dim=True), "edit_argument_invalid"),
    "project_out(zeros)": (lambda: tl.project_out(np.zeros(8)), "steer_direction_invalid"),
    "project_onto(scalar)": (lambda: tl.project_onto(np.float32(1.0)), "steer_direction_invalid"),
    "clip_norm(nan)": (lambda: tl.clip_norm(NAN), "edit_argument_invalid"),
    "clip_norm(norm_type -1)": (lambda: tl.clip_norm(1.0, -1.0), "edit_argument_invalid"),
    "mean_ablate(dim 1.0)": (lambda: tl.mean_ablate(dim=1.0), "intervention_over_invalid"),
    "mean_ablate(dim position)": (lambda: tl.mean_ablate(dim="position"), "axis_semantics_unknown"),
    "mean_ablate(dim members)": (lambda: tl.mean_ablate(dim="members"), "intervention_over_invalid"),
    "mean_ablate(source nan)": (lambda: tl.mean_ablate(np.array([NAN]), dim=0), "edit_argument_invalid"),
    "scramble(seed str)": (lambda: tl.intervention.scramble_elements("1"), "edit_argument_invalid"),
    "splice_module(in)": (lambda: tl.intervention.splice_module(abs, input_route="in"), "edit_argument_invalid"),
    "positions(slice step 0)": (lambda: tl.positions(tl.zero_ablate(), slice(0, 2, 0)), "position_edit_invalid"),
    "positions(float)": (lambda: tl.positions(tl.zero_ablate(), 1.5), "position_edit_invalid"),
    "positions([])": (lambda: tl.positions(tl.zero_ablate(), []), "position_edit_invalid"),
    "positions(mask)": (lambda: tl.positions(tl.zero_ablate(), [0], mask=np.ones(3, bool)), "position_edit_invalid"),
    "keep_grad(None)": (lambda: tl.intervention.keep_grad(None), "keep_grad_edit_invalid"),
    "patch_from(array)": (lambda: tl.patch_from(np.ones(3)), "patch_source_invalid"),
    "subspace(str basis)": (lambda: tl.subspace("s", [["a", "b"]]), "subspace_basis_invalid"),
    "subspace(inf basis)": (lambda: tl.subspace("s", np.array([[np.inf, 0.0]])), "subspace_basis_invalid"),
    "subspace(atol -1)": (lambda: tl.subspace("s", np.eye(2), atol=-1.0), "edit_argument_invalid"),
    "units(float mask)": (lambda: tl.units("s", np.ones(3)), "edit_argument_invalid"),
    "affine(bias wrong shape)": (lambda: tl.intervention.set_affine_coordinates(np.ones((1, 8)), bias=np.ones(2)),
                                 "affine_source_invalid"),
    "subspace_interchange(array)": (lambda: tl.intervention.subspace_interchange(np.eye(2), np.ones(3)),
                                    "patch_source_invalid"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_helper_refuses_a_bad_argument_at_construction(name):
    make, code = BAD[name]
    with pytest.raises(InterventionError) as ei:
        make()
    assert ei.value.code == code and ei.value.remedy, ei.value


STAGED = {
    "steer(len 5, dim=1)": (lambda: tl.steer(np.ones(5, np.float32), dim=1), "steer_direction_invalid"),
    "steer(dim=2)": (lambda: tl.steer(np.ones(8, np.float32), dim=2), "steer_direction_invalid"),
    "project_onto(len 5)": (lambda: tl.project_onto(np.ones(5, np.float32)), "axis_ambiguous"),
    "mean_ablate(dim=7)": (lambda: tl.mean_ablate(dim=7), "intervention_over_invalid"),
    "mean_ablate(dim=(0,-3))": (lambda: tl.mean_ablate(dim=(0, -3)), "intervention_over_invalid"),
    "add((3,5))": (lambda: tl.add(np.ones((3, 5), np.float32)), "edit_argument_shape_mismatch"),
    "replace_with((8,))": (lambda: tl.replace_with(np.ones(8, np.float32)), "intervention_shape_changed"),
    "positions([8])": (lambda: tl.positions(tl.zero_ablate(), [8]), "position_edit_out_of_range"),
    "positions(axis=2)": (lambda: tl.positions(tl.zero_ablate(), [0], axis=2), "position_edit_invalid"),
    "units(mask (3,5))": (lambda: (tl.units("relu_1_2", np.ones((3, 5), bool)), tl.zero_ablate()),
                          "edit_argument_shape_mismatch"),
    "subspace(width 5)": (lambda: (tl.subspace("relu_1_2", np.eye(5)[:1]), tl.scale(0.0)), "subspace_basis_dim_mismatch"),
}


@pytest.mark.parametrize("engine", ["replay", "rerun", "set_only"])
@pytest.mark.parametrize("name", sorted(STAGED))
def test_helper_refuses_a_site_it_does_not_fit_with_nothing_changed(mlp, name, engine):
    model, x = mlp
    fork = tl.trace(model, x).fork()
    before = _snapshot(fork)
    made, code = STAGED[name]
    made = made()
    site, edit = made if isinstance(made, tuple) else ("relu_1_2", made)
    kw = {"model": model, "inputs": x} if engine == "rerun" else {}
    if engine == "set_only":
        kw["intervention"] = InterventionOptions(engine="set_only")
    with pytest.raises(InterventionError) as ei:
        fork.do(site, edit, **kw)
    assert ei.value.code == code, ei.value
    assert _same(_snapshot(fork), before) and len(fork.recipe) == 0 and fork.is_pristine


def test_positions_past_the_sequence_no_longer_wrap_around(mlp):
    """positions=[-9] on 8 features used to edit position -9 % 8 = 7 silently."""
    model, x = mlp
    t = tl.trace(model, x)
    ok = t.fork().do("relu_1_2", tl.positions(tl.zero_ablate(), [-1]))
    want = np.array(t["relu_1_2"].out, copy=True)
    want[:, -1] = 0
    assert np.array_equal(ok["relu_1_2"].out, want)
    with pytest.raises(InterventionError) as ei:
        t.fork().do("relu_1_2", tl.positions(tl.zero_ablate(), [-9]))
    assert ei.value.code == "position_edit_out_of_range"


def test_numpy_scalars_and_infinite_norm_type_still_work(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    h = t["relu_1_2"].out
    assert np.allclose(t.fork().do("relu_1_2", tl.scale(np.float32(2.0)))["relu_1_2"].out, h * 2)
    got = t.fork().do("relu_1_2", tl.clip_norm(0.5, float("inf")))["relu_1_2"].out
    assert np.allclose(got, h * min(1.0, 0.5 / (np.abs(h).max() + 1e-12)), atol=1e-6)


# options ----------------------------------------------------------------------------------

def test_option_objects_refuse_malformed_values(mlp):
    model, x = mlp
    for make in (lambda: InterventionOptions(allow_changed_params="yes"), lambda: ReplayOptions(allow_changed_params=1),
                 lambda: InterventionOptions(differentiable=None)):
        with pytest.raises(InterventionError) as ei:
            make()
        assert ei.value.code == "intervention_option_invalid"
    with pytest.raises(InterventionError) as ei:
        tl.trace(model, x).fork().do("relu_1_2", tl.scale(2.0), intervention={"engine": "replay"})
    assert ei.value.code == "intervention_option_invalid"
    assert not hasattr(ReplayOptions(), "differentiable")
    assert ReplayOptions(allow_changed_params=True).as_intervention_options() == InterventionOptions(
        engine="replay", allow_changed_params=True)


def test_replay_options_run_the_replay_engine(mlp):
    model, x = mlp
    t = tl.trace(model, x).fork().do("relu_1_2", tl.scale(0.0), intervention=ReplayOptions())
    assert t.last_run["engine"] == "replay" and t.last_run["replayed_with_changed_params"] == []
    assert np.array_equal(t["linear_2_3"].out, _expected_zeroed_relu(model, x))
