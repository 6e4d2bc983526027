"""CLIP's contrastive image head facts and the lens fallback to it (facets spec, "Vision
heads"): each image-tower block's [CLS] state goes through post_layernorm, visual_projection
and L2 normalisation and is scored against the captured text features with the model's own
logit_scale; the last layer equals CLIP's logits_per_image."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
from torchlens.errors import LogitLensError

transformers = pytest.importorskip("transformers")


def _clip(layers: int = 2):
    torch.manual_seed(0)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, vocab_size=64,
                max_position_embeddings=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  image_size=16, patch_size=8)
    model = transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision,
                                                           projection_dim=16)).eval()
    g = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, 64, (3, 5), generator=g),
              "pixel_values": torch.randn(2, 3, 16, 16, generator=g)}
    return model, inputs


def _text_features(model, out):
    """The text projection's output (newer transformers already put it in pooler_output)."""
    pooled = out.text_model_output.pooler_output
    return pooled if pooled.shape[-1] == model.text_projection.out_features else model.text_projection(pooled)


def _score(model, cls, text_features):
    """CLIP's head by hand on one [CLS] state."""
    img = model.visual_projection(model.vision_model.post_layernorm(cls))
    img = img / img.norm(dim=-1, keepdim=True)
    txt = text_features / text_features.norm(dim=-1, keepdim=True)
    return img @ txt.t() * model.logit_scale.exp()


def test_contrastive_image_head_facts():
    model, inputs = _clip()
    log = tl.trace(model, input_kwargs=inputs)
    f = log.modules["self"].facets
    with torch.no_grad():
        out = model(**inputs)
        image = model.visual_projection(model.vision_model.post_layernorm(
            out.vision_model_output.last_hidden_state[:, 0, :]))
        text = _text_features(model, out)
    assert torch.equal(f["logits_per_image"].value, out.logits_per_image)
    assert torch.allclose(f["image_features"].value, image, atol=1e-6)
    assert torch.allclose(f["text_features"].value, text, atol=1e-6)
    assert torch.equal(f["image_projection_weight"].value, model.visual_projection.weight)
    assert f["pooled_position"].value == 0 and f["tower_address"].value == "vision_model"
    assert torch.equal(f["final_norm_gamma"].value, model.vision_model.post_layernorm.weight)
    assert f["final_norm_eps"].value == model.vision_model.post_layernorm.eps
    assert torch.equal(f["logit_scale"].value, model.logit_scale)


def test_lens_falls_back_to_the_contrastive_head():
    model, inputs = _clip()
    log = tl.trace(model, input_kwargs=inputs)
    result = tl.lens.logit_lens(log)
    assert result.lens_source == "contrastive_head" and result.validated
    assert [e.address for e in result.entries] == ["vision_model.encoder.layers.0", "vision_model.encoder.layers.1"]
    vm = model.vision_model
    seen = {}
    h = vm.encoder.layers[0].register_forward_hook(
        lambda m, i, o: seen.__setitem__("l0", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        out = model(**inputs)
        h.remove()
        text = _text_features(model, out)
        want0 = _score(model, seen["l0"][:, 0, :], text)
    assert torch.as_tensor(result.entries[0].logits).shape == (2, 3)  # [n_images, n_prompts]
    assert torch.allclose(torch.as_tensor(result.entries[0].logits), want0, atol=1e-4)
    assert torch.allclose(torch.as_tensor(result.entries[-1].logits), out.logits_per_image, atol=1e-4)
    with pytest.raises(LogitLensError) as exc:
        tl.lens.logit_lens(log, modules=["text_model.encoder.layers.0"])
    assert exc.value.code == "logit_lens_layer_outside_head"
