"""Saving torch payloads: the torch codec is bit-exact for every dtype, and torch traces
round-trip through Trace.save / tl.load (the latter once the torch backend is installed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchlens_torch")

import torchlens as tl  # noqa: E402
from torchlens.io import blobfile  # noqa: E402
from torchlens_torch.codec import TorchCodec  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128, torch.bool,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
DTYPES += [getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def _sample(dtype, shape=(3, 5)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 100
    if dtype.is_complex:
        return torch.complex(x, -x).to(dtype)
    if dtype == torch.bool:
        return x > 0
    if dtype.is_floating_point:
        return x.to(dtype)
    return x.abs().to(torch.int64).to(dtype)


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).tolist() if t.numel() else []


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)


@pytest.mark.parametrize("lazy", [False, True])
def test_codec_round_trips_every_dtype_bit_exactly(tmp_path, lazy):
    codec = TorchCodec()
    values = {str(dt): _sample(dt) for dt in DTYPES}
    values.update({
        "scalar_bf16": torch.tensor(3.5, dtype=torch.bfloat16), "empty_c128": torch.zeros(0, 4, dtype=torch.complex128),
        "strided": torch.randn(4, 6)[:, ::2], "conj": _sample(torch.complex64).conj(),
        "nan_bf16": torch.tensor([float("nan"), float("inf"), -0.0], dtype=torch.bfloat16),
        "param": torch.nn.Parameter(torch.randn(2, 2)),
    })
    enc = {k: codec.encode(v) for k, v in values.items()}
    path = tmp_path / "b.safetensors"
    size, sha = blobfile.write_blob(str(path), list(enc.items()), {})
    blob = blobfile.read_blob(str(path), "b", size, sha, lazy=lazy)
    for k, v in values.items():
        e = enc[k]
        out = codec.decode(blobfile.payload_from_storage(blob, k, e.dtype, e.shape, e.meta))
        want = v.detach().resolve_conj()
        assert _same(out, want), k
    assert isinstance(codec.decode(blobfile.payload_from_storage(blob, "param", *[getattr(enc["param"], a) for a in
                                                                              ("dtype", "shape", "meta")])),
                      torch.nn.Parameter)


def test_bfloat16_blobs_open_with_safetensors_torch(tmp_path):
    from safetensors.torch import load_file

    codec = TorchCodec()
    t = _sample(torch.bfloat16)
    path = tmp_path / "b.safetensors"
    blobfile.write_blob(str(path), [("x", codec.encode(t))], {})
    assert torch.equal(load_file(str(path))["x"], t)


def _torch_trace(model, *args):
    pytest.importorskip("torchlens_torch.backend")
    from torchlens.backends.registry import get_protocol

    if not hasattr(get_protocol("torch"), "payload_codec"):
        pytest.skip("the torch backend does not offer payload_codec() yet")
    return tl.trace(model, *args, backend="torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_torch_model_round_trips(tmp_path, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).to(dtype)
    t = _torch_trace(model, torch.randn(2, 4, dtype=dtype))
    loaded = tl.load(t.save(tmp_path / "m.tlspec"))
    assert tl.io.trace_differences(t, loaded) == []
    for a, b in zip(t, loaded):
        if a.saved:
            assert all(_same(x, y) for x, y in zip(a.outs, b.outs) if isinstance(x, torch.Tensor))


def test_complex_payloads_round_trip(tmp_path):
    class Spectral(torch.nn.Module):
        def forward(self, x):
            return torch.fft.fft(x).abs()

    t = _torch_trace(Spectral(), torch.randn(2, 8))
    loaded = tl.load(t.save(tmp_path / "c.tlspec"), lazy=True)
    assert tl.io.trace_differences(t, loaded) == []
    assert any(op.saved and op.dtype and "complex" in op.dtype for op in loaded)
