"""tl.facets.patching against brute force: forward hooks patching one head at a time, and
grad * (clean - corrupt) computed with torch.autograd (spec/facets.md "Patching")."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl

tf = pytest.importorskip("transformers")

D = 8  # d_head


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                             bos_token_id=0, eos_token_id=0)).eval()
    g = torch.Generator().manual_seed(3)
    clean, corrupt = torch.randint(0, 64, (1, 5), generator=g), torch.randint(0, 64, (1, 5), generator=g)
    return model, clean, corrupt


def _metric_logits(logits):
    return logits[0, -1, 7]


def metric(log):
    return _metric_logits(log.output_ops[0].out)


def _c_proj_inputs(model, ids):
    seen = []
    hooks = [b.attn.c_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
             for b in model.transformer.h]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


def test_activation_patch_attention_heads_equals_a_hook_loop(setup):
    model, clean, corrupt = setup
    got = tl.facets.patching.activation_patch_attention_heads(model, clean, corrupt, metric)
    clean_in = _c_proj_inputs(model, clean)
    want = torch.zeros(2, 4, dtype=torch.float64)
    for layer, block in enumerate(model.transformer.h):
        for head in range(4):
            def pre(m, args, layer=layer, head=head):
                x = args[0].clone()
                x[..., head * D:(head + 1) * D] = clean_in[layer][..., head * D:(head + 1) * D]
                return (x,)

            h = block.attn.c_proj.register_forward_pre_hook(pre)
            with torch.no_grad():
                want[layer, head] = float(_metric_logits(model(corrupt).logits))
            h.remove()
    assert got.shape == (2, 4)
    assert torch.allclose(torch.from_numpy(got), want, atol=1e-5)


def test_attribution_patch_attention_heads_equals_grad_times_difference(setup):
    model, clean, corrupt = setup
    got = tl.facets.patching.attribution_patch_attention_heads(model, clean, corrupt, metric)
    clean_in = _c_proj_inputs(model, clean)
    leaves = []

    def pre(m, args):  # keep the graph: a later layer's attention also depends on this input
        leaves.append(args[0])

    hooks = [b.attn.c_proj.register_forward_pre_hook(pre) for b in model.transformer.h]
    out = _metric_logits(model(corrupt).logits)
    for h in hooks:
        h.remove()
    grads = torch.autograd.grad(out, leaves)
    want = torch.stack([((g * (c - x.detach())).reshape(*g.shape[:-1], 4, D).sum((0, 1, 3)))
                        for g, c, x in zip(grads, clean_in, leaves)]).double()
    assert got.shape == (2, 4)
    assert torch.allclose(torch.from_numpy(got), want, atol=1e-5)
    assert want.abs().max() > 0  # a non-vacuous comparison


def test_layer_patching_helpers_have_the_spec_shapes(setup):
    model, clean, corrupt = setup
    attn = tl.facets.patching.activation_patch_attention_output(model, clean, corrupt, metric)
    mlp = tl.facets.patching.activation_patch_mlp_output(model, clean, corrupt, metric)
    resid = tl.facets.patching.activation_patch_residual_stream(model, clean, corrupt, metric, per_position=False)
    assert attn.shape == (2,) and mlp.shape == (2,) and resid.shape == (2,)
    with torch.no_grad():
        assert abs(resid[0] - float(_metric_logits(model(clean).logits))) < 1e-5  # block 0's input is all of it
