"""Real architectures, built from configs with random weights, for the real-model zoo.

The issue-12 table: Hugging Face models from tiny `XxxConfig(...)`s, torchvision and timm
models with `weights=None` / `pretrained=False`, and small hand-written models for the
features real code uses (train-mode dropout, dict inputs, dataclass outputs, compiled
submodules, autograd in the forward, in-place view writes, complex numbers, bf16, int8
dynamic quantization, weight_norm). Nothing is downloaded.

Each `RealEntry.build(seed)` returns `(model, args, kwargs)`; `site` names a mid-model
module (one tensor output) for the zero-ablation check, `big` marks entries too slow for
the default CI run (the inductor compile of `compiled_submodule`, ~15-25 s on 2 cores). The checks themselves live in `torchlens_torch.real_checks`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
import torch.nn.functional as F

from torchlens_torch import vision_env


@dataclass(frozen=True)
class RealEntry:
    """One architecture of the table: `build(seed)` -> `(model, args, kwargs)`."""

    name: str
    build_fn: Callable[[], tuple[nn.Module, tuple, dict]]
    site: str | None
    requires: tuple[str, ...] = ()
    big: bool = False
    note: str = ""
    #: (check, error code) pairs: the promise for that check is a typed refusal with this code.
    #: For validate checks it is raised before any op ran (autograd.grad in the forward cannot
    #: be validated by replay); for "ablation" the replay refuses and the rerun engine
    #: (`do(..., model=, inputs=)`) must give the forward-hook ablation (data-dependent shapes)
    refuses: tuple[tuple[str, str], ...] = ()

    def refusal(self, check: str) -> str | None:
        """The code `check` must refuse with on this model, or None (the check must pass)."""
        return dict(self.refuses).get(check)

    def available(self) -> bool:
        for r in self.requires:
            if r in ("torchvision", "timm"):
                if not vision_env.available():
                    return False
                if r == "timm" and not _vision_has("timm"):
                    return False
            elif importlib.util.find_spec(r) is None:
                return False
        return True

    def build(self, seed: int = 0) -> tuple[nn.Module, tuple, dict]:
        state = torch.get_rng_state()
        torch.manual_seed(seed)
        try:
            return self.build_fn()
        finally:
            torch.set_rng_state(state)


def _vision_has(pkg: str) -> bool:
    return importlib.util.find_spec(pkg) is not None or any(
        (p / pkg / "__init__.py").is_file() for p in vision_env.vision_paths())


def _ids(n: int = 8, vocab: int = 64) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n))


# Hugging Face ------------------------------------------------------------------------------

_LM = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)


def _hf(config: str, model: str, **cfg: Any) -> nn.Module:
    import transformers

    return getattr(transformers, model)(getattr(transformers, config)(**cfg)).eval()


def _causal(config: str, model: str, **extra: Any) -> Callable[[], tuple]:
    return lambda: (_hf(config, model, **{**_LM, **extra}), (_ids(),), {})


def _opt():
    m = _hf("OPTConfig", "OPTForCausalLM", vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32)
    return m, (_ids(),), {}


def _gptj():
    m = _hf("GPTJConfig", "GPTJForCausalLM", vocab_size=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
            n_positions=64, bos_token_id=1, eos_token_id=2)
    return m, (_ids(),), {}


def _falcon():
    m = _hf("FalconConfig", "FalconForCausalLM", vocab_size=64, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4)
    return m, (_ids(),), {}


def _bloom():
    m = _hf("BloomConfig", "BloomForCausalLM", vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    return m, (_ids(),), {}


def _mamba():
    m = _hf("MambaConfig", "MambaForCausalLM", vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2,
            expand=2, conv_kernel=4)
    return m, (_ids(),), {}


def _masked(config: str, model: str, **cfg: Any):
    def build():
        m = _hf(config, model, **cfg)
        ids = _ids()
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0
        return m, (), {"input_ids": ids, "attention_mask": mask}
    return build


def _bart():
    m = _hf("BartConfig", "BartModel", vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_position_embeddings=64)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    return m, (), {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": _ids(4)}


def _whisper():
    m = _hf("WhisperConfig", "WhisperModel", vocab_size=64, num_mel_bins=8, d_model=32, encoder_layers=2,
            decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_source_positions=16, max_target_positions=16,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return m, (), {"input_features": torch.randn(1, 8, 32), "decoder_input_ids": _ids(4)}


def _clip():
    m = _hf("CLIPConfig", "CLIPModel",
            text_config=dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=16),
            vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                               image_size=32, patch_size=8), projection_dim=16)
    return m, (), {"input_ids": _ids(), "pixel_values": torch.randn(1, 3, 32, 32)}


def _swin():
    m = _hf("SwinConfig", "SwinModel", image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
            window_size=4)
    return m, (torch.randn(1, 3, 32, 32),), {}


def _convnext():
    m = _hf("ConvNextConfig", "ConvNextModel", hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)
    return m, (torch.randn(1, 3, 32, 32),), {}


def _wav2vec2():
    m = _hf("Wav2Vec2Config", "Wav2Vec2Model", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
    return m, (torch.randn(1, 400),), {}


def _detr():
    from transformers import ResNetConfig

    backbone = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                            out_features=["stage2"])
    m = _hf("DetrConfig", "DetrForObjectDetection", use_timm_backbone=False, use_pretrained_backbone=False,
            backbone_config=backbone, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=8, num_labels=3)
    return m, (torch.randn(1, 3, 64, 64),), {}


class Generate(nn.Module):
    """`model.generate` (greedy, 3 new tokens) as a forward: the HF generation loop."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.lm = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)).eval()

    def forward(self, ids):
        return self.lm.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)


