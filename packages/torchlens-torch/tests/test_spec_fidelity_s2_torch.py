"""Spec fidelity (issue 13 leftovers, helper S2) on the torch backend: rerun edits that
cannot fire live (glossary l. 289, 811), the differentiable-replay frontier warning of
keep_grad (l. 361), async lazy outputs of a bound call (l. 282), and a Population mean on a
rerun (l. 778)."""

import warnings

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import InterventionError


class WithSetitem(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        y[:, 0] = 0.0
        return y.relu()


class Agent(nn.Sequential):
    async def step(self, x):
        return self(x)

    async def stream(self, x):
        yield self(x)

    def plain(self, x):
        return self(x)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def setitem_model():
    torch.manual_seed(0)
    return WithSetitem(), torch.randn(2, 4)


# rerun_selector_unmatchable_live (glossary l. 289, 811) ----------------------------------------------
@pytest.mark.parametrize("site", ["setitem_1_2", "output_1", "input_1", tl.model_output(), tl.model_input()])
def test_a_rerun_edit_that_matches_sites_but_cannot_fire_live_refuses(setitem_model, site):
    model, x = setitem_model
    t = tl.trace(model, x)
    labels, out = list(t.ops), t.output_ops[0].out.clone()
    for policy in ("warn", "disclose"):  # raised before the zero-fire policy applies, whatever it says
        with pytest.raises(InterventionError) as ei:
            t.do(site, tl.scale(0.5), model=model, inputs=x,
                 intervention=tl.InterventionOptions(on_zero_fire=policy))
        assert ei.value.code == "rerun_selector_unmatchable_live" and ei.value.remedy
    # the trace is unchanged: same graph, same values, nothing staged or audited
    assert list(t.ops) == labels and torch.equal(t.output_ops[0].out, out)
    assert not t.recipe.rules and not t.intervention_audit


def test_trace_run_refuses_a_staged_edit_that_cannot_fire_live(setitem_model):
    model, x = setitem_model
    t = tl.trace(model, x)
    t.do("setitem_1_2", tl.scale(0.5), intervention=tl.InterventionOptions(engine="set_only"))
    with pytest.raises(InterventionError) as ei:
        t.run(model, x)
    assert ei.value.code == "rerun_selector_unmatchable_live"


def test_a_rerun_edit_that_fires_live_somewhere_still_runs(setitem_model):
    model, x = setitem_model
    t = tl.trace(model, x)
    # a union reaching one live-editable op fires there: no refusal, and the value is the hand computation
    r = t.fork().do(tl.label("relu_1_3") | tl.label("setitem_1_2"), tl.scale(0.5), model=model, inputs=x)
    y = model.fc(x).detach()
    y[:, 0] = 0.0
    assert torch.allclose(r.output_ops[0].out, y.relu() * 0.5)


# keep_grad_replay_frontier (glossary l. 361) ------------------------------------------------------
def _frontier(caught):
    return [w for w in caught if getattr(w.message, "code", None) == "keep_grad_replay_frontier"]


def test_keep_grad_under_differentiable_replay_warns_once_about_the_frontier(monkeypatch):
    from torchlens.intervention import edits

    monkeypatch.setattr(edits, "_FRONTIER_WARNED", False)
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)), torch.randn(2, 4)
    t = tl.trace(model, x, capture=tl.CaptureOptions(inference_only=True))  # payloads hold no autograd history
    diff = tl.InterventionOptions(differentiable=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(tl.errors.InvalidArgumentError):  # plain replay: the site has no graph, nothing to keep
            t.fork().do("relu_1_2", tl.intervention.keep_grad(tl.scale(0.5)))
        t.fork().do("relu_1_2", tl.scale(0.5), intervention=diff)  # no keep_grad: no check passed
        assert not _frontier(caught)
        r = t.do("relu_1_2", tl.intervention.keep_grad(tl.scale(0.5)), intervention=diff)
        t.do("relu_1_2", tl.intervention.keep_grad(tl.scale(0.5)), intervention=diff)  # once per session
    frontier = _frontier(caught)
    assert len(frontier) == 1 and frontier[0].message.fields["label"] == "relu_1_2" and frontier[0].message.remedy
    # what it warns about, checked with autograd: the replayed output reaches the parameters downstream
    # of the frontier and none upstream of it
    model.zero_grad()
    r.output_ops[0].out.sum().backward()
    assert model[2].weight.grad is not None and model[2].weight.grad.abs().sum() > 0
    assert model[0].weight.grad is None


def test_no_frontier_warning_when_the_frontier_value_keeps_its_graph(monkeypatch):
    """A capture whose payloads keep their autograd history: the differentiable replay reaches the
    upstream parameters too (autograd says so), so the warning's premise does not hold and it is not given."""
    from torchlens.intervention import edits

    monkeypatch.setattr(edits, "_FRONTIER_WARNED", False)
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)), torch.randn(2, 4)
    t = tl.trace(model, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = t.do("relu_1_2", tl.intervention.keep_grad(tl.scale(0.5)),
                 intervention=tl.InterventionOptions(differentiable=True))
    assert not _frontier(caught)
    model.zero_grad()
    r.output_ops[0].out.sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0


# bind_lazy_output (glossary l. 282) ---------------------------------------------------------------
def test_a_bound_call_returning_an_async_lazy_output_refuses():
    torch.manual_seed(0)
    model, x = Agent(nn.Linear(4, 3), nn.ReLU()), torch.randn(2, 4)
    bound = tl.when(tl.module("0"), tl.scale(2.0)).bind(model)
    for call in (lambda: bound.step(x), lambda: bound.stream(x)):
        with pytest.raises(InterventionError) as ei:
            call()
        assert ei.value.code == "bind_lazy_output" and ei.value.remedy
    # a synchronous call is steered as before: the hand computation with the Linear output doubled
    assert torch.allclose(bound.plain(x), torch.relu(model[0](x) * 2.0))


# Population on a rerun (glossary l. 778) -----------------------------------------------------------
def test_population_mean_on_a_rerun_matches_torch_mean_over_members():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)), torch.randn(2, 4)
    members = [torch.randn(2, 5) for _ in range(3)]
    t = tl.trace(model, x)
    r = t.fork().do("linear_1_1", tl.mean_ablate(tl.intervention.Population(members), dim="members"),
                    model=model, inputs=x)
    mean = torch.stack(members).mean(0)
    assert torch.allclose(r["linear_1_1"].out, mean, atol=1e-6)
    assert torch.allclose(r.output_ops[0].out, model[2](torch.relu(mean)), atol=1e-6)
    assert r.intervention_audit[-1]["stochastic"] is False


