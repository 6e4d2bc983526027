"""Tier 3 (issue 14 §7): edits through the replay engine and saved gradients against each
zoo entry's hand-written forward. Each test breaks the engine (or the oracle) once and
watches the cell go red, so no c3 cell can pass vacuously."""

from __future__ import annotations

import dataclasses

import pytest

import torchlens as tl
from torchlens_conformance import cells as C
from torchlens_conformance.scorecard import highest_tier

EDIT_CELLS = (C.c3_edit_zero_matches_oracle, C.c3_edit_scale_matches_oracle, C.c3_edit_replace_matches_oracle,
              C.c3_patch_from_matches_oracle)


def _only(ctx: C.Context, *names: str) -> C.Context:
    return C.Context(ctx.spec, ctx.proto, {n: ctx.zoo[n] for n in names})


def test_reference_edit_cells_pass_and_name_their_entries():
    ctx = C.make_context("reference")
    for cell in (*EDIT_CELLS, C.c3_noop_edit_bit_exact):
        out = C.run_cell(ctx, cell)
        assert out.outcome == "passed", (cell.__name__, out)
        assert "4 entries checked (mlp, loop, constant, random)" in out.detail
    # no autodiff in the reference framework: unsupported, named by capability, never a pass
    assert C.run_cell(ctx, C.c3_grads_match_autodiff) == C.Outcome("unsupported", "unsupported: backward_capture")


@pytest.fixture
def edits_ignored(monkeypatch):
    """A replay engine that re-executes the cone but drops every edit (a no-op in its place)."""
    from torchlens.intervention import replay as replay_mod

    real = replay_mod.replay

    def ignoring(trace, edits, **kw):
        return real(trace, {label: [tl.intervention.scale(1.0)] for label in edits}, **kw)

    monkeypatch.setattr(replay_mod, "replay", ignoring)


@pytest.mark.parametrize("cell", EDIT_CELLS, ids=lambda c: c.__name__)
def test_edit_cells_go_red_when_replay_ignores_the_edit(cell, edits_ignored):
    out = C.run_cell(C.make_context("reference"), cell)
    assert out.outcome == "failed" and "differs from" in out.detail, out


def test_noop_cell_goes_red_when_replay_is_not_exact(monkeypatch):
    from torchlens.intervention import replay as replay_mod

    real = replay_mod.replay

    def off_by_one_ulp(trace, edits, **kw):
        return real(trace, {label: [*e, tl.intervention.scale(1.0 + 2 ** -20)] for label, e in edits.items()}, **kw)

    ctx = _only(C.make_context("reference"), "mlp")
    assert C.run_cell(ctx, C.c3_noop_edit_bit_exact).outcome == "passed"
    monkeypatch.setattr(replay_mod, "replay", off_by_one_ulp)
    out = C.run_cell(ctx, C.c3_noop_edit_bit_exact)
    assert out.outcome == "failed" and "changed the outputs" in out.detail, out


def test_a_wrong_oracle_is_caught_before_it_is_trusted():
    ctx = _only(C.make_context("reference"), "mlp")
    entry = ctx.zoo["mlp"]
    real = entry.c3.forward
    entry.c3 = dataclasses.replace(entry.c3, forward=lambda tap, x: real(tap, x) + 1)
    out = C.run_cell(ctx, C.c3_edit_zero_matches_oracle)
    assert out.outcome == "failed" and "oracle is wrong" in out.detail, out
    entry.c3 = dataclasses.replace(entry.c3, forward=real, site="input_1")  # a site the hand forward never taps
    out = C.run_cell(ctx, C.c3_edit_zero_matches_oracle)
    assert out.outcome == "failed" and "never reaches its site" in out.detail, out