def _bert_train():
    m = _hf("BertConfig", "BertModel", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64).train()
    return m, (_ids(),), {}


# torchvision / timm --------------------------------------------------------------------------

def _tv(factory: str, shape: tuple, **kw: Any) -> Callable[[], tuple]:
    def build():
        tv = vision_env.import_torchvision()
        return getattr(tv.models, factory)(weights=None, **kw).eval(), (torch.randn(shape),), {}
    return build


def _tv_vit():
    tv = vision_env.import_torchvision()
    m = tv.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                    mlp_dim=64, num_classes=10).eval()
    return m, (torch.randn(1, 3, 32, 32),), {}


def _maskrcnn():
    tv = vision_env.import_torchvision()
    m = tv.models.detection.maskrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=3, min_size=128,
                                                  max_size=128, rpn_pre_nms_top_n_test=200,
                                                  rpn_post_nms_top_n_test=100, box_detections_per_img=20).eval()
    return m, ([torch.rand(3, 128, 128)],), {}


def _mobilevit():
    timm = vision_env.import_timm()
    return timm.create_model("mobilevit_xxs", pretrained=False, num_classes=10).eval(), (torch.randn(1, 3, 64, 64),), {}


# features real code uses ---------------------------------------------------------------------

class _MLP(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Linear(d, 4)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(torch.relu(self.fc1(x)))))


class TrainDropout(nn.Module):
    """nn.Dropout and SDPA with dropout_p>0, in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.drop, self.out = nn.Linear(16, 48), nn.Dropout(0.2), nn.Linear(16, 4)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
        return self.out(self.drop(a.transpose(1, 2).flatten(2)))


class DictKwargs(nn.Module):
    """A dict positional input and keyword-only inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, batch, *, scale, bias=None):
        h = self.a(batch["x"]) * scale + self.b(batch["y"])
        return {"out": h + bias if bias is not None else h, "aux": batch["y"].sum(-1)}


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        return Out(self.head(h), h)


class CompiledSub(nn.Module):
    """A `torch.compile`d (inductor) submodule inside an eager model."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.post = nn.Linear(8, 8), nn.Linear(8, 4)
        self.mid = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.GELU()))

    def forward(self, x):
        return self.post(self.mid(self.pre(x)))


class AutogradInForward(nn.Module):
    """`torch.autograd.grad` of an energy inside the forward (force fields, gradient penalties)."""

    def __init__(self) -> None:
        super().__init__()
        self.energy, self.head = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)), nn.Linear(4, 4)

    def forward(self, x):
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            e = self.energy(x).sum()
            (g,) = torch.autograd.grad(e, x, create_graph=False)
        return self.head(-g)


class InplaceViewWrite(nn.Module):
    """Writes through views of a buffer (`buf[:, :4].copy_(h)`, `.diagonal().zero_()`),
    then reads the base: torchvision's `batch_images` pattern."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(8, 4), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        buf = x.new_zeros(x.shape[0], 8)
        buf[:, :4].copy_(h)
        y = self.head(buf)
        m = torch.outer(y[0], y[0])
        m.diagonal().zero_()
        return y + m.sum(0)


