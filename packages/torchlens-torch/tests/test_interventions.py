"""Interventions on the torch backend: the four engines agree bit for bit on GPT-2, replay
re-executes only the cone, refusals leave the trace unchanged, bound executors steer
generate()."""

import pytest
import torch
from torch import nn

import torchlens as tl

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=12, n_embd=32, n_head=4, vocab_size=64, n_positions=32, attn_implementation="eager")
    return GPT2LMHeadModel(cfg).eval(), torch.randint(0, 64, (1, 10))


def test_four_engines_agree_on_gpt2_mid_layer(gpt2):
    model, ids = gpt2
    site = tl.module("transformer.h.6.mlp")
    spec = tl.when(site, tl.scale(0.5))
    live = tl.trace(model, ids, intervene=spec).output_ops[0].out
    saved = tl.trace(model, ids)
    pushed = saved.fork().do(site, tl.scale(0.5)).output_ops[0].out
    executed = saved.fork().do(site, tl.scale(0.5), model=model, inputs=ids).output_ops[0].out
    bound = spec.bind(model)(ids).logits
    # independent: a forward hook scaling the MLP output
    h = model.transformer.h[6].mlp.register_forward_hook(lambda m, i, o: o * 0.5)
    try:
        with torch.no_grad():
            expected = model(ids).logits
    finally:
        h.remove()
    for got in (live, pushed, executed, bound):
        assert torch.equal(got, expected)
    assert not torch.equal(saved.output_ops[0].out, expected)


def test_replay_recomputes_a_small_cone_for_a_late_edit(gpt2):
    model, ids = gpt2
    t = tl.trace(model, ids).fork()
    t.do(tl.module("transformer.h.11.mlp"), tl.zero_ablate())
    n = t.last_run["num_reexecuted"]
    assert 0 < n <= 10 and n / len(t.ops) < 0.05


def _snapshot(t):
    return {o.label: tuple(v.clone() for v in o.outs if isinstance(v, torch.Tensor)) for o in t.ops if o.saved}


REFUSALS = [
    ("bare multipass", lambda t: t.do("linear_1_1", tl.zero_ablate()), "multipass_bare_label_ambiguous"),
    ("shape change", lambda t: t.do("linear_1_1:1", tl.replace_with(torch.zeros(3))), "intervention_shape_changed"),
    ("gradient on replay", lambda t: t.do(tl.grad("linear_1_1:1"), tl.zero_ablate()), "replay_gradient_edit_unsupported"),
    ("inputs without model", lambda t: t.do("linear_1_1:1", tl.zero_ablate(), inputs=torch.zeros(2, 4)),
     "rerun_inputs_required"),
    ("steer axis", lambda t: t.do("linear_1_1:1", tl.steer(torch.ones(4))), "axis_ambiguous"),
]


@pytest.mark.parametrize("name,call,code", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_leave_the_trace_unchanged(name, call, code):
    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            for _ in range(3):
                x = torch.relu(self.fc(x))
            return x

    t = tl.trace(Loop(), torch.randn(4, 4)).fork()
    before = _snapshot(t)
    with pytest.raises(tl.errors.TorchLensError) as info:
        call(t)
    assert info.value.code == code
    after = _snapshot(t)
    assert before.keys() == after.keys() and all(
        all(torch.equal(a, b) for a, b in zip(before[k], after[k])) for k in before)
    assert t.is_pristine and len(t.recipe) == 0


def test_bound_executor_steers_generate(gpt2):
    model, ids = gpt2
    direction = torch.randn(32) * 50
    bound = tl.when(tl.module("transformer.h.3"), tl.steer(direction, 1.0)).bind(model)
    plain = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    steered = bound.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert bound.last_report["fire_counts"][0] >= 4  # prefill + each decode step
    assert not torch.equal(plain, steered)
    again = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(plain, again)  # the binding left the model untouched


def test_replay_through_batchnorm_keeps_saved_buffers():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU()).train()
    t = tl.trace(model, torch.randn(8, 4)).fork()
    buffers = {o.label: o.out.clone() for o in t.ops if o.kind == "buffer"}
    t.do("linear_1_1", tl.scale(2.0))
    assert all(torch.equal(t.ops[k].out, v) for k, v in buffers.items())


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(3, 4)


