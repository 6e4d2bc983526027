"""Facets on real torch models: every built-in facet equals an independent computation from
the module's own weights and the inputs forward hooks saw (spec/facets.md, issue 15)."""

from __future__ import annotations

import sys
from pathlib import Path

import math

import pytest
import torch

import torchlens as tl

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers next to this file
from facet_models import family as _model_of, gpt2 as _gpt2, ids as _ids, llama as _llama  # noqa: E402


def _hooked(model, modules: dict[str, torch.nn.Module], ids):
    """Run the model with forward hooks recording each module's inputs, kwargs and output."""
    seen: dict[str, dict] = {}
    handles = []
    for name, mod in modules.items():
        def hook(m, args, kwargs, out, name=name):
            seen[name] = {"args": args, "kwargs": kwargs, "out": out}
        handles.append(mod.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    return seen, logits


def _causal(scores: torch.Tensor) -> torch.Tensor:
    T, S = scores.shape[-2:]
    keep = torch.ones(T, S, dtype=torch.bool).tril()
    return scores.masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_attention_facets_equal_a_hand_computation(attn):
    model, ids = _gpt2(attn), _ids()
    blk = model.transformer.h[1]
    seen, _ = _hooked(model, {"attn": blk.attn, "c_proj": blk.attn.c_proj, "blk": blk}, ids)
    log = tl.trace(model, ids)
    f = log.modules["transformer.h.1.attn"].facets

    x = seen["attn"]["args"][0]
    B, T, E = x.shape
    H, D = 4, 8
    qkv = x @ blk.attn.c_attn.weight + blk.attn.c_attn.bias  # Conv1D keeps (in, out)
    q, k, v = (t.reshape(B, T, H, D) for t in qkv.split(E, dim=-1))
    for name, want in (("q", q), ("k", k), ("v", v)):
        assert f[name].shape == (B, T, H, D)
        assert torch.allclose(f[name].value, want, atol=1e-6), name
    scores = _causal(torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D))
    pattern = scores.softmax(-1)
    assert torch.allclose(f["pattern"].value, pattern, atol=1e-6)
    assert torch.allclose(f.pattern.value.sum(-1), torch.ones(B, H, T), atol=1e-6)
    finite = torch.isfinite(scores)
    assert torch.allclose(f["scores"].value[finite], scores[finite], atol=1e-5)
    z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
    assert torch.allclose(f["z"].value, z, atol=1e-6)
    w_o = blk.attn.c_proj.weight.reshape(H, D, E)
    result = torch.einsum("bqhd,hdm->bqhm", z, w_o)
    assert torch.allclose(f["result"].value, result, atol=1e-5)
    proj_out = seen["c_proj"]["out"]
    assert torch.allclose(f["result"].value.sum(-2) + blk.attn.c_proj.bias, proj_out, atol=1e-6)
    assert f["result"].capability == "computed" and f["q"].capability == "selection"
    assert f["z"].capability == "bijective_view"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_gqa_attention_facets_equal_a_hand_computation(attn):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, ids = _llama(attn), _ids()
    at = model.model.layers[0].self_attn
    seen, _ = _hooked(model, {"attn": at, "q": at.q_proj, "k": at.k_proj, "v": at.v_proj, "o": at.o_proj}, ids)
    log = tl.trace(model, ids)
    f = log.modules["model.layers.0.self_attn"].facets
    x = seen["attn"]["kwargs"].get("hidden_states", seen["attn"]["args"][0] if seen["attn"]["args"] else None)
    B, T, _ = x.shape
    Hq, Hkv, D = 4, 2, 8
    q = (x @ at.q_proj.weight.T).reshape(B, T, Hq, D)
    k = (x @ at.k_proj.weight.T).reshape(B, T, Hkv, D)
    v = (x @ at.v_proj.weight.T).reshape(B, T, Hkv, D)
    assert torch.allclose(f["q"].value, q, atol=1e-6)
    assert torch.allclose(f["k"].value, k, atol=1e-6) and f["k"].shape == (B, T, Hkv, D)
    assert torch.allclose(f["v"].value, v, atol=1e-6)
    cos, sin = seen["attn"]["kwargs"]["position_embeddings"]
    qr, kr = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    kr, vr = kr.repeat_interleave(Hq // Hkv, dim=1), v.transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)
    pattern = _causal(qr @ kr.transpose(-1, -2) / math.sqrt(D)).softmax(-1)
    assert torch.allclose(f["pattern"].value, pattern, atol=1e-6)
    assert torch.allclose(f["pattern"].value.sum(-1), torch.ones(B, Hq, T), atol=1e-6)
    z = (pattern @ vr).transpose(1, 2)
    assert torch.allclose(f["z"].value, z, atol=1e-6)
    result = torch.einsum("bqhd,hdm->bqhm", z, at.o_proj.weight.T.reshape(Hq, D, -1))
    assert torch.allclose(f["result"].value, result, atol=1e-5)
    assert torch.allclose(f["result"].value.sum(-2), seen["o"]["out"], atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_residual_and_mlp_facets_equal_forward_hooks(family):
    model, ids = (_gpt2("eager") if family == "gpt2" else _llama("eager")), _ids()
    blocks = model.transformer.h if family == "gpt2" else model.model.layers
    prefix = "transformer.h" if family == "gpt2" else "model.layers"
    mods = {}
    for i, b in enumerate(blocks):
        mods[f"b{i}"], mods[f"mlp{i}"] = b, b.mlp
        mods[f"attn{i}"] = b.attn if family == "gpt2" else b.self_attn
    seen, _ = _hooked(model, mods, ids)
    log = tl.trace(model, ids)
    assert [m.address for m in log.modules_with_facet("resid_post")] == [f"{prefix}.{i}" for i in range(len(blocks))]
    for i, blk in enumerate(blocks):
        f = log.modules[f"{prefix}.{i}"].facets
        rec = seen[f"b{i}"]
        pre = rec["args"][0] if rec["args"] else rec["kwargs"]["hidden_states"]
        out = rec["out"][0] if isinstance(rec["out"], tuple) else rec["out"]
        assert torch.equal(f["resid_pre"].value, pre)
        assert torch.equal(f["resid_post"].value, out)
        attn_out = seen[f"attn{i}"]["out"][0]
        assert torch.allclose(f["resid_mid"].value, pre + attn_out, atol=1e-6)
        m = log.modules[f"{prefix}.{i}.mlp"].facets
        x = seen[f"mlp{i}"]["args"][0] if seen[f"mlp{i}"]["args"] else seen[f"mlp{i}"]["kwargs"]["hidden_states"]
        with torch.no_grad():
            if family == "gpt2":
                pre_act = x @ blk.mlp.c_fc.weight + blk.mlp.c_fc.bias
                post = blk.mlp.act(pre_act)
            else:
                pre_act = x @ blk.mlp.gate_proj.weight.T
                post = torch.nn.functional.silu(pre_act) * (x @ blk.mlp.up_proj.weight.T)
        assert torch.equal(m["out"].value, seen[f"mlp{i}"]["out"])
        assert torch.allclose(m["pre"].value, pre_act, atol=1e-6)
        assert torch.allclose(m["post"].value, post, atol=1e-6)
        if family == "gpt2":
            assert m.declared()["pre_linear"] == "structurally_absent"
        else:
            assert torch.allclose(m["pre_linear"].value, x @ blk.mlp.up_proj.weight.T, atol=1e-6)


def test_parallel_block_has_no_resid_mid():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        vocab_size=64, max_position_embeddings=32, use_parallel_residual=True,
                        attn_implementation="eager")
    model = GPTNeoXForCausalLM(cfg).eval()
    log = tl.trace(model, _ids())
    f = log.modules["gpt_neox.layers.0"].facets
    assert f.declared()["resid_mid"] == "structurally_absent"
    assert "resid_mid" not in f and "resid_post" in f
    with pytest.raises(KeyError) as exc:
        f["resid_mid"]
    assert exc.value.code == "facet_structurally_absent"


def test_builtin_recipes_load_on_first_facet_use_not_at_import_or_capture():
    import subprocess
    import sys

    code = (
        "import sys, torch, torchlens as tl\n"
        "m = torch.nn.Sequential(torch.nn.Linear(2, 2))\n"
        "log = tl.trace(m, torch.ones(1, 2))\n"
        "print('capture', 'torchlens_torch.recipes' in sys.modules)\n"
        "log.modules['0'].facets.keys()\n"
        "print('facets', 'torchlens_torch.recipes' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "capture False" in out.stdout and "facets True" in out.stdout


def test_coverage_reports_recipes_statuses_and_structural_only_classes():
    model, ids = _gpt2("eager"), _ids()
    log = tl.trace(model, ids)
    cov = tl.facets.coverage(log)
    by_address = {r.address: r for r in cov.rows}
    attn = by_address["transformer.h.0.attn"]
    assert attn.recipes == ("torchlens_torch.attention",) and attn.statuses["pattern"] == "available_now"
    assert by_address["transformer.h.0.mlp"].statuses["pre_linear"] == "structurally_absent"
    assert "Dropout" in cov.structural_only_classes  # no recipe describes dropout: a recipe candidate
    assert "GPT2Attention" not in cov.structural_only_classes


def test_multihead_attention_facets_equal_a_hand_computation():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    log = tl.trace(mha, x, x, x)
    f = log.modules["self"].facets
    W, b = mha.in_proj_weight, mha.in_proj_bias
    with torch.no_grad():
        q, k, v = ((x @ W[i * 16:(i + 1) * 16].T + b[i * 16:(i + 1) * 16]).reshape(2, 5, 4, 4) for i in range(3))
        pattern = (torch.einsum("bqhd,bkhd->bhqk", q, k) / 2.0).softmax(-1)
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        out, avg = mha(x, x, x)
    for name, want in (("q", q), ("k", k), ("v", v), ("pattern", pattern), ("z", z)):
        assert torch.allclose(f[name].value, want, atol=1e-5), name
    assert torch.allclose(f["pattern"].value.mean(1), avg, atol=1e-6)  # MHA's own head-averaged weights
    result = f["result"].value
    assert torch.allclose(result.sum(-2) + mha.out_proj.bias, out, atol=1e-5)


def test_t5_block_residual_facets_equal_forward_hooks():
    """T5's residual adds live in per-sublayer wrappers: the block still gets resid_pre /
    resid_mid / resid_post, and the wrappers are not reported as blocks of their own."""
    model, args, kwargs = _model_of("t5")
    blk = model.encoder.block[0]
    seen, _ = {}, None
    h1 = blk.register_forward_hook(lambda m, a, kw, o: seen.update(pre=kw.get("hidden_states", a[0] if a else None),
                                                                   post=o[0]), with_kwargs=True)
    h2 = blk.layer[0].register_forward_hook(lambda m, a, o: seen.update(mid=o[0]))
    with torch.no_grad():
        model(*args, **kwargs)
    h1.remove()
    h2.remove()
    log = tl.trace(model, *args, input_kwargs=kwargs)
    f = log.modules["encoder.block.0"].facets
    assert torch.equal(f["resid_pre"].value, seen["pre"])
    assert torch.equal(f["resid_mid"].value, seen["mid"])
    assert torch.equal(f["resid_post"].value, seen["post"])
    blocks = [m.address for m in log.modules_with_facet("resid_post")]
    assert blocks == ["encoder.block.0", "decoder.block.0"]


def test_a_trace_stays_picklable_after_facet_access():
    import pickle

    model, ids = _gpt2("sdpa"), _ids()
    log = tl.trace(model, ids)
    f = log.modules["transformer.h.0.attn"].facets
    pattern = f["pattern"].value  # fills the facet caches (recipes, the SDPA reconstruction)
    back = pickle.loads(pickle.dumps(log))
    assert torch.equal(back.modules["transformer.h.0.attn"].facets["pattern"].value, pattern)