class Complex(nn.Module):
    """rfft -> complex filter -> irfft, `.real`/`.abs()` on complex tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(9, dtype=torch.complex64))
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        f = torch.fft.rfft(self.fc(x), dim=-1) * self.w
        return torch.fft.irfft(f, n=16, dim=-1) + f.real.sum(-1, keepdim=True) + f.abs().mean(-1, keepdim=True)


def _bf16():
    return _MLP().to(torch.bfloat16).eval(), (torch.randn(2, 16, dtype=torch.bfloat16),), {}


def _int8():
    q = torch.ao.quantization.quantize_dynamic(_MLP().eval(), {nn.Linear}, dtype=torch.qint8)
    return q, (torch.randn(2, 16),), {}


def _weight_norm():
    m = _MLP()
    m.fc2 = nn.utils.parametrizations.weight_norm(m.fc2)
    return m.eval(), (torch.randn(2, 16),), {}


# the table -----------------------------------------------------------------------------------

_HF = ("transformers",)
_TV = ("torchvision",)
ENTRIES: dict[str, RealEntry] = {e.name: e for e in [
    RealEntry("mistral", _causal("MistralConfig", "MistralForCausalLM"), "model.layers.1.mlp", _HF),
    RealEntry("qwen2", _causal("Qwen2Config", "Qwen2ForCausalLM"), "model.layers.1.mlp", _HF),
    RealEntry("qwen3", _causal("Qwen3Config", "Qwen3ForCausalLM", head_dim=8), "model.layers.1.mlp", _HF),
    RealEntry("phi3", _causal("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2), "model.layers.1.mlp", _HF),
    RealEntry("gemma2", _causal("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, pad_token_id=0),
              "model.layers.1.mlp", _HF),
    RealEntry("opt", _opt, "model.decoder.layers.1.fc2", _HF),
    RealEntry("gptj", _gptj, "transformer.h.1.mlp", _HF),
    RealEntry("falcon", _falcon, "transformer.h.1.mlp", _HF),
    RealEntry("bloom", _bloom, "transformer.h.1.mlp", _HF),
    RealEntry("mixtral", _causal("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
              "model.layers.1.self_attn.o_proj", _HF),
    RealEntry("qwen2_moe", _causal("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=32, shared_expert_intermediate_size=32),
              "model.layers.1.self_attn.o_proj", _HF),
    RealEntry("mamba", _mamba, "backbone.layers.1.mixer.out_proj", _HF),
    RealEntry("distilbert", _masked("DistilBertConfig", "DistilBertModel", vocab_size=64, dim=32, n_layers=2,
                                    n_heads=4, hidden_dim=64, max_position_embeddings=64),
              "transformer.layer.1.ffn", _HF),
    RealEntry("roberta", _masked("RobertaConfig", "RobertaModel", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, max_position_embeddings=64),
              "encoder.layer.1.output.dense", _HF),
    RealEntry("bart", _bart, "encoder.layers.1.fc2", _HF),
    RealEntry("whisper", _whisper, "encoder.layers.1.fc2", _HF),
    RealEntry("clip", _clip, "vision_model.encoder.layers.1.mlp", _HF),
    RealEntry("swin", _swin, "encoder.layers.0.blocks.1.mlp", _HF),
    RealEntry("convnext", _convnext, "encoder.stages.0", _HF),
    RealEntry("wav2vec2", _wav2vec2, "encoder.layers.1.feed_forward", _HF),
    RealEntry("detr", _detr, "model.encoder.layers.0.mlp", _HF),
    RealEntry("hf_generate", lambda: (Generate(), (_ids(5),), {}), None, _HF,
              note="no ablation site: replay cannot re-choose the generated tokens"),
    RealEntry("bert_train", _bert_train, "encoder.layer.1.output.dense", _HF),
    RealEntry("tv_resnet18", _tv("resnet18", (1, 3, 64, 64)), "layer3", _TV),
    RealEntry("tv_mobilenet_v3_small", _tv("mobilenet_v3_small", (1, 3, 64, 64)), "features.6", _TV),
    RealEntry("tv_efficientnet_b0", _tv("efficientnet_b0", (1, 3, 64, 64)), "features.4", _TV),
    RealEntry("tv_vit", _tv_vit, "encoder.layers.encoder_layer_0.mlp", _TV),
    RealEntry("tv_googlenet", _tv("googlenet", (1, 3, 64, 64), aux_logits=False, init_weights=True), "inception4a",
              _TV),
    RealEntry("tv_inception_v3", _tv("inception_v3", (1, 3, 75, 75), aux_logits=False, init_weights=True),
              "Mixed_6a", _TV),
    RealEntry("tv_maskrcnn", _maskrcnn, "backbone.fpn", _TV,
              refuses=(("ablation", "replay_execution_failed"),)),
    RealEntry("timm_mobilevit", _mobilevit, "stages.2", _TV + ("timm",)),
    RealEntry("train_dropout", lambda: (TrainDropout().train(), (torch.randn(2, 5, 16),), {}), "out"),
    RealEntry("dict_kwargs", lambda: (DictKwargs(), ({"x": torch.randn(2, 8), "y": torch.randn(2, 8)},),
                                      {"scale": torch.tensor(0.5), "bias": torch.randn(8)}), "a"),
    RealEntry("dataclass_output", lambda: (DataclassOut(), (torch.randn(2, 8),), {}), "enc"),
    RealEntry("compiled_submodule", lambda: (CompiledSub(), (torch.randn(2, 8),), {}), "pre", big=True),
    RealEntry("autograd_in_forward", lambda: (AutogradInForward(), (torch.randn(3, 4),), {}), "head",
              refuses=(("validate", "validation_unavailable"), ("save_load_validate", "opaque_op_not_replayable"))),
    RealEntry("inplace_view_write", lambda: (InplaceViewWrite(), (torch.randn(2, 8),), {}), "fc"),
    RealEntry("complex", lambda: (Complex(), (torch.randn(2, 16),), {}), "fc"),
    RealEntry("bf16", _bf16, "fc2"),
    RealEntry("int8_dynamic", _int8, "fc2"),
    RealEntry("weight_norm", _weight_norm, "fc2"),
]}


def names(include_big: bool = True, available_only: bool = False) -> list[str]:
    return [n for n, e in ENTRIES.items()
            if (include_big or not e.big) and (not available_only or e.available())]


__all__ = ["RealEntry", "ENTRIES", "names"]