def test_gradient_edit_on_rerun_with_loss():
    m, x = _mlp()
    t = tl.trace(m, x).fork()
    t.do(tl.grad("relu_1_2"), tl.zero_ablate(), model=m, inputs=x, loss=lambda tr: tr.output.sum())
    assert t.last_run["backward_ready_forced"] and torch.count_nonzero(m[0].weight.grad) == 0
    assert torch.count_nonzero(m[2].weight.grad) > 0  # downstream of the site, gradients flow as usual
    m.zero_grad()


def test_capture_time_gradient_edit_scales_upstream_grads():
    m, x = _mlp()
    t = tl.trace(m, x, intervene=tl.when(tl.grad("relu_1_2"), tl.scale(2.0)),
                 capture=tl.CaptureOptions(backward_ready=True, save_grads=True))
    assert len(t.armed_edits) == 1
    t.backward(t.output.sum())
    edited = m[0].weight.grad.clone()
    m.zero_grad()
    m(x).sum().backward()
    assert torch.allclose(edited, 2 * m[0].weight.grad)
    m.zero_grad()


def test_gradient_sites_refused_where_they_cannot_run():
    m, x = _mlp()
    with pytest.raises(tl.errors.InterventionError) as info:
        tl.when(tl.grad("relu_1_2"), tl.scale(2.0)).bind(m)(x)
    assert info.value.code == "bind_rule_unsupported"
    t = tl.trace(m, x).fork()
    with pytest.raises(tl.errors.InterventionError) as info:
        t.do("relu_1_2", tl.scale(2.0), model=m, inputs=x, loss=lambda tr: tr.output.sum())
    assert info.value.code == "do_loss_without_gradient_site"
    with pytest.raises(tl.errors.InterventionError) as info:
        t.do(tl.grad("relu_1_2"), tl.scale(2.0), model=m, inputs=x, loss=3)
    assert info.value.code == "do_loss_not_callable"


def test_sweep_sets_the_site_to_each_value():
    m, x = _mlp()
    traces = tl.sweep(m, x, "relu_1_2", [0.0, 1.0])
    with torch.no_grad():
        for t, v in zip(traces, [0.0, 1.0]):
            assert torch.equal(t["linear_2_3"].out, m[2](torch.full((3, 4), v)))


def test_changed_helper_tensor_refuses_a_rerun():
    m, x = _mlp()
    direction = torch.ones(4)
    t = tl.trace(m, x).fork()
    t.do("relu_1_2", tl.steer(direction, 1.0), intervention=tl.InterventionOptions(engine="set_only"))
    direction.add_(1.0)
    with pytest.raises(tl.errors.InterventionError) as info:
        t.run(m, x)
    assert info.value.code == "helper_tensor_changed_since_capture"


def test_positions_and_splice_module():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 5, 4)
    t = tl.trace(m, x)
    f = t.fork().do("linear_1_1", tl.positions(tl.zero_ablate(), [-1]))
    h = t["linear_1_1"].out
    assert torch.equal(f["linear_1_1"].out[:, -1], torch.zeros(2, 4)) and torch.equal(f["linear_1_1"].out[:, :-1], h[:, :-1])
    double = nn.Identity()
    g = t.fork().do("linear_1_1", tl.intervention.splice_module(lambda v: v * 2))
    assert torch.equal(g["relu_1_2"].out, torch.relu(h * 2)) and double is not None


def test_differentiable_replay_returns_a_fork_with_gradients():
    m, x = _mlp()
    t = tl.trace(m, x)
    before = t["linear_2_3"].out.clone()
    f = t.do("relu_1_2", tl.scale(2.0), intervention=tl.InterventionOptions(differentiable=True))
    assert f is not t and torch.equal(t["linear_2_3"].out, before)  # the source is untouched
    out = f["linear_2_3"].out
    assert out.requires_grad
    m.zero_grad()
    out.sum().backward()
    got = m[2].weight.grad.clone()
    m.zero_grad()
    expected = torch.autograd.grad(m[2](2 * torch.relu(m[0](x))).sum(), m[2].weight)[0]
    assert torch.allclose(got, expected)
