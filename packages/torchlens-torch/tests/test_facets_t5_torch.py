"""T5's MLP facets: `DenseReluDense` sits inside the residual wrapper `T5LayerFF`, not
directly in the block; pre / pre_linear / post / out equal forward hooks on its projections."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("ff", ["relu", "gated-gelu"])
def test_t5_mlp_facets_equal_forward_hooks(ff):
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                feed_forward_proj=ff, decoder_start_token_id=0)
    model = transformers.T5EncoderModel(cfg).eval()
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    log = tl.trace(model, ids)
    mlps = [m.address for m in log.modules_with_facet("post")]
    assert mlps == [f"encoder.block.{i}.layer.1.DenseReluDense" for i in range(2)]

    seen: dict = {}
    dense = model.encoder.block[1].layer[1].DenseReluDense
    first = dense.wi if ff == "relu" else dense.wi_0
    handles = [first.register_forward_hook(lambda m, i, o: seen.__setitem__("pre", o)),
               dense.wo.register_forward_pre_hook(lambda m, i: seen.__setitem__("post", i[0])),
               dense.register_forward_hook(lambda m, i, o: seen.__setitem__("out", o))]
    if ff != "relu":
        handles.append(dense.wi_1.register_forward_hook(lambda m, i, o: seen.__setitem__("pre_linear", o)))
    model(ids)
    for h in handles:
        h.remove()

    f = log.modules["encoder.block.1.layer.1.DenseReluDense"].facets
    for name in seen:
        assert torch.equal(f[name].value, seen[name]), name
    assert ("pre_linear" in f) == (ff != "relu")
    # the wrapper itself is not an MLP: its output is the residual add
    assert "post" not in log.modules["encoder.block.1.layer.1"].facets