def test_an_entry_without_an_oracle_fails_and_not_applicable_is_named_and_counted():
    ctx = C.make_context("reference")
    ctx.zoo["loop"].c3 = None
    out = C.run_cell(ctx, C.c3_edit_zero_matches_oracle)
    assert out.outcome == "failed" and "loop: the zoo entry supplies no c3 oracle" in out.detail
    ctx.zoo["loop"].c3_not_applicable = "no mid-graph op"
    out = C.run_cell(ctx, C.c3_edit_zero_matches_oracle)
    assert out.outcome == "passed"
    assert "3 entries checked" in out.detail and "not applicable (1): loop (no mid-graph op)" in out.detail
    for e in ctx.zoo.values():
        e.c3, e.c3_not_applicable = None, "nothing"
    out = C.run_cell(ctx, C.c3_edit_zero_matches_oracle)
    assert out.outcome == "failed" and "no zoo entry supplies a c3 oracle" in out.detail


def test_a_backend_without_interventions_is_unsupported_not_passed(monkeypatch):
    ctx = C.make_context("reference")
    caps = dataclasses.replace(ctx.proto.capabilities(), interventions=False)
    monkeypatch.setattr(type(ctx.proto), "capabilities", lambda self: caps)
    for cell in (*EDIT_CELLS, C.c3_noop_edit_bit_exact):
        assert C.run_cell(ctx, cell) == C.Outcome("unsupported", "unsupported: interventions")


def test_oracle_dict_must_say_why_it_has_no_gradients():
    from torchlens_conformance.zoo import EditOracle

    with pytest.raises(ValueError, match="no gradient oracle and no grads_not_applicable"):
        EditOracle.from_dict("x", {"site": "a", "forward": lambda tap, x: x, "other_args": ()})
    with pytest.raises(ValueError, match="needs all of loss, backward and grads"):
        EditOracle.from_dict("x", {"site": "a", "forward": lambda tap, x: x, "other_args": (), "loss": sum})


def test_torch_grads_cell_compares_saved_gradients_with_autograd(monkeypatch):
    pytest.importorskip("torch")
    ctx = _only(C.make_context("torch"), "mlp", "loop", "lstm")
    out = C.run_cell(ctx, C.c3_grads_match_autodiff)
    assert out.outcome == "passed", out
    assert "11 of 12 saved op gradients compared with autodiff" in out.detail, out  # lstm's fused op is untapped
    assert out.detail.endswith("every saved gradient compared for mlp, loop"), out
    real = type(ctx.proto).backward
    monkeypatch.setattr(type(ctx.proto), "backward", lambda self, t, loss, **kw: real(self, t, loss * 2, **kw))
    out = C.run_cell(ctx, C.c3_grads_match_autodiff)
    assert out.outcome == "failed" and "differs from autodiff" in out.detail, out


def test_jax_every_saved_mlp_gradient_equals_jax_grad_by_hand(monkeypatch):
    """Issue 14 acceptance: every saved op gradient of the flax and equinox MLPs equals
    `jax.grad` of the hand forward; a backward that scales the loss goes red."""
    pytest.importorskip("jax")
    ctx = _only(C.make_context("jax"), "mlp", "eqx_mlp")
    out = C.run_cell(ctx, C.c3_grads_match_autodiff)
    assert out.outcome == "passed" and out.detail.endswith("every saved gradient compared for mlp, eqx_mlp"), out
    real = type(ctx.proto).backward
    monkeypatch.setattr(type(ctx.proto), "backward",
                        lambda self, t, loss=None, **kw: real(self, t, lambda o: 2 * loss(o), **kw))
    out = C.run_cell(ctx, C.c3_grads_match_autodiff)
    assert out.outcome == "failed" and "differs from autodiff" in out.detail, out


def test_torch_edit_cells_go_red_when_replay_ignores_the_edit(edits_ignored):
    pytest.importorskip("torch")
    ctx = _only(C.make_context("torch"), "mlp", "random")
    out = C.run_cell(ctx, C.c3_edit_scale_matches_oracle)
    assert out.outcome == "failed" and "mlp: output 0 after scale" in out.detail, out


def test_highest_tier_reaches_three_only_without_failures():
    cells = {"c0_a": {"outcome": "passed"}, "c1_b": {"outcome": "passed"}, "c2_c": {"outcome": "passed"},
             "c3_d": {"outcome": "unsupported"}}
    assert highest_tier(cells) == 2
    cells["c3_e"] = {"outcome": "passed"}
    assert highest_tier(cells) == 3
    cells["c3_d"] = {"outcome": "failed"}
    assert highest_tier(cells) == 2
