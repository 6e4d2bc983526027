"""Attention, residual and MLP facets of nine more HF families (Mistral, Qwen2, Phi-3, OPT,
GPT-NeoX, BERT, T5, ViT, CLIP), each equal to a hand computation from the module's own
weights and the inputs forward hooks saw (issue 15 acceptance).

For every family (random init from a tiny config, eager and SDPA): q, k, v from the
projection weights; RoPE (where the family rotates) applied by hand from the cos/sin the
module received; scores, pattern (rows sum to 1) and z from those; the per-head result from
W_O, and the heads summed plus the bias equal the output projection's captured output.
resid_pre / resid_mid / resid_post equal forward hooks on the block; MLP pre / pre_linear /
post from the MLP's weights, out equal to its hooked output.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import torchlens as tl

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers next to this file
from facet_models import family  # noqa: E402


def _lin(x: torch.Tensor, mod: torch.nn.Linear) -> torch.Tensor:
    y = x @ mod.weight.T
    return y if mod.bias is None else y + mod.bias


def _heads(t: torch.Tensor, d: int) -> torch.Tensor:
    return t.reshape(*t.shape[:-1], t.shape[-1] // d, d)


def _separate(q: str, k: str, v: str) -> Callable:
    def qkv(at, x, kv, d):
        return (_heads(_lin(x, getattr(at, q)), d), _heads(_lin(kv, getattr(at, k)), d),
                _heads(_lin(kv, getattr(at, v)), d))
    return qkv


def _phi3_qkv(at, x, kv, d):
    """Phi-3 packs [q | k | v] column blocks in one Linear (GQA: k and v are narrower)."""
    out = _lin(x, at.qkv_proj)
    nq = at.config.num_attention_heads * d
    nkv = at.config.num_key_value_heads * d
    return _heads(out[..., :nq], d), _heads(out[..., nq:nq + nkv], d), _heads(out[..., nq + nkv:], d)


def _neox_qkv(at, x, kv, d):
    """GPT-NeoX interleaves per head: each head's 3*d columns are [q_h | k_h | v_h]."""
    per_head = _heads(_lin(x, at.query_key_value), 3 * d)
    return per_head[..., :d], per_head[..., d:2 * d], per_head[..., 2 * d:]


@dataclass(frozen=True)
class Case:
    attn: str  # the attention module's address
    out_proj: str  # the output projection's address
    qkv: Callable[..., Any]
    mask: str  # "causal" | "none"
    scale: float | None = None  # None: d_head ** -0.5
    bias: str | None = None  # "t5": the relative position bias the module returned is added to the scores


_LM = dict(mask="causal")
CASES: dict[str, list[Case]] = {
    "mistral": [Case("model.layers.0.self_attn", "model.layers.0.self_attn.o_proj",
                     _separate("q_proj", "k_proj", "v_proj"), **_LM)],
    "qwen2": [Case("model.layers.0.self_attn", "model.layers.0.self_attn.o_proj",
                   _separate("q_proj", "k_proj", "v_proj"), **_LM)],
    "phi3": [Case("model.layers.0.self_attn", "model.layers.0.self_attn.o_proj", _phi3_qkv, **_LM)],
    "opt": [Case("model.decoder.layers.0.self_attn", "model.decoder.layers.0.self_attn.out_proj",
                 _separate("q_proj", "k_proj", "v_proj"), **_LM)],
    "gpt_neox": [Case("gpt_neox.layers.0.attention", "gpt_neox.layers.0.attention.dense", _neox_qkv, **_LM)],
    # BERT's output projection lives in the sibling BertSelfOutput, outside the attention module
    "bert": [Case("encoder.layer.0.attention.self", "encoder.layer.0.attention.output.dense",
                  _separate("query", "key", "value"), mask="none")],
    "t5": [Case("encoder.block.0.layer.0.SelfAttention", "encoder.block.0.layer.0.SelfAttention.o",
                _separate("q", "k", "v"), mask="none", scale=1.0, bias="t5"),
           Case("decoder.block.0.layer.0.SelfAttention", "decoder.block.0.layer.0.SelfAttention.o",
                _separate("q", "k", "v"), mask="causal", scale=1.0, bias="t5"),
           Case("decoder.block.0.layer.1.EncDecAttention", "decoder.block.0.layer.1.EncDecAttention.o",
                _separate("q", "k", "v"), mask="none", scale=1.0, bias="t5")],
    "vit": [Case("layers.0.attention", "layers.0.attention.o_proj", _separate("q_proj", "k_proj", "v_proj"),
                 mask="none")],
    "clip": [Case("text_model.encoder.layers.0.self_attn", "text_model.encoder.layers.0.self_attn.out_proj",
                  _separate("q_proj", "k_proj", "v_proj"), mask="causal"),
             Case("vision_model.encoder.layers.0.self_attn", "vision_model.encoder.layers.0.self_attn.out_proj",
                  _separate("q_proj", "k_proj", "v_proj"), mask="none")],
}

