"""Attention facets of bfloat16 models: the reconstruction checks (per-head `result` summed with
the bias vs the output projection; SDPA's pattern @ V vs the kernel's output) scale their bound
with the dtype's epsilon, so a bf16 model reads `result` and `pattern`, while a float32 value that
is really off still refuses with facet_reconstruction_mismatch."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl

pytest.importorskip("transformers")
from facet_models import gpt2, ids, llama  # noqa: E402

BF16_EPS = torch.finfo(torch.bfloat16).eps


def _proj(model):
    if hasattr(model, "transformer"):
        return model.transformer.h[0].attn.c_proj, "transformer.h.0.attn"
    return model.model.layers[0].self_attn.o_proj, "model.layers.0.self_attn"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_bf16_result_sums_to_the_output_projection_within_bf16_rounding(make, attn):
    model = make(attn).to(torch.bfloat16)
    proj, address = _proj(model)
    seen = {}

    def hook(mod, args, out):
        seen["z"], seen["out"] = args[0].detach(), out.detach()

    h = proj.register_forward_hook(hook)
    try:
        log = tl.trace(model, ids(), save="all")
    finally:
        h.remove()
    f = log.modules[address].facets
    result, pattern = f["result"].value, f["pattern"].value
    assert result.dtype == torch.bfloat16
    n_heads = result.shape[-2]
    # hand computation in float32 from the projection's captured input and its own weight
    w_io = proj.weight.float() if type(proj).__name__ == "Conv1D" else proj.weight.float().t()
    z = seen["z"].float().reshape(*seen["z"].shape[:-1], n_heads, -1)
    hand = torch.einsum("...hd,hdm->...hm", z, w_io.reshape(n_heads, z.shape[-1], -1))
    assert torch.all((result.float() - hand).abs() <= BF16_EPS / 2 * hand.abs() + 1e-30)  # one bf16 rounding
    # summed over heads + bias vs the captured output: one rounding per head and one of the kernel's output
    bias = proj.bias.float() if proj.bias is not None else torch.zeros(())
    total = result.float().sum(-2) + bias
    captured = seen["out"].float()
    bound = BF16_EPS * (result.float().abs().sum(-2) + bias.abs() + captured.abs())
    assert torch.all((total - captured).abs() <= bound)
    assert torch.allclose(pattern.float().sum(-1), torch.ones(()), atol=4 * BF16_EPS)


def _corrupt(log, label):
    log._ops[label].outs[0].add_(1e-3)


def test_a_float32_projection_output_that_is_off_still_refuses():
    model = gpt2("eager")
    log = tl.trace(model, ids(), save="all")
    out_label = log._modules["transformer.h.0.attn.c_proj"].calls[0].output_labels[0]
    assert log.modules["transformer.h.0.attn"].facets["result"].shape[-2] == 4
    _corrupt(log, out_label)
    with pytest.raises(tl.errors.FacetError) as exc:
        log.modules["transformer.h.0.attn"].facets["result"].value
    assert exc.value.code == "facet_reconstruction_mismatch"


def test_a_float32_sdpa_output_that_is_off_still_refuses():
    model = llama("sdpa")
    log = tl.trace(model, ids(), save="all")
    sdpa = next(o for o in log._ops.values() if o.func_name == "scaled_dot_product_attention"
                and o.module == "model.layers.0.self_attn")
    _corrupt(log, sdpa.label)
    with pytest.raises(tl.errors.FacetError) as exc:
        log.modules["model.layers.0.self_attn"].facets["pattern"].value
    assert exc.value.code == "facet_reconstruction_mismatch"
