"""The language-model head's final norm is the norm module whose output the unembedding reads,
found across the position selection / reshape between them (transformers 5.x reads
`hidden[:, slice_indices, :]` in the root module): final_norm_input equals a forward pre-hook
on that norm's input, final_norm_gamma / beta / eps are that norm's own."""

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
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                                 bos_token_id=0, eos_token_id=0))
        norm = model.transformer.ln_f
    elif name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **small, **common))
        norm = model.model.norm
    elif name == "gpt_neox":
        model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**small, **common))
        norm = model.gpt_neox.final_layer_norm
    elif name == "gemma":
        model = tf.GemmaForCausalLM(tf.GemmaConfig(num_key_value_heads=2, head_dim=8, **small, **common))
        norm = model.model.norm
    else:
        raise KeyError(name)
    with torch.no_grad():  # every norm gets its own non-trivial gamma / beta: a wrong norm cannot pass by luck
        for mod in model.modules():
            for pname, p in mod.named_parameters(recurse=False):
                if p.dim() == 1 and "norm" in type(mod).__name__.lower():
                    p.copy_(torch.randn_like(p))
    return model.eval(), norm


def _ids(n: int = 6) -> torch.Tensor:
    return torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("keep", [None, 1, "positions"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "gpt_neox", "gemma"])
def test_final_norm_facets_are_the_norm_the_unembedding_reads(name, keep):
    model, norm = _lm(name)
    seen = []
    hook = norm.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    kwargs = {} if keep is None else {"logits_to_keep": torch.tensor([0, 2]) if keep == "positions" else keep}
    try:
        with torch.no_grad():
            model(_ids(), **kwargs)
    finally:
        hook.remove()
    log = tl.trace(model, _ids(), input_kwargs=kwargs, save="all")
    f = log.modules["self"].facets
    assert torch.equal(f["final_norm_input"].value, seen[0])
    assert torch.equal(f["final_norm_gamma"].value, norm.weight)
    assert f["final_norm_eps"].value == getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if isinstance(norm, torch.nn.LayerNorm):
        assert f["final_norm_kind"].value == "layer_norm"
        assert torch.equal(f["final_norm_beta"].value, norm.bias)
    else:
        assert f["final_norm_kind"].value == "rms_norm"
        assert "final_norm_beta" not in f


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_lens_last_row_equals_the_logits_with_non_unit_norm_weights(name):
    model, _ = _lm(name)
    with torch.no_grad():
        logits = model(_ids()).logits
    log = tl.trace(model, _ids())
    result = tl.lens.logit_lens(log)
    assert result.validated
    assert log.output_layers == [o.label for o in log.output_ops]
    assert torch.equal(log[log.output_layers[0]].out, logits)  # the spec's `log[log.output_layers[0]]`
    assert torch.allclose(result.entries[-1].logits, logits, atol=1e-4)
