"""Intervention misuse on the torch backend: forks never share writable storage with their
parent through a user callable (every engine), replay refuses parameters that changed since
capture (`replay_param_changed_since_capture`) unless `allow_changed_params=True`, validation
names the changed parameter, and every edit helper refuses bad arguments with a typed code
before anything is mutated. Expected values come from plain forwards with forward hooks."""

import pickle

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import AmbiguousAxisError, InterventionError, ReplayPreconditionError
from torchlens.options import InterventionOptions, ReplayOptions

pytestmark = pytest.mark.filterwarnings("ignore::torchlens.errors.TraceMutationWarning")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval(), torch.randn(3, 4)


class Aliasing(nn.Module):
    """`view_1_1` is a view of the caller's input: writing into it writes into `x`."""

    def __init__(self) -> None:
        super().__init__()
        self.ident = nn.Identity()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(self.ident(x.view(3, 4)))


def _bytes(trace):
    """Every saved payload and parameter value of a trace, copied."""
    pay = {o.label: tuple(v.detach().clone() if isinstance(v, torch.Tensor) else v for v in o.outs)
           for o in trace.ops if o.saved}
    par = {a: p.value.detach().clone() for a, p in trace._params.items()}
    return pay, par


def _same(a, b):
    (pa, qa), (pb, qb) = a, b
    return (pa.keys() == pb.keys() and qa.keys() == qb.keys()
            and all(all(torch.equal(x, y) for x, y in zip(pa[k], pb[k])) for k in pa)
            and all(torch.equal(qa[k], qb[k]) for k in qa))


def _zero_in_place(v, *, ctx):
    v.mul_(0)


def _with_hook(module, fn, call):
    h = module.register_forward_hook(lambda m, i, o: fn(o))
    try:
        with torch.no_grad():
            return call()
    finally:
        h.remove()


# fork isolation ---------------------------------------------------------------------------

def test_in_place_hook_on_a_replay_fork_leaves_the_parent_alone():
    model, x = _mlp()
    parent = tl.trace(model, x)
    before = _bytes(parent)
    fork = parent.fork()
    fork.do("relu_1_2", _zero_in_place)
    assert _same(_bytes(parent), before)
    expected = _with_hook(model[1], lambda o: o * 0, lambda: model(x))
    assert torch.equal(fork["linear_2_3"].out, expected)


@pytest.mark.parametrize("save_mode", ["copy", "reference"])
def test_in_place_hook_on_a_rerun_fork_leaves_parent_input_and_model_alone(save_mode):
    torch.manual_seed(0)
    model, x = Aliasing().eval(), torch.randn(12)
    x_before = x.clone()
    parent = tl.trace(model, x, capture=tl.CaptureOptions(save_mode=save_mode))
    before = _bytes(parent)
    fork = parent.fork()
    fork.do("view_1_1", _zero_in_place, model=model, inputs=x)
    assert torch.equal(x, x_before)
    assert _same(_bytes(parent), before)
    expected = _with_hook(model.ident, lambda o: o * 0, lambda: model(x))
    assert torch.equal(fork["linear_1_2"].out, expected)


def test_in_place_hook_at_capture_time_leaves_the_callers_input_alone():
    torch.manual_seed(0)
    model, x = Aliasing().eval(), torch.randn(12)
    x_before = x.clone()
    earlier = tl.trace(model, x)
    before = _bytes(earlier)
    live = tl.trace(model, x, intervene=tl.when("view_1_1", _zero_in_place))
    assert torch.equal(x, x_before) and _same(_bytes(earlier), before)
    expected = _with_hook(model.ident, lambda o: o * 0, lambda: model(x))
    assert torch.equal(live["linear_1_2"].out, expected)


@pytest.mark.parametrize("site", [tl.module("ident"), "view_1_1"])
def test_in_place_hook_in_a_bound_executor_leaves_the_callers_input_alone(site):
    torch.manual_seed(0)
    model, x = Aliasing().eval(), torch.randn(12)
    x_before = x.clone()
    with torch.no_grad():
        out = tl.when(site, _zero_in_place).bind(model)(x)
    assert torch.equal(x, x_before)
    assert torch.equal(out, _with_hook(model.ident, lambda o: o * 0, lambda: model(x)))


