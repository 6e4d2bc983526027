"""residual_decomposition: the oracle checked against forward hooks (independent of the kit)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl
import torchlens_mechinterp as mi
from mi_models import BUILDERS, assert_unchanged, ids, snapshot
from torchlens.errors import MechInterpError

#: (blocks, attention attribute, MLP attribute, final-norm path) per family
LAYOUT = {
    "gpt2": (lambda m: m.transformer.h, "attn", "mlp", lambda m: m.transformer.ln_f),
    "llama": (lambda m: m.model.layers, "self_attn", "mlp", lambda m: m.model.norm),
    "mistral": (lambda m: m.model.layers, "self_attn", "mlp", lambda m: m.model.norm),
    "neox": (lambda m: m.gpt_neox.layers, "attention", "mlp", lambda m: m.gpt_neox.final_layer_norm),
}


def _hooked(family: str, model, x):
    """Attention / MLP outputs, block outputs and the final norm's input, from forward hooks."""
    blocks, attn, mlp, norm = LAYOUT[family]
    seen: dict[str, list] = {"attn": [], "mlp": [], "block": [], "norm_in": []}
    hs = []
    for blk in blocks(model):
        hs.append(getattr(blk, attn).register_forward_hook(
            lambda m, a, o: seen["attn"].append(o[0] if isinstance(o, tuple) else o)))
        hs.append(getattr(blk, mlp).register_forward_hook(lambda m, a, o: seen["mlp"].append(o)))
        hs.append(blk.register_forward_hook(lambda m, a, o: seen["block"].append(o[0] if isinstance(o, tuple) else o)))
    hs.append(norm(model).register_forward_pre_hook(lambda m, a: seen["norm_in"].append(a[0])))
    with torch.no_grad():
        model(x)
    for h in hs:
        h.remove()
    return seen


@pytest.mark.parametrize("family", ["gpt2", "llama", "neox", "mistral"])
def test_partial_sums_equal_spine_states_under_torch_equal(family):
    model, x = BUILDERS[family](2), ids(6, batch=2)
    trace = tl.trace(model, x)
    stack = mi.residual_decomposition(trace)
    seen = _hooked(family, model, x)
    assert stack.grade == "complete" and not stack.diagnostic_only
    assert stack.rows[0].name == "embed"
    writers = stack.rows[1:]
    if family == "neox":  # parallel blocks: one writer per block, the attention + MLP sum
        assert len(writers) == 2 and all(len(r.parts) == 2 for r in writers)
        for i, r in enumerate(writers):
            assert torch.equal(r.value, seen["mlp"][i] + seen["attn"][i])
    else:
        assert [r.component for r in writers] == ["attn", "mlp"] * 2
        for i in range(2):
            assert torch.equal(writers[2 * i].value, seen["attn"][i])
            assert torch.equal(writers[2 * i + 1].value, seen["mlp"][i])
    # partial sums, accumulated here in execution order, equal the block outputs under torch.equal
    acc = stack.rows[0].value
    per_block = 1 if family == "neox" else 2
    for i in range(2):
        for r in writers[per_block * i: per_block * (i + 1)]:
            acc = acc + r.value
        assert torch.equal(acc, seen["block"][i]), i
    assert torch.equal(acc, seen["norm_in"][0])
    assert torch.equal(stack.total(), seen["norm_in"][0])
    assert stack.receipt["oracle"] == "torch.equal" and stack.receipt["degrade"] is None
    for step in stack.steps:  # pass-qualified labels and live site keys
        assert trace._ops[step.label].site == step.site and trace._ops[step.label].func_name == "add"


class _Rescaled(nn.Module):
    """A causal-LM shape whose residual stream is rescaled each block: x = 0.5 * x + f(x)."""

    def __init__(self, vocab=32, d=16, hop=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.f = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.hop = hop

    def forward(self, ids):
        x = self.embed(ids)
        for f in self.f:
            x = (x + f(x)) if self.hop else 0.5 * x + f(x)
            if self.hop:
                x = x.to(torch.bfloat16).to(torch.float32)  # a lossy "value-preserving" hop
        return self.lm_head(self.norm(x))


def test_rescaled_residual_refuses_and_leaves_the_trace_unchanged():
    torch.manual_seed(0)
    trace = tl.trace(_Rescaled().eval(), torch.randint(0, 32, (1, 5)))
    snap = snapshot(trace)
    with pytest.raises(MechInterpError) as exc:
        mi.residual_decomposition(trace)
    assert exc.value.code == "mi_residual_rescaled" and exc.value.remedy
    assert_unchanged(trace, snap)
    diag = mi.residual_decomposition(trace, strict=False)
    assert diag.grade == "closed_unresolved" and diag.diagnostic_only
    assert diag.rows[0].kind == "unresolved_remainder"
    with pytest.raises(MechInterpError) as exc:
        mi.direct_logit_contributions(trace, answer=1, stack=diag)
    assert exc.value.code == "mi_stack_diagnostic_only"
    assert_unchanged(trace, snap)


def test_lossy_hop_on_the_spine_refuses_unverified():
    torch.manual_seed(0)
    trace = tl.trace(_Rescaled(hop=True).eval(), torch.randint(0, 32, (1, 5)))
    snap = snapshot(trace)
    with pytest.raises(MechInterpError) as exc:
        mi.residual_decomposition(trace)
    assert exc.value.code == "mi_residual_hop_unverified"
    assert trace._ops[exc.value.fields["label"]].func_name == "to"
    assert_unchanged(trace, snap)


def test_open_stack_never_constructs():
    from torchlens_mechinterp.stack import StackRow

    row = StackRow("embed", "writer", torch.zeros(2))
    with pytest.raises(MechInterpError) as exc:
        mi.ComponentStack(rows=[row], grade="open")
    assert exc.value.code == "mi_stack_open"
    with pytest.raises(MechInterpError):  # a remainder row needs the diagnostic grade
        mi.ComponentStack(rows=[StackRow("r", "unresolved_remainder", torch.zeros(2))], grade="complete")


def test_no_language_model_head_refuses():
    trace = tl.trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), torch.randn(1, 4))
    snap = snapshot(trace)
    with pytest.raises(MechInterpError) as exc:
        mi.residual_decomposition(trace)
    assert exc.value.code == "mi_lm_head_unavailable"
    assert_unchanged(trace, snap)


