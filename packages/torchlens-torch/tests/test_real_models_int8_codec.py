"""Issue 12 (int8 dynamic quantization): the packed weight argument of
`quantized::linear_dynamic` (a torch ScriptObject) is saved by its content and rebuilt on
load, strictly checked (`torchlens_torch.codec_packed`). Before this, it was saved as text
and a loaded trace could not replay the call (validate said missing_saved_args)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import ArtifactError
from torchlens.io.codec import EncodedPayload
from torchlens_torch.codec import TorchCodec


def _packed(per_channel: bool, bias: bool) -> torch.ScriptObject:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 5, generator=g)
    if per_channel:
        scales = w.abs().amax(1).double() / 127
        q = torch.quantize_per_channel(w, scales, torch.zeros(6, dtype=torch.long), 0, torch.qint8)
    else:
        q = torch.quantize_per_tensor(w, float(w.abs().max()) / 127, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, torch.randn(6, generator=g) if bias else None)


@pytest.mark.parametrize("per_channel,bias", [(False, True), (True, False), (True, True), (False, False)])
def test_packed_linear_round_trips_bit_exact(per_channel: bool, bias: bool) -> None:
    codec, p = TorchCodec(), _packed(per_channel, bias)
    assert codec.can_encode(p)
    back = codec.decode(codec.encode(p))
    (w0, b0), (w1, b1) = torch.ops.quantized.linear_unpack(p), torch.ops.quantized.linear_unpack(back)
    assert torch.equal(w0.int_repr(), w1.int_repr()) and w0.qscheme() == w1.qscheme()
    if per_channel:
        assert torch.equal(w0.q_per_channel_scales(), w1.q_per_channel_scales())
    else:
        assert w0.q_scale() == w1.q_scale() and w0.q_zero_point() == w1.q_zero_point()
    assert (b0 is None and b1 is None) or torch.equal(b0, b1)
    x = torch.randn(4, 5)
    assert torch.equal(torch.ops.quantized.linear_dynamic(x, p, True), torch.ops.quantized.linear_dynamic(x, back, True))


def _tampered(**changes: str) -> EncodedPayload:
    enc = TorchCodec().encode(_packed(False, True))
    meta = {**enc.meta, **changes}
    return EncodedPayload(enc.array, enc.dtype, enc.shape, {k: v for k, v in meta.items() if v != "<drop>"})


@pytest.mark.parametrize("changes", [
    {"scale": "nan"}, {"scale": "-1.0"}, {"scale": "1e999"}, {"zero_point": "300"}, {"zero_point": "1.5"},
    {"weight": "6,4"}, {"weight": "0,5"}, {"weight": "99999999999,99999999999"}, {"weight": "6"},
    {"qscheme": "per_channel_affine"}, {"qscheme": "exec"}, {"bias": "<drop>"}, {"bias": "0"}, {"extra": "1"},
    {"packed": "quantized.conv2d"}, {"axis": "0"},
])
def test_a_tampered_packed_payload_refuses_typed(changes: dict) -> None:
    with pytest.raises(ArtifactError) as info:
        TorchCodec().decode(_tampered(**changes))
    assert info.value.code == "payload_meta_invalid"


def test_a_packed_payload_with_the_wrong_bytes_refuses_typed() -> None:
    enc = TorchCodec().encode(_packed(True, True))
    for arr in (enc.array[:-1], np.concatenate([enc.array, enc.array[:1]])):
        with pytest.raises(ArtifactError) as info:
            TorchCodec().decode(EncodedPayload(arr, "uint8", (arr.size,), dict(enc.meta)))
        assert info.value.code == "payload_meta_invalid"
    bad = np.array(enc.array, copy=True)
    bad[6 * 5:6 * 5 + 8] = np.frombuffer(np.float64(np.nan).tobytes(), dtype=np.uint8)  # first channel scale
    with pytest.raises(ArtifactError):
        TorchCodec().decode(EncodedPayload(bad, "uint8", (bad.size,), dict(enc.meta)))


def test_a_loaded_int8_trace_replays_an_edit_like_the_live_model(tmp_path) -> None:
    """Independent oracle: a forward hook zeroing fc1's output on the quantized model."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).eval(),
                                                   {nn.Linear}, dtype=torch.qint8)
        x = torch.randn(2, 8)
        trace = tl.trace(m, x)
        trace.save(tmp_path / "q.tlspec")
        loaded = tl.load(tmp_path / "q.tlspec")
        assert loaded.validate_forward_pass()
        fork = loaded.fork().do(tl.module("0"), tl.zero_ablate())
    h = m[0].register_forward_hook(lambda mod, i, o: torch.zeros_like(o))
    try:
        want = m(x)
    finally:
        h.remove()
    assert torch.equal(fork.output_ops[0].out, want)
