"""Module.custom_attributes (facets spec: live attributes "snapshotted into
module.custom_attributes") and tl.facets.config_value reading it from the record."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import FacetError


class Heads(nn.Module):
    """An attention-like module whose head count lives only in a live attribute."""

    def __init__(self, n_heads: int = 2, d: int = 8) -> None:
        super().__init__()
        self.n_heads, self.scale, self.tag = n_heads, 0.5, "heads"
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return self.proj(x) * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.heads = Heads()

    def forward(self, x):
        a, _ = self.mha(x, x, x)
        return self.heads(self.conv(a.transpose(1, 2)).transpose(1, 2))


def test_atomic_attributes_are_snapshotted_and_config_value_reads_them():
    torch.manual_seed(0)
    model = Net().eval()
    log = tl.trace(model, torch.randn(1, 5, 8))
    mha = log.modules["mha"]
    assert mha.custom_attributes["num_heads"] == model.mha.num_heads == 2
    assert mha.custom_attributes["embed_dim"] == 8 and mha.custom_attributes["batch_first"] is True
    assert log.modules["conv"].custom_attributes["kernel_size"] == model.conv.kernel_size == (3,)
    assert tl.facets.config_value(mha, "n_heads", "num_heads") == 2
    assert tl.facets.config_value(log.modules["heads"], "n_heads") == 2
    assert "proj" not in log.modules["heads"].custom_attributes  # submodules and tensors are not atomic
    with pytest.raises(FacetError) as exc:
        tl.facets.config_value(log.modules["conv"], "num_heads")
    assert exc.value.code == "facet_config_missing"
    # a snapshot: later changes to the live module do not reach the record
    model.heads.n_heads = 4
    assert log.modules["heads"].custom_attributes["n_heads"] == 2


def test_a_recipe_reads_the_head_count_from_the_snapshot():
    torch.manual_seed(0)
    model, x = Heads(n_heads=2).eval(), torch.randn(1, 3, 8)

    @tl.facets.recipe(class_name="Heads", recipe_id="heads_from_attribute")
    def heads_recipe(module):
        n = tl.facets.config_value(module, "n_heads")
        return {"per_head": tl.facets.child_output_spec(module, "proj", "heads_from_attribute").heads(n)}

    with tl.facets.adding(heads_recipe):
        log = tl.trace(model, x)
    with torch.no_grad():
        want = model.proj(x).reshape(1, 3, 2, 4)
    assert torch.equal(log.modules["self"].facets["per_head"].value, want)


def test_hugging_face_config_scalars_are_snapshotted():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg).eval()
    log = tl.trace(model, torch.randint(0, 64, (1, 4)))
    attn = log.modules["model.layers.0.self_attn"]
    assert tl.facets.config_value(attn, "num_key_value_heads") == 2
    assert tl.facets.config_value(attn, "num_heads", "num_attention_heads") == 4
    assert attn.custom_attributes["config.hidden_size"] == 32
    assert attn.custom_attributes["head_dim"] == model.model.layers[0].self_attn.head_dim == 8

    gcfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                   bos_token_id=0, eos_token_id=0)
    gpt2 = transformers.GPT2LMHeadModel(gcfg).eval()
    glog = tl.trace(gpt2, torch.randint(0, 64, (1, 4)))
    model_rec = glog.modules["transformer"]
    # the config's attribute_map alias resolves to the stored field (num_attention_heads -> n_head)
    assert tl.facets.config_value(model_rec, "num_attention_heads") == gcfg.n_head == 4
