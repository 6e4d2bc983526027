"""head_scores against independent computations from the HF model's own eager attention
probabilities (output_attentions=True), written with plain loops here."""

from __future__ import annotations

import pytest
import torch
from mi_models import gpt2, llama

import torchlens as tl
import torchlens_mechinterp as mi
from torchlens.errors import MechInterpError


def _repeat_probe(period: int, batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(1, vocab, (batch, period), generator=g)
    bos = torch.zeros(batch, 1, dtype=torch.long)
    return torch.cat([bos, r, r], dim=1)


def _hf_attentions(model, ids):
    with torch.no_grad():
        return model(ids, output_attentions=True).attentions  # per layer [batch, head, q, k]


def test_fixed_period_induction_equals_hf_eager_attentions_float64():
    model = gpt2(layers=4, heads=4).double()
    period, batch = 6, 3
    ids = _repeat_probe(period, batch, 64)
    trace = tl.trace(model, ids)
    got = mi.head_scores(trace, kind=mi.FixedPeriodInduction(period=period))
    attentions = _hf_attentions(model, ids)
    assert got.kind == "induction" and got.provenance["period"] == period
    assert got.scores.shape == (4, 4) and got.scores.dtype == torch.float64
    for layer, att in enumerate(attentions):
        for head in range(4):
            per_row = []
            for b in range(batch):
                vals = [float(att[b, head, i, i - period + 1]) for i in range(period, ids.shape[1])
                        if ids[b, i] == ids[b, i - period]]
                per_row.append(sum(vals) / len(vals))
            oracle = sum(per_row) / batch
            assert abs(float(got.scores[layer, head]) - oracle) < 1e-6, (layer, head)


def _tl_mul(att_bh, mask):
    num = sum(float(att_bh[i, j]) for i in range(len(mask)) for j in range(len(mask[0])) if mask[i][j])
    return num / float(att_bh.sum())


@pytest.mark.parametrize("kind", ["previous_token", "duplicate_token", "induction"])
def test_token_masks_equal_hand_written_masks(kind):
    model = gpt2(layers=2)
    ids = torch.tensor([[0, 5, 9, 5, 7, 9, 5, 11], [0, 3, 3, 4, 8, 3, 4, 2]])
    trace = tl.trace(model, ids)
    got = mi.head_scores(trace, kind=kind)
    attentions = _hf_attentions(model, ids)
    n = ids.shape[1]
    for layer, att in enumerate(attentions):
        for head in range(4):
            rows = []
            for b in range(2):
                t = ids[b].tolist()
                if kind == "previous_token":
                    mask = [[j == i - 1 for j in range(n)] for i in range(n)]
                elif kind == "duplicate_token":
                    mask = [[j < i and t[j] == t[i] for j in range(n)] for i in range(n)]
                else:
                    mask = [[1 <= j <= i and t[j - 1] == t[i] for j in range(n)] for i in range(n)]
                rows.append(_tl_mul(att[b, head], mask))
            assert abs(float(got.scores[layer, head]) - sum(rows) / 2) < 1e-6, (kind, layer, head)


def test_exclude_bos_and_current_token_follow_the_detector_convention():
    model = gpt2(layers=1)
    ids = torch.tensor([[0, 5, 5, 9, 5]])
    trace = tl.trace(model, ids)
    got = mi.head_scores(trace, kind="duplicate_token", exclude_bos=True, exclude_current_token=True)
    att = _hf_attentions(model, ids)[0][0]
    t = ids[0].tolist()
    for head in range(4):
        a = att[head].clone()
        a[:, 0] = 0
        a.fill_diagonal_(0)
        mask = [[j < i and t[j] == t[i] for j in range(5)] for i in range(5)]
        assert abs(float(got.scores[0, head]) - _tl_mul(a, mask)) < 1e-6


def test_gqa_model_scores_every_query_head():
    model = llama(layers=2)
    ids = _repeat_probe(4, 1, 64)
    got = mi.head_scores(tl.trace(model, ids), kind=mi.FixedPeriodInduction(period=4))
    assert got.scores.shape == (2, 4)
    assert got.top(2)[0][2] >= got.top(2)[1][2]


@pytest.mark.parametrize("period", [0, -1, 2.0, True, "3"])
def test_period_must_be_a_positive_int(period):
    with pytest.raises(MechInterpError) as exc:
        mi.FixedPeriodInduction(period=period)
    assert exc.value.code == "mi_period_invalid" and exc.value.remedy


def _digest(trace):
    return [(o.label, o.saved) for o in trace._ops.values()]


@pytest.mark.parametrize("call, code", [
    (lambda t: mi.head_scores(t, kind="nope"), "mi_head_scores_kind_unknown"),
    (lambda t: mi.head_scores(t, kind="induction", exclude_bos=1), "mi_head_scores_setting_invalid"),
    (lambda t: mi.head_scores(t, kind=mi.FixedPeriodInduction(3), exclude_bos=True), "mi_head_scores_setting_invalid"),
    (lambda t: mi.head_scores(t, kind=mi.FixedPeriodInduction(3)), "mi_period_no_queries"),
    (lambda t: mi.head_scores(t, tokens=torch.zeros(1, 3, dtype=torch.long)), "mi_tokens_mismatched"),
])
def test_refusals_leave_the_trace_unchanged(call, code):
    model = gpt2(layers=1)
    trace = tl.trace(model, torch.tensor([[0, 1, 2, 3, 4, 5, 6]]))
    before = _digest(trace)
    with pytest.raises(MechInterpError) as exc:
        call(trace)
    assert exc.value.code == code and exc.value.remedy
    assert _digest(trace) == before


def test_missing_patterns_refuse_with_every_missing_payload():
    model = gpt2(layers=2)
    ids = torch.tensor([[0, 1, 2, 1, 2]])
    full = tl.trace(model, ids)
    homes = sorted(c.facets["pattern"].spec.home for c in full.attention_blocks())
    trace = tl.trace(model, ids, save=["transformer.h.0.ln_1"])
    before = _digest(trace)
    with pytest.raises(MechInterpError) as exc:
        mi.head_scores(trace, kind="induction")
    assert exc.value.code == "mi_payloads_missing"
    assert set(homes) <= set(exc.value.fields["missing"])
    assert trace.input_ops[0].label in exc.value.fields["missing"]  # the tokens too: the COMPLETE set
    assert set(exc.value.fields["missing"]) == set(mi.scores.head_scores_sites(full))
    assert _digest(trace) == before


def test_no_attention_and_no_tokens_refuse():
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 3))
    trace = tl.trace(mlp, torch.randn(1, 3))
    with pytest.raises(MechInterpError) as exc:
        mi.head_scores(trace)
    assert exc.value.code == "mi_no_attention"
    model = gpt2(layers=1)
    ids = torch.tensor([[0, 1, 2, 1]])
    homes = [b.facets["pattern"].spec.home for b in tl.trace(model, ids).attention_blocks()]
    trace = tl.trace(model, ids, save=homes)
    assert not trace.input_ops[0].saved
    with pytest.raises(MechInterpError) as exc:
        mi.head_scores(trace)
    assert exc.value.code == "mi_payloads_missing" and exc.value.fields["missing"] == [trace.input_ops[0].label]

    class FromEmbeddings(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, emb):
            return self.lm(inputs_embeds=emb).logits

    emb = model.transformer.wte(ids).detach()
    wrapped = tl.trace(FromEmbeddings(model), emb)
    with pytest.raises(MechInterpError) as exc:
        mi.head_scores(wrapped)
    assert exc.value.code == "mi_tokens_unavailable"
    assert mi.head_scores(wrapped, tokens=ids).scores.shape == (1, 4)
    assert mi.head_scores(trace, tokens=ids).scores.shape == (1, 4)


