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


def family(name: str, attn: str = "eager"):
    """A 1-layer random-init model of HF family `name` (no download), with the positional
    and keyword inputs to call it with: `(model, args, kwargs)`."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=64, max_position_embeddings=32, attn_implementation=attn)
    dims = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    if name == "mistral":
        cfg = tf.MistralConfig(num_key_value_heads=2, **dims, **common)
        return tf.MistralForCausalLM(cfg).eval(), (ids(),), {}
    if name == "qwen2":
        cfg = tf.Qwen2Config(num_key_value_heads=2, **dims, **common)
        return tf.Qwen2ForCausalLM(cfg).eval(), (ids(),), {}
    if name == "phi3":
        cfg = tf.Phi3Config(num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **dims, **common)
        return tf.Phi3ForCausalLM(cfg).eval(), (ids(),), {}
    if name == "opt":
        cfg = tf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=4,
                           word_embed_proj_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, **common)
        return tf.OPTForCausalLM(cfg).eval(), (ids(),), {}
    if name == "gpt_neox":
        cfg = tf.GPTNeoXConfig(use_parallel_residual=True, bos_token_id=0, eos_token_id=0, **dims, **common)
        return tf.GPTNeoXForCausalLM(cfg).eval(), (ids(),), {}
    if name == "bert":
        cfg = tf.BertConfig(**dims, **common)
        return tf.BertModel(cfg).eval(), (ids(),), {}
    if name == "t5":
        cfg = tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4, vocab_size=64,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation=attn)
        return tf.T5ForConditionalGeneration(cfg).eval(), (ids(),), {"decoder_input_ids": ids(3)}
    if name == "vit":
        cfg = tf.ViTConfig(image_size=16, patch_size=8, num_channels=3, attn_implementation=attn, **dims)
        return tf.ViTModel(cfg).eval(), (pixels(),), {}
    if name == "clip":
        text = dict(max_position_embeddings=16, vocab_size=64, bos_token_id=0, eos_token_id=1, pad_token_id=1, **dims)
        vision = dict(image_size=16, patch_size=8, **dims)
        cfg = tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16, attn_implementation=attn)
        return tf.CLIPModel(cfg).eval(), (), {"input_ids": ids(5), "pixel_values": pixels()}
    raise KeyError(name)


def pixels() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(2, 3, 16, 16, generator=g)
