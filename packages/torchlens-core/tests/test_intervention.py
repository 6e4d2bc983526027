"""Interventions on the toy backend: the four engines agree, replay touches only the cone,
refusals leave the trace unchanged. Expected values come from a plain numpy forward."""

import warnings

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import AmbiguousAxisError, InterventionError


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


def test_four_engines_agree(mlp):
    model, x = mlp
    site, head = tl.module("1"), tl.module("2")
    spec = tl.when(site, tl.zero_ablate())
    expected = model[2](np.zeros((3, 8), np.float32))
    live = tl.trace(model, x, save=head, intervene=spec).find_sites(head).first().out
    saved = tl.trace(model, x)
    pushed = saved.fork("pushed").do(site, tl.zero_ablate()).find_sites(head).first().out
    executed = saved.fork("executed").do(site, tl.zero_ablate(), model=model, inputs=x).find_sites(head).first().out
    bound = spec.bind(model)(x)
    for got in (live, pushed, executed, bound):
        assert np.array_equal(got, expected)
    assert np.array_equal(saved.find_sites(head).first().out, model(x))  # forks left the root alone


def test_replay_recomputes_only_the_cone():
    from torchlens_reference import nn

    model = nn.LoopNet(width=4, steps=6)
    x = np.ones((2, 4), np.float32)
    t = tl.trace(model, x).fork()
    t.do("linear_2_2:5", tl.scale(0.5))
    assert t.last_run["reexecuted"] == ["tanh_1_3:5", "linear_2_2:6", "tanh_1_3:6"]
    # by hand: the same forward with the 5th cell output halved
    h = model.inp.forward(x)
    for i in range(6):
        pre = model.cell.forward(h)
        if i == 4:
            pre = pre * 0.5
        h = np.tanh(pre)
    assert np.array_equal(t.output_ops[0].out, h)


def test_mapping_applies_several_edits_in_one_propagation(mlp):
    model, x = mlp
    t = tl.trace(model, x).fork()
    t.do({"linear_1_1": tl.scale(2.0), "relu_1_2": tl.add(1.0)})
    expected = model[2](np.maximum(model[0](x) * 2, 0) + 1)
    assert np.allclose(t["linear_2_3"].out, expected, atol=0) and t.last_run["origins"] == ["linear_1_1", "relu_1_2"]


def test_value_helpers_match_formulas(mlp):
    model, x = mlp
    base = tl.trace(model, x)
    h = base["linear_1_1"].out
    d = np.arange(8, dtype=np.float32)
    u = d / np.linalg.norm(d)
    cases = {
        "clamp": (tl.clamp(min=-0.1, max=0.1), np.clip(h, -0.1, 0.1)),
        "mean": (tl.mean_ablate(dim=0), np.broadcast_to(h.mean(0, keepdims=True), h.shape)),
        "steer": (tl.steer(d, 2.0), h + 2 * d),
        "project_out": (tl.project_out(d), h - (h @ u)[:, None] * u),
        "project_onto": (tl.project_onto(d), (h @ u)[:, None] * u),
        "replace": (tl.replace_with(np.full((3, 8), 7, np.float32)), np.full((3, 8), 7, np.float32)),
        "clip_norm": (tl.clip_norm(1.0), h / np.linalg.norm(h)),
    }
    for name, (edit, want) in cases.items():
        got = base.fork(name).do("linear_1_1", edit)["linear_1_1"].out
        assert np.allclose(got, want, atol=1e-6), name


def test_hook_callable_and_patch_from(mlp):
    model, x = mlp
    donor = tl.trace(model, x * 2)
    t = tl.trace(model, x).fork()
    t.do("relu_1_2", tl.patch_from(donor))
    assert np.array_equal(t["linear_2_3"].out, donor["linear_2_3"].out)
    seen = []
    t2 = tl.trace(model, x).fork()
    t2.do("relu_1_2", lambda v, *, ctx: seen.append(ctx.label) or v * 0)
    assert seen == ["relu_1_2"] and np.array_equal(t2["linear_2_3"].out, model[2](np.zeros((3, 8), np.float32)))


def test_set_only_stages_without_propagating(mlp):
    model, x = mlp
    t = tl.trace(model, x).fork()
    before = t["linear_2_3"].out.copy()
    t.do("relu_1_2", tl.zero_ablate(), intervention=tl.InterventionOptions(engine="set_only"))
    assert np.array_equal(t["linear_2_3"].out, before) and len(t.recipe) == 1
    rerun = t.run(model, x)
    assert np.array_equal(rerun["linear_2_3"].out, model[2](np.zeros((3, 8), np.float32)))
    t.clear_edits("relu_1_2")
    assert len(t.recipe) == 0