BLOCKS = {"mistral": ["model.layers.0"], "qwen2": ["model.layers.0"], "phi3": ["model.layers.0"],
          "opt": ["model.decoder.layers.0"], "gpt_neox": ["gpt_neox.layers.0"], "bert": ["encoder.layer.0"],
          "t5": ["encoder.block.0", "decoder.block.0"], "vit": ["layers.0"],
          "clip": ["text_model.encoder.layers.0", "vision_model.encoder.layers.0"]}

# resid_mid: ("add", attention module) -> block input + that module's output; ("out", module) -> the output
# of the module ending the first sublayer (T5's residual wrapper; BERT's post-norm BertAttention);
# None: a parallel block has no post-attention add (absent, not guessed)
MIDS = {"mistral": [("add", "model.layers.0.self_attn")], "qwen2": [("add", "model.layers.0.self_attn")],
        "phi3": [("add", "model.layers.0.self_attn")], "opt": [("add", "model.decoder.layers.0.self_attn")],
        "gpt_neox": [None], "bert": [("out", "encoder.layer.0.attention")],
        "t5": [("out", "encoder.block.0.layer.0"), ("out", "decoder.block.0.layer.0")],
        "vit": [("add", "layers.0.attention")],
        "clip": [("add", "text_model.encoder.layers.0.self_attn"), ("add", "vision_model.encoder.layers.0.self_attn")]}

FAMILIES = list(CASES)