def test_the_appliance_serves_head_scores_bound_to_the_trace():
    trace = tl.trace(gpt2(layers=1), torch.tensor([[0, 1, 2, 1, 2]]))
    bound = trace.using("mechinterp").head_scores(kind="previous_token")
    assert torch.equal(bound.scores, mi.head_scores(trace, kind="previous_token").scores)
    assert torch.equal(tl.mechinterp.head_scores(trace, kind="previous_token").scores, bound.scores)


def test_fused_sdpa_scores_equal_the_eager_oracle():
    sdpa = gpt2(layers=2, attn="sdpa").double()
    eager = gpt2(layers=2, attn="eager").double()
    ids = _repeat_probe(5, 2, 64, seed=3)
    got = mi.head_scores(tl.trace(sdpa, ids), kind=mi.FixedPeriodInduction(period=5))
    attentions = _hf_attentions(eager, ids)
    for layer, att in enumerate(attentions):
        for head in range(4):
            oracle = sum(float(att[b, head, i, i - 4]) for b in range(2) for i in range(6, 11)) / 10
            assert abs(float(got.scores[layer, head]) - oracle) < 1e-6


class _TinyAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


@tl.facets.recipe(class_name="_TinyAttention")
def _q_only(module):
    return {"q": tl.facets.child_output_spec(module, "qkv", "q_only").split(3, dim=-1)[0].heads(2)}


def test_an_attention_without_a_pattern_facet_refuses():
    with tl.facets.adding(_q_only):
        trace = tl.trace(_TinyAttention().eval(), torch.randn(1, 5, 8))
    before = _digest(trace)
    with pytest.raises(MechInterpError) as exc:
        mi.head_scores(trace, tokens=torch.zeros(1, 5, dtype=torch.long))
    assert exc.value.code == "mi_facet_absent" and exc.value.remedy
    assert _digest(trace) == before


def test_a_pattern_the_capture_cannot_reconstruct_refuses():
    model = gpt2(layers=1, attn="sdpa").train()  # SDPA with dropout: its mask is not reconstructed
    trace = tl.trace(model, torch.tensor([[0, 1, 2, 1, 2]]))
    with pytest.raises(MechInterpError) as exc:
        mi.head_scores(trace)
    assert exc.value.code == "mi_facet_needs_capture" and "dropout" in exc.value.remedy


def test_layers_with_different_head_counts_refuse():
    model = gpt2(layers=2)
    attn = model.transformer.h[1].attn
    attn.num_heads, attn.head_dim = 2, 16  # layer 1 now splits d_model into 2 heads
    trace = tl.trace(model, torch.tensor([[0, 1, 2, 1, 2]]))
    with pytest.raises(MechInterpError) as exc:
        mi.head_scores(trace)
    assert exc.value.code == "mi_head_counts_differ" and exc.value.fields["heads"] == [2, 4]