def test_in_place_splice_module_does_not_write_into_the_parent():
    model, x = _mlp()
    parent = tl.trace(model, x)
    before = _bytes(parent)
    fork = parent.fork().do("linear_1_1", tl.intervention.splice_module(nn.ReLU(inplace=True)))
    assert _same(_bytes(parent), before)
    assert torch.equal(fork["relu_1_2"].out, torch.relu(before[0]["linear_1_1"][0]))


# changed parameters -------------------------------------------------------------------------

def _step(model, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(x).sum().backward()
    opt.step()


def _load_state_dict(model, x):
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model.load_state_dict(other.state_dict())


def _no_grad_in_place(model, x):
    with torch.no_grad():
        model[2].weight.mul_(2)


def _data_rebind(model, x):
    model[2].weight.data = model[2].weight.data * 2


@pytest.mark.parametrize("change", [_step, _load_state_dict, _no_grad_in_place, _data_rebind])
def test_replay_refuses_a_parameter_changed_since_capture(change):
    model, x = _mlp()
    trace = tl.trace(model, x)
    fork = trace.fork()
    before = _bytes(fork)
    change(model, x)
    with pytest.raises(ReplayPreconditionError) as ei:
        fork.do("relu_1_2", tl.scale(2.0))
    e = ei.value
    assert e.code == "replay_param_changed_since_capture" and isinstance(e, InterventionError)
    assert e.fields["param"] in ("2.weight", "2.bias") and e.fields["op"] == "linear_2_3" and e.remedy
    after = _bytes(fork)
    assert _same((after[0], {}), (before[0], {}))  # payloads untouched (the weights changed on purpose)
    assert len(fork.recipe) == 0 and fork.last_run is None


@pytest.mark.parametrize("how", ["mapping", "selection", "differentiable", "replay_options"])
def test_every_replay_path_checks_parameters(how):
    model, x = _mlp()
    trace = tl.trace(model, x)
    _no_grad_in_place(model, x)
    fork = trace.fork()
    with pytest.raises(ReplayPreconditionError, match="2.weight"):
        if how == "mapping":
            fork.do({"linear_1_1": tl.scale(1.0), "relu_1_2": tl.scale(2.0)})
        elif how == "selection":
            fork.do(tl.func("relu"), tl.scale(2.0))
        elif how == "differentiable":
            fork.do("relu_1_2", tl.scale(2.0), intervention=InterventionOptions(differentiable=True))
        else:
            fork.do("relu_1_2", tl.scale(2.0), intervention=ReplayOptions())


def test_a_parameter_outside_the_cone_does_not_block_replay():
    model, x = _mlp()
    trace = tl.trace(model, x)
    _step_first = model[0].weight
    with torch.no_grad():
        _step_first.mul_(3)  # upstream of the edit: the replay never reads it
    fork = trace.fork().do("relu_1_2", tl.scale(2.0))
    assert fork.last_run["replayed_with_changed_params"] == []
    with torch.no_grad():
        expected = model[2](trace["relu_1_2"].out * 2)
    assert torch.equal(fork["linear_2_3"].out, expected)


@pytest.mark.parametrize("opts", [InterventionOptions, ReplayOptions])
def test_allow_changed_params_replays_with_the_new_values_and_says_so(opts):
    model, x = _mlp()
    trace = tl.trace(model, x)
    _step(model, x)
    fork = trace.fork().do("relu_1_2", tl.scale(2.0), intervention=opts(allow_changed_params=True))
    assert fork.last_run["replayed_with_changed_params"] == ["2.bias", "2.weight"]
    with torch.no_grad():
        expected = model[2](trace["relu_1_2"].out * 2)  # the new head on the recorded ReLU output
    assert torch.equal(fork["linear_2_3"].out, expected)


def test_a_replaced_parameter_object_is_not_used_by_replay():
    model, x = _mlp()
    trace = tl.trace(model, x)
    old_w, old_b = model[2].weight.detach().clone(), model[2].bias.detach().clone()
    model[2].weight = nn.Parameter(torch.zeros(2, 8))  # the template keeps the captured object
    fork = trace.fork().do("relu_1_2", tl.scale(2.0))
    expected = torch.nn.functional.linear(trace["relu_1_2"].out * 2, old_w, old_b)
    assert torch.equal(fork["linear_2_3"].out, expected)


def test_a_rerun_fork_checks_against_the_weights_its_rerun_ran_with():
    model, x = _mlp()
    trace = tl.trace(model, x)
    _step(model, x)
    fork = trace.fork().do("relu_1_2", tl.scale(1.0), model=model, inputs=x)  # rerun: the new weights
    fork.do("relu_1_2", tl.scale(2.0))  # replay on the rerun's own capture: nothing changed since
    _no_grad_in_place(model, x)
    with pytest.raises(ReplayPreconditionError):
        fork.do("relu_1_2", tl.scale(3.0))


def test_pickled_trace_does_not_report_a_false_change():
    model, x = _mlp()
    with torch.no_grad():
        trace = tl.trace(model, x)
    try:
        copy = pickle.loads(pickle.dumps(trace))
    except Exception as exc:  # pragma: no cover - a trace that cannot pickle has nothing to check
        pytest.skip(f"trace does not pickle here: {exc}")
    fork = copy.fork().do("relu_1_2", tl.scale(2.0))  # an unpickled trace re-stamps its own tensors: no refusal
    assert torch.equal(fork.ops["relu_1_2"].out, 2.0 * trace.ops["relu_1_2"].out)
    assert fork.last_run["replayed_with_changed_params"] == []


def test_validation_names_the_changed_parameter():
    model, x = _mlp()
    trace = tl.trace(model, x)
    assert trace.validate_forward_pass()
    _step(model, x)
    assert not trace.validate_forward_pass()
    status = trace.validation_replay_status
    assert status.reason == "replay_param_changed_since_capture" and status.reason in tl.backends.VALIDATION_REASONS
    assert status.first_failure == "linear_1_1" and "0.weight" in status.detail
    first = next(d for d in status.decisions if d["ok"] is False)  # validation checks every op; the first failure
    assert first["op"] == "linear_1_1" and first["param"] in ("0.weight", "0.bias")


# helper arguments ---------------------------------------------------------------------------

BAD_HELPERS = {
    "scale(str)": (lambda: tl.scale("2.0"), "edit_argument_invalid"),
    "scale(nan)": (lambda: tl.scale(float("nan")), "edit_argument_invalid"),
    "scale(inf)": (lambda: tl.scale(float("inf")), "edit_argument_invalid"),
    "scale(tensor nan)": (lambda: tl.scale(torch.tensor(float("nan"))), "edit_argument_invalid"),
    "add(nan tensor)": (lambda: tl.add(torch.tensor([1.0, float("nan")])), "edit_argument_invalid"),
    "add(str)": (lambda: tl.add("1"), "edit_argument_invalid"),
    "clamp(min>max)": (lambda: tl.clamp(min=1.0, max=0.0), "edit_argument_invalid"),
    "clamp(nan)": (lambda: tl.clamp(min=float("nan")), "edit_argument_invalid"),
    "add_noise(std<0)": (lambda: tl.add_noise(-1.0), "edit_argument_invalid"),
    "add_noise(seed str)": (lambda: tl.add_noise(1.0, seed="0"), "edit_argument_invalid"),
    "replace_with(str)": (lambda: tl.replace_with("x"), "edit_argument_invalid"),
    "replace_with(nan)": (lambda: tl.replace_with(float("nan")), "edit_argument_invalid"),
    "steer(nan)": (lambda: tl.steer(torch.tensor([1.0, float("nan")])), "steer_direction_invalid"),
    "steer(empty)": (lambda: tl.steer(torch.zeros(0)), "steer_direction_invalid"),
    "steer(strength str)": (lambda: tl.steer(torch.ones(8), "2"), "edit_argument_invalid"),
    "steer(dim float)": (lambda: tl.steer(torch.ones(8), dim=1.0), "edit_argument_invalid"),
    "project_out(zeros)": (lambda: tl.project_out(torch.zeros(8)), "steer_direction_invalid"),
    "project_onto(2d)": (lambda: tl.project_onto(torch.ones(2, 8)), "steer_direction_invalid"),
    "project_onto(inf)": (lambda: tl.project_onto(torch.tensor([float("inf"), 1.0])), "steer_direction_invalid"),
    "clip_norm(-1)": (lambda: tl.clip_norm(-1.0), "edit_argument_invalid"),
    "clip_norm(norm_type 0)": (lambda: tl.clip_norm(1.0, 0.0), "edit_argument_invalid"),
    "mean_ablate(dim str)": (lambda: tl.mean_ablate(dim="x"), "intervention_over_invalid"),
    "mean_ablate(dim batch)": (lambda: tl.mean_ablate(dim="batch"), "axis_semantics_unknown"),
    "mean_ablate(dim dup)": (lambda: tl.mean_ablate(dim=(0, 0)), "intervention_over_invalid"),
    "mean_ablate(source str)": (lambda: tl.mean_ablate("x", dim=0), "edit_argument_invalid"),
    "scramble(seed -1)": (lambda: tl.intervention.scramble_elements(-1), "edit_argument_invalid"),
    "zero_ablate(allow str)": (lambda: tl.zero_ablate(allow_shape_change="yes"), "edit_argument_invalid"),
    "positions(str)": (lambda: tl.positions(tl.zero_ablate(), "middle"), "position_edit_invalid"),
    "positions(last, no mask)": (lambda: tl.positions(tl.zero_ablate(), "last"), "transform_mask_missing"),
    "positions(bool)": (lambda: tl.positions(tl.zero_ablate(), [True]), "position_edit_invalid"),
    "keep_grad(5)": (lambda: tl.intervention.keep_grad(5), "keep_grad_edit_invalid"),
    "patch_from(tensor)": (lambda: tl.patch_from(torch.ones(3)), "patch_source_invalid"),
    "subspace(nan basis)": (lambda: tl.subspace("relu_1_2", torch.tensor([[float("nan"), 1.0]])),
                            "subspace_basis_invalid"),
    "affine bias nan": (lambda: tl.intervention.set_affine_coordinates(torch.ones(1, 8), bias=torch.tensor([float("nan")])),
                        "affine_source_invalid"),
}


@pytest.mark.parametrize("name", sorted(BAD_HELPERS))
def test_helper_refuses_bad_arguments_at_construction(name):
    make, code = BAD_HELPERS[name]
    with pytest.raises(InterventionError) as ei:
        make()
    assert ei.value.code == code and ei.value.remedy


BAD_STAGING = {
    "steer wrong length with dim": (lambda: tl.steer(torch.ones(5), dim=-1), "steer_direction_invalid"),
    "steer dim out of range": (lambda: tl.steer(torch.ones(8), dim=4), "steer_direction_invalid"),
    "steer 2d not broadcastable": (lambda: tl.steer(torch.ones(2, 8)), "steer_direction_invalid"),
    "project wrong length": (lambda: tl.project_out(torch.ones(5), dim=-1), "steer_direction_invalid"),
    "mean_ablate dim 7": (lambda: tl.mean_ablate(dim=7), "intervention_over_invalid"),
    "mean_ablate source shape": (lambda: tl.mean_ablate(torch.ones(4, 5), dim=0), "edit_argument_shape_mismatch"),
    "add not broadcastable": (lambda: tl.add(torch.ones(5)), "edit_argument_shape_mismatch"),
    "add grows the site": (lambda: tl.add(torch.ones(2, 3, 8)), "intervention_shape_changed"),
    "replace_with wrong shape": (lambda: tl.replace_with(torch.ones(3, 5)), "intervention_shape_changed"),
    "positions out of range": (lambda: tl.positions(tl.zero_ablate(), [9], axis=1), "position_edit_out_of_range"),
    "positions axis out of range": (lambda: tl.positions(tl.zero_ablate(), [0], axis=5), "position_edit_invalid"),
    "subspace wrong width": (lambda: tl.intervention.subspace_ablate(torch.ones(1, 5)), "subspace_basis_dim_mismatch"),
}


@pytest.mark.parametrize("engine", ["replay", "rerun", "set_only"])
@pytest.mark.parametrize("name", sorted(BAD_STAGING))
def test_helper_refuses_a_site_it_does_not_fit_before_anything_changes(name, engine):
    model, x = _mlp()
    fork = tl.trace(model, x).fork()
    before = _bytes(fork)
    make, code = BAD_STAGING[name]
    kw = {"model": model, "inputs": x} if engine == "rerun" else {}
    if engine == "set_only":
        kw["intervention"] = InterventionOptions(engine="set_only")
    with pytest.raises(InterventionError) as ei:
        fork.do("relu_1_2", make(), **kw)
    assert ei.value.code == code, ei.value
    assert _same(_bytes(fork), before) and len(fork.recipe) == 0


def test_steer_without_dim_still_refuses_an_ambiguous_axis():
    model, _ = _mlp()
    x = torch.randn(8, 4)  # relu_1_2 is (8, 8): a length-8 direction fits both axes
    with pytest.raises(AmbiguousAxisError):
        tl.trace(model, x).fork().do("relu_1_2", tl.steer(torch.ones(8)))


def test_steer_of_a_length_no_axis_has_says_which_lengths_fit():
    model, x = _mlp()
    t = tl.trace(model, x)
    before = t.ops["relu_1_2"].out.clone()
    with pytest.raises(InterventionError) as ei:
        t.fork().do("relu_1_2", tl.steer(torch.ones(5)))
    assert ei.value.code == "steer_direction_invalid"
    assert 8 in ei.value.fields["expected_lengths"] and "dim=" not in ei.value.remedy
    assert torch.equal(t.ops["relu_1_2"].out, before)


@pytest.mark.parametrize("name", sorted(BAD_STAGING))
def test_bound_and_capture_time_edits_refuse_with_the_same_code(name):
    model, x = _mlp()
    make, code = BAD_STAGING[name]
    with pytest.raises(InterventionError) as ei:
        tl.trace(model, x, intervene=tl.when("relu_1_2", make()))
    assert ei.value.code == code
    with pytest.raises(InterventionError) as ei:
        tl.when(tl.module("1"), make()).bind(model)(x)
    assert ei.value.code == code


def test_valid_helpers_still_match_their_formulas():
    model, x = _mlp()
    base = tl.trace(model, x)
    h = base["relu_1_2"].out.detach()
    d = torch.arange(8, dtype=torch.float32)
    u = d / d.norm()
    cases = [
        (tl.scale(2), h * 2), (tl.add(torch.ones(8)), h + 1), (tl.steer(d, 0.5, dim=-1), h + 0.5 * d),
        (tl.project_out(d, dim=1), h - (h @ u)[:, None] * u), (tl.mean_ablate(dim=-1), h.mean(-1, keepdim=True).expand_as(h)),
        (tl.clip_norm(1.0, float("inf")), h * min(1.0, 1.0 / (float(h.abs().max()) + 1e-12))),
        (tl.positions(tl.zero_ablate(), [-1], axis=1), torch.cat([h[:, :-1], torch.zeros(3, 1)], 1)),
    ]
    for edit, want in cases:
        got = base.fork().do("relu_1_2", edit)["relu_1_2"].out
        assert torch.allclose(got, want, atol=1e-6), edit


def test_a_rerun_checks_the_shapes_of_its_own_inputs():
    model, x = _mlp()
    trace = tl.trace(model, x)  # batch 3
    value = torch.ones(5, 8)
    fork = trace.fork().do("relu_1_2", tl.replace_with(value), model=model, inputs=torch.randn(5, 4))  # batch 5: fits
    with torch.no_grad():
        assert torch.equal(fork["linear_2_3"].out, model[2](value))
    with pytest.raises(InterventionError) as ei:
        trace.fork().do("relu_1_2", tl.replace_with(value), model=model, inputs=x)  # batch 3: does not
    assert ei.value.code == "intervention_shape_changed"
