"""Small, deterministic models for tests and the conformance suite.

Every entry builds `(model, args, kwargs)` from a seed with random weights; nothing is
downloaded. Hugging Face entries need `transformers` and say so through `requires`;
`ZooEntry.available()` is False (and the pytest fixtures skip) when it is missing.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ZooEntry:
    """One model of the zoo: `build(seed)` returns `(model, args, kwargs)`."""

    name: str
    build_fn: Callable[[], tuple[nn.Module, tuple, dict]]
    requires: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    description: str = ""

    def available(self) -> bool:
        return all(importlib.util.find_spec(r) is not None for r in self.requires)

    def build(self, seed: int = 0) -> tuple[nn.Module, tuple, dict]:
        state = torch.get_rng_state()
        torch.manual_seed(seed)
        try:
            return self.build_fn()
        finally:
            torch.set_rng_state(state)


# plain torch models ---------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class CNN(nn.Module):
    """Conv stem, two residual blocks with BatchNorm (left in train mode), pooling, head."""

    def __init__(self, ch: int = 8, n_blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        self.bn = nn.BatchNorm2d(ch)
        self.blocks = nn.Sequential(*[Block(ch) for _ in range(n_blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(ch, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.blocks(x)
        return self.head(torch.flatten(self.pool(x), 1))


class RNNNet(nn.Module):
    def __init__(self, kind: str = "lstm") -> None:
        super().__init__()
        cls = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = cls(6, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        out, _state = self.rnn(x)
        return self.head(out[:, -1])


class LoopNet(nn.Module):
    """One Linear reused in a loop: one layer with several passes."""

    def __init__(self, steps: int = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.steps = steps

    def forward(self, x):
        for _ in range(self.steps):
            x = torch.tanh(self.fc(x))
        return x


_CLOSURE_SCALE = torch.linspace(0.5, 1.5, 8)


class ClosureConstant(nn.Module):
    """Reads a tensor built outside the model (a closure constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * _CLOSURE_SCALE


class RandomDraw(nn.Module):
    """Dropout in train mode plus a randn draw inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x)) + 0.01 * torch.randn(x.shape)


class AttentionBlock(nn.Module):
    """nn.MultiheadAttention (a composite) plus a residual and LayerNorm."""

    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        a, _w = self.attn(x, x, x)
        return self.norm(x + a)


def _mlp():
    return MLP().eval(), (torch.randn(4, 8),), {}


def _cnn():
    return CNN().train(), (torch.randn(2, 3, 8, 8),), {}


def _lstm():
    return RNNNet("lstm").eval(), (torch.randn(2, 5, 6),), {}


def _gru():
    return RNNNet("gru").eval(), (torch.randn(2, 5, 6),), {}


def _loop():
    return LoopNet().eval(), (torch.randn(2, 8),), {}


def _closure():
    return ClosureConstant().eval(), (torch.randn(2, 8),), {}


def _random():
    return RandomDraw().train(), (torch.randn(2, 8),), {}


def _attention():
    return AttentionBlock().eval(), (torch.randn(2, 5, 16),), {}


def _transformer_encoder():
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    return model, (torch.randn(2, 5, 16),), {}


# Hugging Face models (random init from configs) -----------------------------------------

def _ids(vocab: int, n: int = 8, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n))


def _gpt2(attn: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, attn_implementation=attn)
    return GPT2LMHeadModel(cfg).eval(), (_ids(64),), {}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval(), (_ids(64),), {}


def _gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=64, max_position_embeddings=32, use_parallel_residual=True,
                        attn_implementation="eager")
    return GPTNeoXForCausalLM(cfg).eval(), (_ids(64),), {}


def _bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=64, max_position_embeddings=32, attn_implementation="eager")
    ids = _ids(64)
    return BertModel(cfg).eval(), (ids,), {"attention_mask": torch.ones_like(ids)}


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=64,
                   decoder_start_token_id=0, attn_implementation="eager")
    ids = _ids(64)
    return T5ForConditionalGeneration(cfg).eval(), (ids,), {"decoder_input_ids": _ids(64, 4)}


def _vit():
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                    patch_size=8, num_channels=3, attn_implementation="eager")
    return ViTModel(cfg).eval(), (torch.randn(1, 3, 16, 16),), {}


_HF = ("transformers",)

ZOO: dict[str, ZooEntry] = {e.name: e for e in (
    ZooEntry("mlp", _mlp, tags=("mlp",), description="two Linear layers with a ReLU"),
    ZooEntry("cnn", _cnn, tags=("conv", "batchnorm", "residual", "inplace"),
             description="conv net with train-mode BatchNorm, in-place ReLU and residual adds"),
    ZooEntry("lstm", _lstm, tags=("rnn", "multi_output"), description="2-layer LSTM and a head"),
    ZooEntry("gru", _gru, tags=("rnn", "multi_output"), description="2-layer GRU and a head"),
    ZooEntry("loop", _loop, tags=("loop",), description="one Linear reused three times"),
    ZooEntry("closure_constant", _closure, tags=("constant",), description="a closure tensor read by the forward"),
    ZooEntry("random_draw", _random, tags=("random",), description="train-mode dropout and randn"),
    ZooEntry("attention", _attention, tags=("attention", "composite"), description="nn.MultiheadAttention block"),
    ZooEntry("transformer_encoder", _transformer_encoder, tags=("attention", "composite"),
             description="nn.TransformerEncoder, 2 layers (fast path off during capture)"),
    ZooEntry("gpt2_eager", lambda: _gpt2("eager"), _HF, ("hf", "attention"), "HF GPT-2, eager attention"),
    ZooEntry("gpt2_sdpa", lambda: _gpt2("sdpa"), _HF, ("hf", "attention"), "HF GPT-2, SDPA attention"),
    ZooEntry("llama", _llama, _HF, ("hf", "attention", "gqa", "rope"), "HF LLaMA with GQA and RoPE"),
    ZooEntry("gpt_neox", _gpt_neox, _HF, ("hf", "attention", "parallel_residual"), "HF GPT-NeoX, parallel residual"),
    ZooEntry("bert", _bert, _HF, ("hf", "attention"), "HF BERT encoder with an attention mask"),
    ZooEntry("t5", _t5, _HF, ("hf", "attention", "encoder_decoder"), "HF T5 encoder-decoder"),
    ZooEntry("vit", _vit, _HF, ("hf", "attention", "conv"), "HF ViT"),
)}


def build(name: str, seed: int = 0) -> tuple[nn.Module, tuple, dict]:
    """`(model, args, kwargs)` of the zoo entry `name`."""
    return ZOO[name].build(seed)


#: Conformance roles (`BackendSpec.zoo`) -> zoo entries: plain torch models only, so the
#: shared suite runs fast and without transformers.
CONFORMANCE_ROLES: dict[str, str] = {
    "mlp": "mlp", "conv": "cnn", "attention": "attention", "loop": "loop", "constant": "closure_constant",
    "random": "random_draw", "lstm": "lstm",
}


def conformance_zoo(seed: int = 0) -> dict[str, dict[str, Any]]:
    """What `BackendSpec.zoo()` returns: role -> {model, args, kwargs, reseed}."""
    out: dict[str, dict[str, Any]] = {}
    for role, name in CONFORMANCE_ROLES.items():
        model, args, kwargs = build(name, seed)
        out[role] = {"model": model, "args": args, "kwargs": kwargs, "reseed": lambda: torch.manual_seed(seed)}
    return out


def names(available_only: bool = False) -> list[str]:
    return [n for n, e in ZOO.items() if not available_only or e.available()]


__all__ = ["ZooEntry", "ZOO", "CONFORMANCE_ROLES", "build", "conformance_zoo", "names"]