def _record(model, addresses, args, kwargs) -> dict[str, dict]:
    """Run the model once with forward hooks recording each module's args, kwargs and output."""
    seen: dict[str, dict] = {}
    mods = dict(model.named_modules())
    handles = []
    for a in addresses:
        def hook(m, a_, kw, out, a=a):
            seen[a] = {"args": a_, "kwargs": kw, "out": out}
        handles.append(mods[a].register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen


def _input(rec: dict, name: str = "hidden_states") -> Any:
    return rec["kwargs"][name] if name in rec["kwargs"] else rec["args"][0]


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] features of `t` ((B, H, T, D)) the rotate-half way."""
    r = cos.shape[-1]
    x, rest = t[..., :r], t[..., r:]
    x1, x2 = x[..., : r // 2], x[..., r // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1), rest), dim=-1)


def _hand(case: Case, model, rec: dict, d: int) -> dict[str, torch.Tensor]:
    at = model.get_submodule(case.attn)
    x = _input(rec)
    kv = rec["kwargs"].get("key_value_states")
    kv = x if kv is None else kv
    with torch.no_grad():
        q, k, v = case.qkv(at, x, kv, d)  # (B, T, H, D)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        pe = rec["kwargs"].get("position_embeddings")
        if pe is not None:
            qh, kh = _rope(qh, *pe), _rope(kh, *pe)
        rep = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
        scale = d ** -0.5 if case.scale is None else case.scale
        scores = qh @ kh.transpose(-1, -2) * scale
        if case.bias == "t5":
            scores = scores + rec["out"][1]  # the relative position bias the module computed and returned
        if case.mask == "causal":
            T, S = scores.shape[-2:]
            scores = scores.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(), float("-inf"))
        pattern = scores.softmax(-1)
        z = (pattern @ vh).transpose(1, 2)
        w_o = model.get_submodule(case.out_proj).weight  # (d_model, H * D)
        result = torch.einsum("bqhd,hdm->bqhm", z, w_o.T.reshape(z.shape[-2], d, -1))
    return {"q": q, "k": k, "v": v, "scores": scores, "pattern": pattern, "z": z, "result": result}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", FAMILIES)
def test_attention_facets_equal_a_hand_computation(name, attn):
    model, args, kwargs = family(name, attn)
    cases = CASES[name]
    seen = _record(model, [c.attn for c in cases] + [c.out_proj for c in cases], args, kwargs)
    log = tl.trace(model, *args, input_kwargs=kwargs)
    for case in cases:
        f = log.modules[case.attn].facets
        d = int(f["q"].shape[-1])
        want = _hand(case, model, seen[case.attn], d)
        B, T = want["q"].shape[:2]
        H = want["q"].shape[2]
        for n in ("q", "k", "v", "z", "pattern", "result"):
            got = f[n].value
            assert got.shape == want[n].shape, (case.attn, n, got.shape, want[n].shape)
            assert torch.allclose(got, want[n], atol=1e-5, rtol=1e-4), (case.attn, n, (got - want[n]).abs().max())
        assert torch.allclose(f["pattern"].value.sum(-1), torch.ones(B, H, T), atol=1e-5)
        s, hand = f["scores"].value, want["scores"]
        finite = torch.isfinite(hand)
        assert torch.allclose(s[finite], hand[finite], atol=1e-5, rtol=1e-4), case.attn
        assert bool((s[~finite] < -1e30).all()), case.attn  # masked: -inf (SDPA) or the dtype's min (eager)
        out_proj = model.get_submodule(case.out_proj)
        captured = seen[case.out_proj]["out"]
        total = f["result"].value.sum(-2) + (0 if out_proj.bias is None else out_proj.bias)
        assert torch.allclose(total, captured, atol=1e-6), (case.attn, (total - captured).abs().max())


@pytest.mark.parametrize("name", FAMILIES)
def test_residual_facets_equal_forward_hooks_on_the_block(name):
    model, args, kwargs = family(name, "eager")
    blocks = BLOCKS[name]
    seen = _record(model, blocks + [m[1] for m in MIDS[name] if m], args, kwargs)
    log = tl.trace(model, *args, input_kwargs=kwargs)
    assert [m.address for m in log.modules_with_facet("resid_post")] == blocks
    first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
    for b, mid in zip(blocks, MIDS[name]):
        f = log.modules[b].facets
        rec = seen[b]
        assert torch.equal(f["resid_pre"].value, _input(rec)), b
        assert torch.equal(f["resid_post"].value, first(rec["out"])), b
        if mid is None:
            assert f.declared()["resid_mid"] == "structurally_absent" and "resid_mid" not in f
        elif mid[0] == "add":
            assert torch.allclose(f["resid_mid"].value, _input(rec) + first(seen[mid[1]]["out"]), atol=1e-6), b
        else:
            assert torch.equal(f["resid_mid"].value, first(seen[mid[1]]["out"])), b


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gated(gate: str, up: str) -> Callable:
    def parts(mlp, x):
        g, u = _lin(x, getattr(mlp, gate)), _lin(x, getattr(mlp, up))
        return g, u, torch.nn.functional.silu(g) * u
    return parts


def _phi3_mlp(mlp, x):
    g, u = _lin(x, mlp.gate_up_proj).chunk(2, dim=-1)  # one fused projection: [gate | up]
    return g, u, torch.nn.functional.silu(g) * u


def _plain(fc: str, act: Callable) -> Callable:
    def parts(mlp, x):
        pre = _lin(x, getattr(mlp, fc))
        return pre, None, act(pre)
    return parts


_gelu = torch.nn.functional.gelu
#: family -> [(MLP module address, parts(mlp, x) -> (pre, pre_linear or None, post))]; [] where no one module is
#: the MLP (OPT runs fc1/fc2 in the decoder layer itself; BERT splits it over BertIntermediate and BertOutput)
MLPS = {
    "mistral": [("model.layers.0.mlp", _gated("gate_proj", "up_proj"))],
    "qwen2": [("model.layers.0.mlp", _gated("gate_proj", "up_proj"))],
    "phi3": [("model.layers.0.mlp", _phi3_mlp)],
    "opt": [], "bert": [],
    "gpt_neox": [("gpt_neox.layers.0.mlp", _plain("dense_h_to_4h", _gelu))],
    "t5": [("encoder.block.0.layer.1.DenseReluDense", _plain("wi", torch.relu)),
           ("decoder.block.0.layer.2.DenseReluDense", _plain("wi", torch.relu))],
    "vit": [("layers.0.mlp", _plain("fc1", _gelu))],
    "clip": [("text_model.encoder.layers.0.mlp", _plain("fc1", _quick_gelu)),
             ("vision_model.encoder.layers.0.mlp", _plain("fc1", _quick_gelu))],
}


@pytest.mark.parametrize("name", FAMILIES)
def test_mlp_facets_equal_a_hand_computation(name):
    """pre (the activation's input; a gated MLP's gate), pre_linear (the gated MLP's other
    projection), post (what the output projection reads) from the module's own weights and
    the input a forward hook saw; out equals the hooked output. No MLP module: no facets."""
    model, args, kwargs = family(name, "eager")
    mlps = MLPS[name]
    seen = _record(model, [a for a, _ in mlps], args, kwargs)
    log = tl.trace(model, *args, input_kwargs=kwargs)
    assert [m.address for m in log.modules_with_facet("post")] == [a for a, _ in mlps]
    for address, parts in mlps:
        f = log.modules[address].facets
        rec = seen[address]
        with torch.no_grad():
            pre, pre_linear, post = parts(model.get_submodule(address), _input(rec))
        assert torch.allclose(f["pre"].value, pre, atol=1e-5), address
        assert torch.allclose(f["post"].value, post, atol=1e-5), address
        assert torch.equal(f["out"].value, rec["out"]), address
        if pre_linear is None:
            assert f.declared()["pre_linear"] == "structurally_absent"
        else:
            assert torch.allclose(f["pre_linear"].value, pre_linear, atol=1e-5), address
            assert f["pre"].capability in ("bijective_view", "selection")  # writable: a real op's (split) output