def test_root_trace_warns_once_and_forks_never(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t.do("relu_1_2", tl.scale(2.0))
        t.do("relu_1_2", tl.scale(0.5))
        t.fork().do("relu_1_2", tl.scale(3.0))
    assert [x.category for x in w] == [tl.errors.TraceMutationWarning]


def test_recipe_merge_digest_and_rule_refusals():
    a = tl.when("relu_1_2", tl.zero_ablate())
    b = tl.when(tl.module("fc"), tl.scale(2.0))
    merged = a & b
    assert len(merged) == 2 and merged.digest == (a.merge(b)).digest and merged.digest != a.digest
    with pytest.raises(InterventionError) as info:
        merged.merge(a)
    assert info.value.code == "spec_rules_duplicate"
    with pytest.raises(InterventionError) as info:
        tl.intervention.Rule("relu_1_2", tl.zero_ablate(), direction="forward")
    assert info.value.code == "intervention_direction_invalid"
    with pytest.raises(InterventionError) as info:
        tl.when(3, tl.zero_ablate())
    assert info.value.code == "intervention_site_invalid"


REFUSALS = [
    ("bare multi-pass label", lambda t, m, x: t.do("linear_2_2", tl.zero_ablate()), "multipass_bare_label_ambiguous"),
    ("shape change", lambda t, m, x: t.do("linear_2_2:1", tl.replace_with(np.zeros(3, np.float32))),
     "intervention_shape_changed"),
    ("model without inputs", lambda t, m, x: t.do("linear_1_1", tl.zero_ablate(), model=m), "rerun_inputs_required"),
    ("ambiguous steer axis", lambda t, m, x: t.do("linear_1_1", tl.steer(np.ones(4, np.float32), dim=None)),
     "axis_ambiguous"),
    ("gradient site on replay", lambda t, m, x: t.do(tl.grad("linear_1_1"), tl.zero_ablate()),
     "replay_gradient_edit_unsupported"),
    ("unknown label", lambda t, m, x: t.do("linear_9_9", tl.zero_ablate()), "label_unknown"),
    ("bad engine", lambda t, m, x: t.do("linear_1_1", tl.zero_ablate(), intervention=tl.InterventionOptions(engine="x")),
     "engine_invalid"),
]


@pytest.mark.parametrize("name,call,code", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_leave_the_trace_unchanged(name, call, code):
    from torchlens_reference import nn

    model = nn.LoopNet(width=4, steps=3)
    x = np.ones((4, 4), np.float32)  # batch 4 == width 4: steer cannot infer its axis
    t = tl.trace(model, x).fork()
    before, recipe = _snapshot(t), t.recipe
    with pytest.raises(tl.errors.TorchLensError) as info:
        call(t, model, x)
    assert info.value.code == code
    assert _same(_snapshot(t), before) and t.recipe is recipe and t.is_pristine


def test_steer_axis_error_is_typed():
    assert issubclass(AmbiguousAxisError, InterventionError)


def test_zero_fire_policy(mlp):
    model, x = mlp
    with pytest.warns(RuntimeWarning, match="trace_zero_fire"):
        tl.trace(model, x, intervene=tl.when(tl.func("tanh"), tl.zero_ablate()))
    with pytest.raises(InterventionError) as info:
        tl.trace(model, x, intervene=tl.when(tl.func("tanh"), tl.zero_ablate()), on_zero_fire="error")
    assert info.value.code == "trace_zero_fire"


def test_bound_model_report(mlp):
    model, x = mlp
    bound = tl.when(tl.module("0"), tl.scale(0.0)).bind(model)
    out = bound(x)
    assert np.array_equal(out, model[2](model[1](np.zeros((3, 8), np.float32))))
    assert bound.last_report["fire_counts"] == {0: 1} and bound.model is model


def test_direct_write_marks_the_trace_dirty_once(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    assert not t.direct_write_dirty
    with pytest.warns(tl.errors.TraceMutationWarning):
        t["relu_1_2"].out = np.zeros((3, 8), np.float32)
    assert t.direct_write_dirty and np.array_equal(t["relu_1_2"].out, np.zeros((3, 8), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t["linear_1_1"].out = np.ones((3, 8), np.float32)  # warned once per trace


def test_subspace_ablate_and_interchange(mlp):
    model, x = mlp
    base, donor = tl.trace(model, x), tl.trace(model, x * 3)
    basis = np.eye(8, dtype=np.float64)[:2]
    a = base.fork().do("linear_1_1", tl.intervention.subspace_ablate(basis))["linear_1_1"].out
    h = base["linear_1_1"].out
    assert np.allclose(a[:, :2], 0) and np.allclose(a[:, 2:], h[:, 2:])
    b = base.fork().do("linear_1_1", tl.intervention.subspace_interchange(basis, donor))["linear_1_1"].out
    assert np.allclose(b[:, :2], donor["linear_1_1"].out[:, :2]) and np.allclose(b[:, 2:], h[:, 2:])
