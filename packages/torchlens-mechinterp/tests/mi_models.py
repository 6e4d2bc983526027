"""Tiny random-init Hugging Face causal LMs built from configs (no downloads), eager attention,
fixed seeds, float32. Shared by the mechinterp kit's tests (K1 and K2)."""

from __future__ import annotations

import torch

VOCAB = 64


def gpt2(layers: int = 2, attn: str = "eager", vocab: int = VOCAB, d_model: int = 32, heads: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=d_model, n_head=heads, vocab_size=vocab, n_positions=64,
                     attn_implementation=attn, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def llama(layers: int = 2, attn: str = "eager", vocab: int = VOCAB):
    """LLaMA with grouped-query attention (4 query heads, 2 key/value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64, attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


def neox(layers: int = 2, attn: str = "eager", vocab: int = VOCAB, parallel: bool = True):
    """GPT-NeoX (parallel attention + MLP blocks by default)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                        vocab_size=vocab, max_position_embeddings=64, use_parallel_residual=parallel,
                        attn_implementation=attn)
    return GPTNeoXForCausalLM(cfg).eval()


def mistral(layers: int = 2, attn: str = "eager", vocab: int = VOCAB):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64, sliding_window=16,
                        attn_implementation=attn)
    return MistralForCausalLM(cfg).eval()


def gemma(layers: int = 2, attn: str = "eager", vocab: int = VOCAB):
    """Gemma: a scaled embedding and (1 + weight) RMSNorms (final norm weight randomised so the
    offset matters)."""
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    cfg = GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=vocab, max_position_embeddings=64,
                      attn_implementation=attn)
    model = GemmaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.normal_()
    return model


BUILDERS = {"gpt2": gpt2, "llama": llama, "neox": neox, "mistral": mistral}
EXTRA_BUILDERS = {"gemma": gemma}


def ids(n: int = 7, batch: int = 1, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, n), generator=g)


def snapshot(trace) -> tuple:
    """What a refusal must leave unchanged: the op labels and every saved payload (cloned)."""
    outs = {}
    for label, op in trace._ops.items():
        if op.saved:
            v = op.out
            outs[label] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return tuple(trace._ops), outs


def assert_unchanged(trace, snap: tuple) -> None:
    labels, outs = snap
    assert tuple(trace._ops) == labels
    for label, v in outs.items():
        now = trace._ops[label].out
        assert (torch.equal(now, v) if isinstance(v, torch.Tensor) else now is v or now == v), label
