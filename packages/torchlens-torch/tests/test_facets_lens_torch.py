"""The logit lens (tl.lens, experimental): each block's resid_post through the model's own
final norm + unembedding, checked against the model run by hand; the last-layer row equals
the model's real logits; a (1 + weight) RMSNorm head (Gemma-style) refuses."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl

tf = pytest.importorskip("transformers")


def _lm(name: str):
    torch.manual_seed(0)
    common = dict(vocab_size=64, max_position_embeddings=32)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                                bos_token_id=0, eos_token_id=0)).eval()
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **small, **common)).eval()
    if name == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, **small, **common)).eval()
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **small, **common)).eval()
    if name == "phi3":
        return tf.Phi3ForCausalLM(tf.Phi3Config(num_key_value_heads=2, pad_token_id=0, **small, **common)).eval()
    if name == "gpt_neox":
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**small, **common)).eval()
    if name == "gemma":
        return tf.GemmaForCausalLM(tf.GemmaConfig(num_key_value_heads=2, head_dim=8, **small, **common)).eval()
    raise KeyError(name)


def _parts(model):
    """(blocks, final norm, unembedding) of a causal LM, by its documented attribute names."""
    if hasattr(model, "transformer"):
        return model.transformer.h, model.transformer.ln_f, model.lm_head
    if hasattr(model, "gpt_neox"):
        return model.gpt_neox.layers, model.gpt_neox.final_layer_norm, model.get_output_embeddings()
    return model.model.layers, model.model.norm, model.lm_head


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "qwen2", "phi3", "gpt_neox"])
def test_logit_lens_rows_equal_the_model_run_by_hand(name):
    model = _lm(name)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    blocks, norm, head = _parts(model)
    outs = []
    hooks = [b.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o)) for b in blocks]
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    log = tl.trace(model, ids)
    result = tl.lens.logit_lens(log)
    assert result.validated and len(result.entries) == len(blocks)
    assert torch.allclose(result.entries[-1].logits, logits, atol=1e-4)
    with torch.no_grad():
        first = head(norm(outs[0]))
    assert torch.allclose(result.entries[0].logits, first, atol=1e-4)
    assert result.stacked().shape == (len(blocks), 2, 6, 64)


def test_gemma_one_plus_weight_norm_refuses_unless_verify_false():
    model = _lm("gemma")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    log = tl.trace(model, ids)
    with pytest.raises(tl.errors.LogitLensError) as exc:
        tl.lens.logit_lens(log)
    assert exc.value.code == "logit_lens_verification_failed" and exc.value.fields["max_abs_error"] > 1e-3
    result = tl.lens.logit_lens(log, verify=False)
    assert not result.validated and len(result.entries) == 2


def test_lens_options_and_tokenizer_tables():
    model = _lm("gpt2")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    log = tl.trace(model, ids)
    ident = tl.lens.logit_lens(log, lens=lambda x: x, modules=["transformer.h.1"], facet="resid_pre")
    assert ident.lens_source == "user_lens" and len(ident.entries) == 1
    assert torch.equal(ident.entries[0].logits, log.modules["transformer.h.1"].facets["resid_pre"].value)

    class Tok:
        def convert_ids_to_tokens(self, i):
            return f"<{i}>"

    result = tl.lens.logit_lens(log)
    top = result.top_tokens(3, tokenizer=Tok())
    last = result.entries[-1].logits[0, -1].detach().double().softmax(-1)
    want = torch.topk(last, 3)
    assert [t for t, _ in top[-1]] == [f"<{int(i)}>" for i in want.indices]
    assert all(abs(p - float(q)) < 1e-9 for (_, p), q in zip(top[-1], want.values))
    assert "<" in result.summary(tokenizer=Tok())
    with pytest.raises(tl.errors.LogitLensError) as exc:
        tl.lens.logit_lens(log, modules=["transformer.h.0.mlp"])
    assert exc.value.code == "logit_lens_facet_unavailable"
    from torchlens._semantic import logit_lens

    assert logit_lens is tl.lens.logit_lens


def test_streaming_predictions_match_the_full_lens_and_mask_input():
    model = _lm("llama")
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    log = tl.trace(model, ids)
    full = tl.lens.logit_lens(log)
    preds = tl.lens.logit_lens_predictions(log, k=3, positions=[-1, 2, 99], tokens=[5, 9])
    assert preds.validated and len(preds.rows) == len(full.entries) + 1
    assert preds.rows[-1].provenance == "native output" and preds.rows[0].positions == (-1, 2)  # 99: dropped
    for row, entry in zip(preds.rows, full.entries):
        x = entry.logits.detach().double()[:, [-1, 2]]
        assert torch.equal(torch.from_numpy(row.top_ids), torch.topk(x, 3).indices)
        assert torch.allclose(torch.from_numpy(row.logsumexp), torch.logsumexp(x, -1))
        probs = x.softmax(-1)[..., [5, 9]]
        assert torch.allclose(torch.from_numpy(row.token_probs), probs)
        ranks = (x[..., None, :] > x[..., [5, 9]][..., :, None]).sum(-1) + 1
        assert torch.equal(torch.from_numpy(row.token_ranks), ranks)
    masked = tl.lens.logit_lens_predictions(log, k=3, positions=[-1], mask_input=True)
    for row in masked.rows:
        for b in range(2):
            assert not set(row.top_ids[b].ravel().tolist()) & set(ids[b].tolist())


def test_vit_classifier_lens_reads_the_cls_token_through_layernorm_and_classifier():
    torch.manual_seed(0)
    cfg = tf.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       image_size=16, patch_size=8, num_channels=3, num_labels=5)
    model = tf.ViTForImageClassification(cfg).eval()
    x = torch.randn(2, 3, 16, 16)
    outs = []
    blocks = model.vit.layers
    hooks = [b.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o)) for b in blocks]
    with torch.no_grad():
        logits = model(x).logits
    for h in hooks:
        h.remove()
    result = tl.lens.logit_lens(tl.trace(model, x))
    assert result.lens_source == "classifier_head" and result.validated
    assert torch.allclose(result.entries[-1].logits, logits, atol=1e-5)
    with torch.no_grad():
        first = model.classifier(model.vit.layernorm(outs[0])[:, 0])
    assert torch.allclose(result.entries[0].logits, first, atol=1e-5) and first.shape == (2, 5)
