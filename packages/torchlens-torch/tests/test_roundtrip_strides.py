"""Loaded traces that replay (issue 12 §2): a non-contiguous saved view loads back with its
strides and storage offset (Mamba's and Wav2Vec2's padded-conv slices, `.real` of a complex
tensor), bounded and checked strictly on load; `torch.ops` packets of namespaces other than
aten (`prims`, `quantized::linear_dynamic`) re-bind through the closed callable table."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchlens as tl
from torchlens.errors import TorchLensError
from torchlens_torch.callables import resolve_callable


class PaddedConv(nn.Module):
    """Mamba / Wav2Vec2: a padded conv1d sliced back to the sequence length, then silu/gelu
    on the strided slice (and `.real` of a complex tensor, a stride-2 view)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(64, 64, 4, padding=3, groups=64)

    def forward(self, x):
        h = self.conv(x)[..., : x.shape[-1]]
        a = F.silu(h) + F.gelu(h)
        f = torch.fft.rfft(a, dim=-1)
        return a.sum() + f.real.sum(-1).mean() + a[:, 3:40:3, 1:].exp().sum()


def _layouts(trace):
    return {o.label: (tuple(o.out.stride()), o.out.storage_offset())
            for o in trace.ops if o.saved and isinstance(o.out, torch.Tensor) and not o.out.is_contiguous()}


def test_non_contiguous_views_keep_strides_and_offset_and_replay_after_load(tmp_path):
    torch.manual_seed(0)
    trace = tl.trace(PaddedConv(), torch.randn(1, 64, 8))
    before = _layouts(trace)
    assert len(before) >= 3  # the slice, `.real` and the stepped slice with an offset
    assert any(off for _, off in before.values())
    loaded = tl.load(trace.save(tmp_path / "t.tlspec"))
    assert _layouts(loaded) == before
    for label in before:  # same values too
        assert torch.equal(loaded.ops[label].out, trace.ops[label].out)
    assert loaded.validate_forward_pass(), loaded.validation_replay_status


def test_a_view_needing_a_large_buffer_is_stored_contiguous(tmp_path):
    """A narrow slice of a wide tensor would need its whole row span: beyond the bound it is
    stored compactly (bounded allocation on load) and still loads with its values."""
    class Narrow(nn.Module):
        def forward(self, x):
            return (x * 2)[:, :1].exp()

    torch.manual_seed(0)
    trace = tl.trace(Narrow(), torch.randn(4, 1000))
    view = trace.ops["getitem_1_2"]
    assert view.out.stride() == (1000, 1)
    loaded = tl.load(trace.save(tmp_path / "n.tlspec"))
    assert loaded.ops["getitem_1_2"].out.is_contiguous()
    assert torch.equal(loaded.ops["getitem_1_2"].out, view.out)


# --- the layout metadata is checked like the rest of a hostile file ---------------------------

def _reseal(root):
    m = json.loads((root / "manifest.json").read_text())
    for name in m["files"]:
        data = (root / name).read_bytes()
        m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (root / "manifest.json").write_text(json.dumps(m))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    return tl.trace(PaddedConv(), torch.randn(1, 64, 8)).save(tmp_path_factory.mktemp("strides") / "t.tlspec")


@pytest.mark.parametrize("meta", [
    {"strides": "11,1"},  # one stride short
    {"strides": "704,11,-1"}, {"strides": "704,x,1"}, {"strides": "704,11,1", "offset": "-3"},
    {"strides": "704,0,1"},  # overlapping (a zero stride over a long axis)
    {"strides": "704,1,1"},  # overlapping
    {"strides": "704,99999999999,1"},  # a buffer far beyond the bound
    {"offset": "999999999999"},
    {"perm": "1,0,2"},  # a permutation on top of strides
], ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_bad_layout_metadata_refuses_typed_in_load_and_validate(saved, tmp_path, meta):
    dst = tmp_path / "bad.tlspec"
    shutil.copytree(saved, dst)
    p = dst / "records" / "payloads.json"
    table = json.loads(p.read_text())
    cols = table["columns"]
    row = next(r for r in table["rows"] if "strides" in r[cols.index("meta")] and len(r[cols.index("shape")]) == 3)
    row[cols.index("meta")].update(meta)
    p.write_text(json.dumps(table, separators=(",", ":")))
    _reseal(dst)
    for fn in (tl.load, tl.validation.validate_tlspec):
        with pytest.raises(TorchLensError) as info:
            fn(dst)
        assert info.value.code == "payload_meta_invalid"


# --- torch.ops packets of other namespaces ----------------------------------------------------

class PrimsSin(nn.Module):
    def forward(self, x):
        return torch.ops.prims.sin(x * 2) + 1


def test_an_ops_packet_of_another_namespace_rebinds_after_load(tmp_path):
    torch.manual_seed(0)
    trace = tl.trace(PrimsSin(), torch.randn(3))
    loaded = tl.load(trace.save(tmp_path / "p.tlspec"))
    op = next(o for o in loaded.ops if o.func_name == "sin")
    assert op.func is torch.ops.prims.sin
    assert loaded.validate_forward_pass(), loaded.validation_replay_status


def test_quantized_linear_dynamic_rebinds_by_identity(tmp_path):
    model = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval(), {nn.Linear},
                                                   dtype=torch.qint8)
    trace = tl.trace(model, torch.randn(2, 8))
    loaded = tl.load(trace.save(tmp_path / "q.tlspec"))
    op = next(o for o in loaded.ops if o.func_name == "linear_dynamic")
    assert op.func is torch.ops.quantized.linear_dynamic  # was an opaque op under a mangled pybind name
    # the packed qint8 weight (a torch.ScriptObject) travels as its contents (codec_packed): replay works
    assert loaded.validate_forward_pass() is True


@pytest.mark.parametrize("name", [
    "torch.ops.c10d.barrier", "torch.ops.debugprims.load_tensor", "torch.ops.profiler._record_function_enter",
    "torch.ops.inductor.resize_storage_bytes_", "torch.ops.load_library", "torch.ops.quantized.__class__",
    "torch.ops.quantized.linear_dynamic.__call__", "torch.ops.aten.from_file", "torch.ops.os.system",
    "torch.ops.prims.no_such_op",
])
def test_other_ops_names_never_bind(name):
    assert resolve_callable(name) is None
