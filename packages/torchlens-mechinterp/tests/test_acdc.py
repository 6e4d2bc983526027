"""ACDC as a recipe over patch_edges (helper A, issue 17): the walk equals a hand-written ACDC
loop without shortcuts, the first test equals an independent forward-hook patch, the extremes
of the threshold, the ledger, and refusals that leave the trace unchanged."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
import torchlens.mechinterp as mi
from mi_models import assert_unchanged, snapshot
from test_audit_edges import _hook_patch_one, _senders


def _metric(logits):
    return logits[:, -1, 3] - logits[:, -1, 4]


@pytest.fixture(scope="module")
def setup():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=8, vocab_size=32, n_positions=16,
                                       attn_implementation="eager", bos_token_id=0, eos_token_id=0)).eval().double()
    g = torch.Generator().manual_seed(3)
    clean, corrupt = torch.randint(0, 32, (2, 5), generator=g), torch.randint(0, 32, (2, 5), generator=g)
    ready = tl.options.CaptureOptions(replayable=True)
    ct = tl.trace(model, clean, capture=ready, save="all")
    kt = tl.trace(model, corrupt, capture=ready, save="all")
    return model, clean, corrupt, ct, mi.component_graph(kt)


def _metric_of(trace):
    from torchlens_mechinterp.audit import logits_of

    return _metric(logits_of(trace, "test").detach()).mean().item()


def _hand_acdc(trace, cgraph, threshold):
    """ACDC written out plainly: receivers from the output back, senders latest first, every
    edge tested with one patch_edges call (no bias or unreachable shortcut)."""
    graph = mi.component_graph(trace)
    patched, current = [], _metric_of(trace)
    order = sorted(graph.receivers.values(), key=lambda r: (r.stage, r.name), reverse=True)
    for r in order:
        for s in reversed(r.senders):
            name = f"{s.name}->{r.name}"
            fork = mi.patch_edges(trace, [graph.edges[n] for n in patched + [name]], corrupted_graph=cgraph)
            value = _metric_of(fork)
            if abs(value - current) < threshold:
                patched, current = patched + [name], value
    return set(graph.edges) - set(patched), current


def test_acdc_equals_a_hand_written_walk_and_its_shortcuts_are_exact(setup):
    model, clean, corrupt, ct, cgraph = setup
    threshold = 0.001
    res = mi.acdc(ct, cgraph, _metric, threshold)
    kept, final = _hand_acdc(ct, cgraph, threshold)
    assert set(res.kept) == kept
    assert 0 < len(res.kept) < len(mi.component_graph(ct).edges)
    assert res.metric_final == pytest.approx(final, abs=1e-10)
    verdicts = {d.verdict for d in res.ledger}
    assert {"pruned", "kept", "pruned_bias"} <= verdicts
    assert res.tests == sum(1 for d in res.ledger if d.test is not None) < len(res.ledger)
    assert res.complete and res.untested == ()
    # every decision is in the ledger exactly once, and the ledger's verdicts are the result
    assert sorted(d.edge for d in res.ledger) == sorted(mi.component_graph(ct).edges)
    assert {d.edge for d in res.ledger if d.pruned} == set(res.pruned)
    for d in res.ledger:
        if d.verdict == "pruned":
            assert abs(d.delta) < threshold
        elif d.verdict == "kept":
            assert abs(d.delta) >= threshold
    # an untested prune claims no effect: patching it on top of what was pruned before it
    # leaves the metric where it was
    graph = mi.component_graph(ct)
    before: list[str] = []
    for d in res.ledger:
        if d.verdict in ("pruned_bias", "pruned_unreachable"):
            with_it = _metric_of(mi.patch_edges(ct, [graph.edges[n] for n in before + [d.edge]], corrupted_graph=cgraph))
            assert with_it == pytest.approx(d.metric_before, abs=1e-10), d
        if d.pruned:
            before.append(d.edge)


def test_first_test_equals_an_independent_hook_patch(setup):
    model, clean, corrupt, ct, cgraph = setup
    res = mi.acdc(ct, cgraph, _metric, 0.0, max_tests=1)
    first = res.ledger[0]
    assert first.test == 1 and first.receiver == "logits"
    vc, logits_c = _senders(model, clean)
    vk, _ = _senders(model, corrupt)
    base = _metric(logits_c).mean().item()
    hooked = _metric(_hook_patch_one(model, clean, vk[first.sender] - vc[first.sender], "logits")).mean().item()
    assert first.metric_before == pytest.approx(base, abs=1e-12)
    assert first.metric_after == pytest.approx(hooked, abs=1e-10)
    assert first.verdict == "kept"  # threshold 0 prunes nothing that moves the metric
    assert res.tests == 1 and not res.complete and len(res.untested) > 0


def test_threshold_extremes(setup):
    model, clean, corrupt, ct, cgraph = setup
    n = len(mi.component_graph(ct).edges)
    none = mi.acdc(ct, cgraph, _metric, 0.0)
    assert {d.verdict for d in none.ledger} == {"kept", "pruned_bias"}
    assert len(none.kept) == n - sum(1 for d in none.ledger if d.verdict == "pruned_bias")
    everything = mi.acdc(ct, cgraph, _metric, 1e9)
    assert everything.kept == ()
    # every edge patched: the logits read the corrupted forward's residual
    with torch.no_grad():
        corrupted_metric = _metric(model(corrupt).logits).mean().item()
    assert everything.metric_final == pytest.approx(corrupted_metric, abs=1e-10)
    assert any(d.verdict == "pruned_unreachable" for d in everything.ledger)


def test_refusals_leave_the_trace_unchanged(setup):
    model, clean, corrupt, ct, cgraph = setup
    snap = snapshot(ct)
    plain = tl.trace(model, clean, save="all")
    cases = [
        (lambda: mi.acdc(plain, cgraph, _metric, 0.1), "mi_edge_patch_not_replayable"),
        (lambda: mi.acdc(ct, cgraph, _metric, -0.1), "mi_acdc_setting_invalid"),
        (lambda: mi.acdc(ct, cgraph, _metric, float("nan")), "mi_acdc_setting_invalid"),
        (lambda: mi.acdc(ct, cgraph, _metric, True), "mi_acdc_setting_invalid"),
        (lambda: mi.acdc(ct, cgraph, "logit diff", 0.1), "mi_acdc_setting_invalid"),
        (lambda: mi.acdc(ct, cgraph, _metric, 0.1, max_tests=0), "mi_acdc_setting_invalid"),
        (lambda: mi.acdc(ct, cgraph, _metric, 0.1, edges=["m7->logits"]), "mi_acdc_setting_invalid"),
        (lambda: mi.acdc(ct, cgraph, _metric, 0.1, edges=["m0->logits", "m0->logits"]), "mi_acdc_setting_invalid"),
        (lambda: mi.acdc(ct, "graph", _metric, 0.1), "mi_edge_corrupted_graph_invalid"),
        (lambda: mi.acdc(ct, cgraph, lambda lg: lg[:, -1], 0.1), "mi_acdc_setting_invalid"),
    ]
    for call, code in cases:
        with pytest.raises(tl.errors.TorchLensError) as exc:
            call()
        assert exc.value.code == code, (code, exc.value.code)
        assert exc.value.remedy
    assert_unchanged(ct, snap)
