"""Tiny random-init Hugging Face models and token ids shared by the facet tests."""

from __future__ import annotations

import torch


def gpt2(attn: str, layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=64, n_positions=32, attn_implementation=attn,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


def ids(n: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, n), generator=g)
