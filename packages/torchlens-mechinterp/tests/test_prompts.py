"""inspect_prompt / test_prompt against the HF model's own logits, with a tiny fake tokenizer."""

from __future__ import annotations

import pytest
import torch
from mi_models import gpt2

import torchlens as tl
import torchlens_mechinterp as mi
from torchlens.errors import MechInterpError


class CharTokenizer:
    """One token per character: 'a'..'z' and ' ' map to 1..27; id 0 is BOS."""

    ALPHABET = "abcdefghijklmnopqrstuvwxyz "

    def __init__(self, bos=0, add_bos=False):
        self.bos_token_id = bos
        self.add_bos = add_bos

    def encode(self, text):
        ids = [self.ALPHABET.index(c) + 1 for c in text]
        return ([self.bos_token_id] + ids) if self.add_bos else ids

    def decode(self, ids):
        return "".join("<bos>" if i == 0 else self.ALPHABET[i - 1] if i <= 27 else f"<{i}>" for i in ids)


class NoBos(CharTokenizer):
    def __init__(self):
        super().__init__(bos=None)


def _oracle(model, ids, pos, token):
    with torch.no_grad():
        logits = model(ids).logits[0, pos].double()
    lp = torch.log_softmax(logits, -1)
    return float(lp[token]), int((logits > logits[token]).sum()) + 1


def test_test_prompt_scores_each_answer_token_teacher_forced():
    model = gpt2(layers=2)
    tok = CharTokenizer()
    got = mi.test_prompt(model, "the cat", "sat", tok)
    assert got.bos["prepended"] and got.prompt_tokens[0] == 0
    assert got.answer_tokens == tuple(tok.encode(" sat"))  # TransformerLens's leading space
    ids = torch.tensor([list(got.prompt_tokens) + list(got.answer_tokens)])
    total = 0.0
    for j, row in enumerate(got.rows):
        pos = len(got.prompt_tokens) - 1 + j
        lp, rank = _oracle(model, ids, pos, got.answer_tokens[j])
        assert row.position == pos and row.rank == rank and row.logprob == pytest.approx(lp, abs=1e-6)
        assert row.token == tok.decode([got.answer_tokens[j]])
        total += lp
    assert got.logprob == pytest.approx(total, abs=1e-6)
    assert "prepended" in str(got)


def test_bos_disclosure_covers_every_case():
    model = gpt2(layers=1)
    present = mi.test_prompt(model, "ab", "c", CharTokenizer(add_bos=True))
    assert not present.bos["prepended"] and present.bos["status"].startswith("present")
    assert present.bos["answer_bos_stripped"] and present.answer_tokens == (27, 3)  # " c", its BOS stripped
    absent = mi.test_prompt(model, "ab", "c", CharTokenizer(), prepend_bos=False)
    assert absent.prompt_tokens == (1, 2) and absent.bos["status"].startswith("absent")
    none = mi.test_prompt(model, "ab", "c", NoBos())
    assert none.prompt_tokens == (1, 2) and "nothing prepended" in none.bos["status"]
    ids = mi.test_prompt(model, [5, 6, 7], [8, 9], prepend_bos=None)
    assert ids.prompt_tokens == (5, 6, 7) and ids.answer_tokens == (8, 9) and ids.rows[0].token is None


def test_inspect_prompt_matches_the_models_logits():
    model = gpt2(layers=2)
    tok = CharTokenizer()
    ids = torch.tensor([[0] + tok.encode("abcab")])
    record = mi.inspect_prompt(tl.trace(model, ids), tok, top_k=3)
    assert record.bos["present"] and record.bos["status"].startswith("present")
    assert record.texts[0] == "<bos>" and len(record.rows) == 5
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    for row in record.rows:
        lp, rank = _oracle(model, ids, row.position, int(ids[0, row.position + 1]))
        assert row.rank == rank and row.logprob == pytest.approx(lp, abs=1e-6)
        top = torch.topk(logits[row.position], 3).indices.tolist()
        assert [t for t, _, _ in row.top] == top
    assert "BOS: present" in str(record)
    bare = mi.inspect_prompt(tl.trace(model, torch.tensor([[3, 4, 5]])))
    assert bare.bos["status"] == "no tokenizer: BOS unknown" and bare.texts == (None, None, None)


def _digest(trace):
    return [(o.label, o.saved) for o in trace._ops.values()]


@pytest.mark.parametrize("call, code", [
    (lambda m, t: mi.test_prompt(m, "ab", "c", object()), "mi_tokenizer_invalid"),
    (lambda m, t: mi.test_prompt(m, "ab", "c"), "mi_tokenizer_invalid"),
    (lambda m, t: mi.test_prompt(m, "", "c", CharTokenizer()), "mi_prompt_invalid"),
    (lambda m, t: mi.test_prompt(m, "ab", [], CharTokenizer()), "mi_prompt_invalid"),
    (lambda m, t: mi.test_prompt(m, "ab", "c", CharTokenizer(), top_k=-1), "mi_prompt_invalid"),
    (lambda m, t: mi.test_prompt(m, "ab", "c", CharTokenizer(), prepend_bos="yes"), "mi_bos_policy_invalid"),
    (lambda m, t: mi.test_prompt(m, "ab", "c", NoBos(), prepend_bos=True), "mi_bos_policy_invalid"),
    (lambda m, t: mi.inspect_prompt(t, object()), "mi_tokenizer_invalid"),
    (lambda m, t: mi.inspect_prompt(t, tokens=torch.tensor([[1, 2]])), "mi_logits_unavailable"),
    (lambda m, t: mi.inspect_prompt(t, tokens=torch.tensor([[1]])), "mi_prompt_invalid"),
])
def test_prompt_refusals_leave_the_trace_unchanged(call, code):
    model = gpt2(layers=1)
    trace = tl.trace(model, torch.tensor([[0, 1, 2, 3]]))
    before = _digest(trace)
    with pytest.raises(MechInterpError) as exc:
        call(model, trace)
    assert exc.value.code == code and exc.value.remedy
    assert _digest(trace) == before


def test_inspect_prompt_without_tokens_or_logits_refuses():
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 3))
    trace = tl.trace(mlp, torch.randn(1, 3))
    with pytest.raises(MechInterpError) as exc:
        mi.inspect_prompt(trace)
    assert exc.value.code == "mi_tokens_unavailable"
