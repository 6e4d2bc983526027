"""The logit lens on a `logits_to_keep` capture, and a user lens's `model_identity`
(spec/facets.md "User lens identity"; experimental)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import torchlens as tl

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers next to this file
from facet_models import gpt2, ids, llama  # noqa: E402


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_logits_to_keep_capture_validates_on_the_positions_it_kept(family):
    """HF generate-style `logits_to_keep=1`: the captured logits hold the last position only.
    The lens validates there; the native row covers that position alone and a requested
    position it did not keep is dropped from it, not invented."""
    model = gpt2("eager") if family == "gpt2" else llama("sdpa")
    x = ids()
    with torch.no_grad():
        full = model(x).logits
    log = tl.trace(model, x, input_kwargs={"logits_to_keep": 1})
    assert log.modules["lm_head"].facets["out"].shape == (2, 1, 64)
    result = tl.lens.logit_lens(log)
    assert result.validated and result.max_abs_error < 1e-4
    assert torch.allclose(result.entries[-1].logits, full, atol=1e-5)  # every position, projected from resid_post
    preds = tl.lens.logit_lens_predictions(log, k=3, positions=[0, -1])
    *projected, native = preds.rows
    assert [r.positions for r in projected] == [(0, -1)] * len(projected)
    assert native.provenance == "native output" and native.positions == (-1,)
    assert (native.top_ids[:, 0, 0] == full[:, -1].argmax(-1).numpy()).all()
    assert (projected[-1].top_ids[:, :, 0] == full[:, [0, -1]].argmax(-1).numpy()).all()
    everything = tl.lens.logit_lens_predictions(log, k=1)
    assert everything.rows[-1].positions == (6,)  # the native row's one kept position, counted in the sequence


def _bad_lens(x):
    return torch.zeros(*x.shape[:-1], 64)


def test_a_lens_with_the_traced_models_identity_runs_silently():
    model = gpt2("eager")
    log = tl.trace(model, ids())
    lens = tl.lens.head_projection(log)
    ident = tl.lens.model_identity(log)
    assert ident["kind"] == "measured" and ident["model_class"] == "GPT2LMHeadModel" and ident["param_hash_full"]

    def mine(x):
        return lens(x)
    mine.model_identity = ident
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = tl.lens.logit_lens(log, lens=mine)
    assert result.extra["identity"] == "match" and result.lens_source == "user_lens"


def test_a_lens_built_for_another_model_refuses_unless_verify_is_off():
    model, other = gpt2("eager"), gpt2("eager")
    with torch.no_grad():
        other.lm_head.weight.mul_(2)  # tied: other weights, same class
    log = tl.trace(model, ids())
    foreign = tl.lens.model_identity(tl.trace(other, ids()))
    assert foreign["param_hash_full"] != tl.lens.model_identity(log)["param_hash_full"]
    lens = tl.lens.head_projection(log)

    def fitted_elsewhere(x):
        return lens(x)
    fitted_elsewhere.model_identity = foreign
    with pytest.raises(tl.errors.LogitLensError) as exc:
        tl.lens.logit_lens(log, lens=fitted_elsewhere)
    assert exc.value.code == "logit_lens_identity_mismatch" and exc.value.fields["differing"] == ["param_hash_full"]
    with pytest.raises(tl.errors.LogitLensError):
        tl.lens.logit_lens_predictions(log, lens=fitted_elsewhere)
    assert tl.lens.logit_lens(log, lens=fitted_elsewhere, verify=False).extra["identity"] == "mismatch"
    # a per-layer mapping carries identities on its callables
    per_layer = {m.address: fitted_elsewhere for m in log.modules_with_facet("resid_post")}
    with pytest.raises(tl.errors.LogitLensError):
        tl.lens.logit_lens(log, lens=per_layer)


def test_a_lens_without_a_comparable_identity_gets_the_last_layer_agreement_check():
    model = gpt2("eager")
    log = tl.trace(model, ids())
    good = tl.lens.head_projection(log)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reproduces the captured logits: silent
        assert tl.lens.logit_lens(log, lens=good).extra["identity"] == "unrecorded"
    with pytest.warns(tl.errors.LogitLensWarning) as rec:
        tl.lens.logit_lens(log, lens=_bad_lens)
    w = rec[0].message
    assert w.code == "logit_lens_identity_unrecorded" and w.fields["max_abs_error"] > 0.1
    assert 0.0 <= w.fields["top1_agreement"] < 1.0

    def asserted(x):
        return _bad_lens(x)
    asserted.model_identity = {"kind": "asserted", "name": "gpt2"}  # a claim, not comparable
    with pytest.warns(tl.errors.LogitLensWarning):
        tl.lens.logit_lens_predictions(log, lens=asserted)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tl.lens.logit_lens(log, lens=_bad_lens, validate=False)  # validate=False: no identity check at all


def test_a_logits_to_keep_of_other_positions_refuses_typed():
    """`logits_to_keep` as a tensor of positions (not the last n): the lens cannot tell which
    positions the captured logits are, so validation refuses instead of mislabelling."""
    model, x = gpt2("eager"), ids()
    log = tl.trace(model, x, input_kwargs={"logits_to_keep": torch.tensor([0, 2])})
    assert log.modules["lm_head"].facets["out"].shape == (2, 2, 64)
    for run in (tl.lens.logit_lens, tl.lens.logit_lens_predictions):
        with pytest.raises(tl.errors.LogitLensError) as exc:
            run(log)
        assert exc.value.code == "logit_lens_verification_failed" and "logits_to_keep" in exc.value.remedy
    assert len(tl.lens.logit_lens(log, verify=False).entries) == 2  # trusted explicitly