def test_appliance_serves_the_same_stack():
    model, x = BUILDERS["gpt2"](1), ids(5)
    trace = tl.trace(model, x)
    a, b = trace.using("mechinterp").residual_decomposition(), mi.residual_decomposition(trace)
    assert a.names == b.names and all(torch.equal(r.value, s.value) for r, s in zip(a, b))


def test_a_failing_oracle_refuses_open_and_strict_false_keeps_a_remainder(monkeypatch):
    import torchlens_mechinterp.residual as residual_module

    model, x = BUILDERS["gpt2"](2), ids(5)
    trace = tl.trace(model, x)
    snap = snapshot(trace)
    first = trace._ops[mi.residual_decomposition(trace).steps[2].label]
    real = residual_module._same
    # the oracle sees the third spine state differ (as a non-replayable add would)
    monkeypatch.setattr(residual_module, "_same", lambda a, b: False if b is first.out else real(a, b))
    with pytest.raises(MechInterpError) as exc:
        mi.residual_decomposition(trace)
    assert exc.value.code == "mi_residual_open" and exc.value.fields["label"] == first.label
    assert_unchanged(trace, snap)
    diag = mi.residual_decomposition(trace, strict=False)
    assert diag.grade == "closed_unresolved" and diag.rows[-1].kind == "unresolved_remainder"
    assert len(diag) == 3 + 1  # embed + the two writers checked, then the remainder of the rest
    assert torch.allclose(diag.total(), trace._ops[diag.target_label].out, atol=1e-6)


class _Looped(nn.Module):
    """One block applied three times: its ops are multi-pass (pass-qualified labels)."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.ln, self.f = nn.LayerNorm(d), nn.Linear(d, d)
        self.norm, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for _ in range(3):
            x = x + self.f(self.ln(x))
        return self.lm_head(self.norm(x))


def test_a_looped_block_gives_pass_qualified_steps():
    torch.manual_seed(0)
    model, x = _Looped().eval(), torch.randint(0, 32, (1, 5))
    trace = tl.trace(model, x)
    stack = mi.residual_decomposition(trace)
    outs = []
    hook = model.f.register_forward_hook(lambda m, a, o: outs.append(o))
    with torch.no_grad():
        model(x)
    hook.remove()
    assert [s.label.split(":")[-1] for s in stack.steps] == ["1", "2", "3"]
    assert stack.names == ["embed", "f:1", "f:2", "f:3"]
    assert all(torch.equal(r.value, o) for r, o in zip(stack.rows[1:], outs))


class _WithStreamParams(nn.Module):
    """A learned position table added to the embedding and a bias added mid-stream."""

    def __init__(self, vocab=32, d=16, seq=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d))
        self.stream_bias = nn.Parameter(torch.randn(d))
        self.f, self.g = nn.Linear(d, d), nn.Linear(d, d)
        self.norm, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids) + self.pos
        x = x + self.f(x)
        x = x + self.stream_bias
        x = x + self.g(x)
        return self.lm_head(self.norm(x))


def test_parameters_added_to_the_stream_are_constant_rows():
    torch.manual_seed(0)
    model, x = _WithStreamParams().eval(), torch.randint(0, 32, (1, 5))
    trace = tl.trace(model, x)
    stack = mi.residual_decomposition(trace)
    assert stack.grade == "closed_constant"
    assert stack.names == ["embed", "pos", "f", "stream_bias", "g"]
    assert [r.kind for r in stack] == ["writer", "constant", "writer", "constant", "writer"]
    seen = []
    hook = model.norm.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(x)
    hook.remove()
    assert torch.equal(stack.total(), seen[0])
    res = mi.direct_logit_contributions(trace, answer=[2, 3])
    assert res.names == stack.names and res.identity_receipt["verified"]
