"""Small, deterministic models for tests and the conformance suite.

Every entry builds `(model, args, kwargs)` from a seed with random weights; nothing is
downloaded. Hugging Face entries need `transformers` and say so through `requires`;
`ZooEntry.available()` is False (and the pytest fixtures skip) when it is missing.
"""

from __future__ import annotations

import importlib.util
import math
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


# Tier-3 oracles (conformance cells c3_*): each model's computation written by hand -----------
#
# `forward(tap, *args)` recomputes the model with plain torch calls on the model's own
# weights and calls `tap(label, value)` at each op output it reproduces (labels are the
# trace's); the suite edits the site through `tap` and compares with the library's replay.
# Gradients come from `torch.autograd.grad` of the hand forward with respect to the tapped
# values. The hand forwards never mutate the model (train-mode BatchNorm runs without
# running statistics: its output depends on the batch only).

def _square_sum(out: torch.Tensor) -> torch.Tensor:
    return (out * out).sum()


def _torch_backward(trace: Any, loss: Callable[[Any], Any]) -> Any:
    return trace.backward(loss(trace.output))


def _autodiff(forward: Callable[..., Any]) -> Callable[..., dict[str, torch.Tensor]]:
    """`grads(loss, *args)`: d loss(forward(args)) / d value, for every tapped value, by
    torch's own autograd on the hand forward."""

    def grads(loss: Callable[[Any], Any], *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        seen: dict[str, torch.Tensor] = {}

        def tap(label: str, value: torch.Tensor) -> torch.Tensor:
            seen[label] = value
            return value

        with torch.enable_grad():
            out = forward(tap, *args, **kwargs)
            labels = [lb for lb, v in seen.items() if v.requires_grad]
            found = torch.autograd.grad(loss(out), [seen[lb] for lb in labels], allow_unused=True)
        return {lb: (g if g is not None else torch.zeros_like(seen[lb])).detach() for lb, g in zip(labels, found)}

    return grads


def _bn_train(bn: nn.BatchNorm2d, x: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)


def _mlp_forward(m: MLP) -> Callable[..., Any]:
    def forward(tap, x):
        h = tap("linear_1_1", F.linear(x, m.fc1.weight, m.fc1.bias))
        h = tap("relu_1_2", torch.relu(h))
        return tap("linear_2_3", F.linear(h, m.fc2.weight, m.fc2.bias))
    return forward


_CNN_BLOCK_LABELS = (
    ("conv2d_2_5", "batchnorm_2_7", "relu_2_8:1", "conv2d_3_9", "batchnorm_3_11", "add_4_12", "relu_2_8:2"),
    ("conv2d_4_13", "batchnorm_4_15", "relu_3_16:1", "conv2d_5_17", "batchnorm_5_19", "add_7_20", "relu_3_16:2"),
)


def _cnn_forward(m: CNN) -> Callable[..., Any]:
    def block(tap, b: Block, x, labels):
        c1, n1, r1, c2, n2, add, r2 = labels
        h = tap(c1, F.conv2d(x, b.conv1.weight, None, padding=1))
        h = tap(r1, torch.relu(tap(n1, _bn_train(b.bn1, h))))
        h = tap(c2, F.conv2d(h, b.conv2.weight, None, padding=1))
        h = tap(add, tap(n2, _bn_train(b.bn2, h)) + x)
        return tap(r2, torch.relu(h))

    def forward(tap, x):
        h = tap("conv2d_1_1", F.conv2d(x, m.stem.weight, m.stem.bias, padding=1))
        h = tap("relu_1_4", torch.relu(tap("batchnorm_1_3", _bn_train(m.bn, h))))
        for b, labels in zip(m.blocks, _CNN_BLOCK_LABELS):
            h = block(tap, b, h, labels)
        h = tap("flatten_1_22", torch.flatten(tap("adaptiveavgpool2d_1_21", F.adaptive_avg_pool2d(h, 1)), 1))
        return tap("linear_1_23", F.linear(h, m.head.weight, m.head.bias))
    return forward


def _mha(tap, attn: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    """nn.MultiheadAttention(x, x, x) with batch_first, packed in-projection, no mask, written
    out op by op as its eager path runs (and as the trace labels it)."""
    e, heads = attn.embed_dim, attn.num_heads
    hd = e // heads
    q = tap("transpose_1_1", x.transpose(1, 0))
    length, bsz, _ = q.shape
    proj = tap("linear_1_2", F.linear(q, attn.in_proj_weight, attn.in_proj_bias))
    proj = tap("unflatten_1_3", proj.unflatten(-1, (3, e)))
    proj = tap("transpose_2_5", tap("unsqueeze_1_4", proj.unsqueeze(0)).transpose(0, -2))
    proj = tap("contiguous_1_7", tap("squeeze_1_6", proj.squeeze(-2)).contiguous())
    q, k, v = tap("getitem_1_8", proj[0]), tap("getitem_2_9", proj[1]), tap("getitem_3_10", proj[2])
    q = tap("transpose_3_12", tap("view_1_11", q.view(length, bsz * heads, hd)).transpose(0, 1))
    k = tap("transpose_4_14", tap("view_2_13", k.view(k.shape[0], bsz * heads, hd)).transpose(0, 1))
    v = tap("transpose_5_16", tap("view_3_15", v.view(v.shape[0], bsz * heads, hd)).transpose(0, 1))
    q = tap("mul_1_17", q * math.sqrt(1.0 / float(hd)))
    w = tap("softmax_1_20", torch.softmax(tap("bmm_1_19", torch.bmm(q, tap("transpose_6_18", k.transpose(-2, -1)))),
                                          dim=-1))
    out = tap("transpose_7_22", tap("bmm_2_21", torch.bmm(w, v)).transpose(0, 1))
    out = tap("reshape_1_23", out.reshape(length * bsz, e))
    out = tap("linear_2_24", F.linear(out, attn.out_proj.weight, attn.out_proj.bias))
    out = tap("view_4_25", out.view(length, bsz, out.size(1)))
    return tap("transpose_8_28", out.transpose(1, 0))


def _attention_forward(m: AttentionBlock) -> Callable[..., Any]:
    def forward(tap, x):
        h = tap("add_1_29", x + _mha(tap, m.attn, x))
        return tap("layernorm_1_30", F.layer_norm(h, (h.shape[-1],), m.norm.weight, m.norm.bias, m.norm.eps))
    return forward


def _loop_forward(m: LoopNet) -> Callable[..., Any]:
    def forward(tap, x):
        for i in range(1, m.steps + 1):
            x = tap(f"tanh_1_2:{i}", torch.tanh(tap(f"linear_1_1:{i}", F.linear(x, m.fc.weight, m.fc.bias))))
        return x
    return forward


def _closure_forward(m: ClosureConstant) -> Callable[..., Any]:
    def forward(tap, x):
        return tap("mul_1_3", tap("linear_1_1", F.linear(x, m.fc.weight, m.fc.bias)) * _CLOSURE_SCALE)
    return forward


def _random_forward(m: RandomDraw) -> Callable[..., Any]:
    def forward(tap, x):  # the same draws in the same order: dropout's mask, then randn
        h = tap("linear_1_1", F.linear(x, m.fc.weight, m.fc.bias))
        d = tap("dropout_1_2", F.dropout(h, m.drop.p, training=True))
        return tap("add_1_5", d + 0.01 * torch.randn(x.shape))
    return forward


def _lstm_forward(m: RNNNet) -> Callable[..., Any]:
    def forward(tap, x):
        out, _state = m.rnn(x)  # the fused LSTM op is multi-output: not tapped
        return tap("linear_1_5", F.linear(tap("getitem_1_4", out[:, -1]), m.head.weight, m.head.bias))
    return forward


#: role -> (hand forward factory, site)
_C3: dict[str, tuple[Callable[[Any], Callable[..., Any]], str]] = {
    "mlp": (_mlp_forward, "relu_1_2"),
    "conv": (_cnn_forward, "relu_2_8:2"),
    "attention": (_attention_forward, "add_1_29"),
    "loop": (_loop_forward, "tanh_1_2:2"),
    "constant": (_closure_forward, "linear_1_1"),
    "random": (_random_forward, "linear_1_1"),
    "lstm": (_lstm_forward, "getitem_1_4"),
}


def c3_oracle(role: str, model: nn.Module, args: tuple, seed: int = 0) -> dict[str, Any]:
    """The `c3` entry of a conformance role: site, hand forward, donor inputs, loss and autodiff."""
    make, site = _C3[role]
    forward = make(model)
    g = torch.Generator().manual_seed(seed + 1)
    other = tuple(torch.randn(a.shape, generator=g, dtype=a.dtype) for a in args)
    return {"site": site, "forward": forward, "other_args": other, "other_kwargs": {},
            "loss": _square_sum, "backward": _torch_backward, "grads": _autodiff(forward)}


def conformance_zoo(seed: int = 0) -> dict[str, dict[str, Any]]:
    """What `BackendSpec.zoo()` returns: role -> {model, args, kwargs, reseed, c3}."""
    out: dict[str, dict[str, Any]] = {}
    for role, name in CONFORMANCE_ROLES.items():
        model, args, kwargs = build(name, seed)
        out[role] = {"model": model, "args": args, "kwargs": kwargs, "reseed": lambda: torch.manual_seed(seed),
                     "c3": c3_oracle(role, model, args, seed)}
    return out


def names(available_only: bool = False) -> list[str]:
    return [n for n, e in ZOO.items() if not available_only or e.available()]


__all__ = ["ZooEntry", "ZOO", "CONFORMANCE_ROLES", "build", "conformance_zoo", "names"]