class Generator(nn.Sequential):
    def gen(self, x, n=2):
        for _ in range(n):
            x = self(x)
            yield x


def test_a_bound_sync_generator_stays_steered_for_every_step_and_settles_at_the_end():
    """glossary l. 282: a sync lazy output stays steered for every step; its report settles on
    last_report when the iteration is exhausted or closed; the edits are detached afterwards."""
    torch.manual_seed(0)
    model, x = Generator(nn.Linear(3, 3)), torch.randn(1, 3)
    bound = tl.when(tl.module("0"), tl.scale(0.5)).bind(model)
    ys = list(bound.gen(x))
    with torch.no_grad():  # independent: the same two steps by hand with the Linear output halved
        h1 = model[0](x) * 0.5
        h2 = model[0](h1) * 0.5
    assert torch.allclose(ys[0], h1) and torch.allclose(ys[1], h2)
    assert bound.last_report["fire_counts"] == {0: 2} and bound.last_report["zero_fire_rule_ids"] == []
    assert torch.allclose(model(x), model[0](x))  # detached after the iteration
    g = bound.gen(x, n=5)
    next(g)
    g.close()
    assert bound.last_report["fire_counts"] == {0: 1} and torch.allclose(model(x), model[0](x))


def test_scramble_elements_from_a_source_on_torch():
    import numpy as np

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)), torch.randn(2, 4)
    src = torch.arange(7, dtype=torch.float32)
    t = tl.trace(model, x)
    out = t.fork().do("linear_1_1", tl.intervention.scramble_elements(seed=5, source=src))["linear_1_1"].out
    idx = torch.as_tensor(np.random.default_rng(5).integers(0, 7, 10))
    assert torch.equal(out, src[idx].reshape(2, 5))


# keep_grad's check (glossary l. 359) ---------------------------------------------------------------
def test_keep_grad_refuses_a_site_value_with_no_graph_and_the_live_path_reaches_upstream_params():
    from torchlens.errors import InvalidArgumentError

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)), torch.randn(2, 4)
    bound = tl.when(tl.module("1"), tl.intervention.keep_grad(tl.scale(0.5))).bind(model)
    with torch.no_grad(), pytest.raises(InvalidArgumentError) as ei:
        bound(x)
    assert ei.value.code == "edit_detached_from_graph" and ei.value.fields["reason"] == "site_has_no_graph"
    # replay of a capture recorded without a graph: refused, nothing written
    with torch.no_grad():
        t = tl.trace(model, x)
    before = t.output_ops[0].out.clone()
    with pytest.raises(InvalidArgumentError) as ei:
        t.do("relu_1_2", tl.intervention.keep_grad(tl.scale(0.5)))
    assert ei.value.fields["reason"] == "site_has_no_graph" and torch.equal(t.output_ops[0].out, before)
    # with gradients on, the live path keeps the graph to the parameters upstream of the site (autograd agrees
    # with the hand computation relu(W0 x + b0) * 0.5 -> W2)
    model.zero_grad()
    bound(x).sum().backward()
    got = model[0].weight.grad.clone()
    model.zero_grad()
    (model[2](torch.relu(model[0](x)) * 0.5)).sum().backward()
    assert torch.allclose(got, model[0].weight.grad) and got.abs().sum() > 0
