"""Save/load round trips with the reference backend: every record field and payload equal."""

from __future__ import annotations

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import ArtifactError, PayloadUnavailableError
from torchlens.io.schema import SCHEMAS
from torchlens.types import UnencodableValue
from torchlens_reference.zoo import zoo

ZOO = zoo()


def _trace(name):
    entry = ZOO[name]
    if "reseed" in entry:
        entry["reseed"]()
    return tl.trace(entry["model"], *entry["args"], input_kwargs=entry["kwargs"])


def assert_same(original, loaded):
    assert tl.io.trace_differences(original, loaded) == []
    # independent of the encoder: labels, graph, modules, calls, params and payload bits
    assert loaded.labels == original.labels and loaded.layer_labels == original.layer_labels
    assert loaded.graph_edges == original.graph_edges
    assert list(loaded._modules) == list(original._modules)
    assert list(loaded._module_calls) == list(original._module_calls)
    for a, b in zip(original, loaded):
        for col, ctype in SCHEMAS["ops"]:
            if col in ("outputs", "grads", "func", "site", "meta", "args_template", "kwargs_template"):
                continue
            x, y = getattr(a, col), getattr(b, col)
            assert x == y and type(x) is type(y), (a.label, col, x, y)
        assert a.saved == b.saved
        if a.saved:
            for x, y in zip(a.outs, b.outs):
                assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        # the reference backend re-binds its own ops' callables by name on load
        assert b.func is a.func
    for addr, p in original._params.items():
        q = loaded._params[addr]
        assert (q.shape, q.dtype, q.trainable, q.consumer_labels) == (p.shape, p.dtype, p.trainable, p.consumer_labels)
        assert q.value.tobytes() == p.value.tobytes() and q.value.dtype == p.value.dtype
    assert loaded.provenance == original.provenance and loaded.cost == original.cost


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("lazy", [False, True])
def test_zoo_model_round_trips(tmp_path, name, lazy):
    t = _trace(name)
    path = t.save(tmp_path / f"{name}.tlspec")
    loaded = tl.load(path, lazy=lazy)
    assert_same(t, loaded)
    assert loaded.backend == "reference" and loaded._backend is not None


def test_loaded_trace_reads_like_the_original(tmp_path):
    from torchlens_reference import nn

    t = tl.trace(nn.LoopNet(), np.ones((2, 4), np.float32))
    loaded = tl.load(t.save(tmp_path / "loop.tlspec"))
    assert np.array_equal(loaded["linear_2_2:3"].out, t["linear_2_2:3"].out)
    assert loaded.layers["linear_2_2"].num_passes == 3
    assert loaded.modules["cell"].num_calls == 3 and loaded["cell:2"].label == "cell:2"
    assert loaded.ops["linear_2_2:2"].parents == ("tanh_1_3:1",)
    with pytest.raises(PayloadUnavailableError) as exc:
        loaded.output
    assert exc.value.code == "output_not_stored"


def test_resave_of_a_loaded_trace_is_identical(tmp_path):
    t = _trace("loop")
    a = t.save(tmp_path / "a.tlspec")
    b = tl.load(a).save(tmp_path / "b.tlspec")
    for f in sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.name != "manifest.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_unencodable_values_load_as_stand_ins_and_are_disclosed(tmp_path):
    class Opaque:
        def __repr__(self):
            return "<opaque " + "x" * 400 + ">"

    t = _trace("mlp")
    shared = t.ops[1].out
    t.annotations = {"note": Opaque(), "ok": (1, 2.5, None, "s", [True]), "nan": float("nan"), "np": np.float32(1.5),
                     "alias": shared, "slice": slice(1, None, 2), "c": 1 + 2j, "b": b"\x00\xff"}
    path = t.save(tmp_path / "u.tlspec")
    manifest = tl.validation.validate_tlspec(path)
    assert manifest["disclosures"]["unencodable_values"] == 1
    loaded = tl.load(path)
    stand_in = loaded.annotations["note"]
    assert isinstance(stand_in, UnencodableValue)
    assert stand_in.type_name.endswith("Opaque") and len(stand_in.repr_text) == 256
    assert stand_in.at.startswith("trace[0].annotations")
    assert loaded.annotations["ok"] == (1, 2.5, None, "s", [True])
    assert np.isnan(loaded.annotations["nan"]) and type(loaded.annotations["np"]) is np.float32
    assert loaded.annotations["alias"] is loaded.ops[1].out  # aliasing survives
    assert loaded.annotations["slice"] == slice(1, None, 2) and loaded.annotations["c"] == 1 + 2j
    assert loaded.annotations["b"] == b"\x00\xff"
    with pytest.raises(Exception):
        stand_in.type_name = "x"  # frozen
    assert tl.io.trace_differences(t, loaded) == []


def test_dtypes_round_trip_bit_exactly(tmp_path):
    t = _trace("mlp")
    values = {
        "f16": np.array([1.5, -0.0, np.inf, np.nan], np.float16), "f64": np.array([np.pi, -1e308], np.float64),
        "c64": np.array([1 + 2j, np.nan - 1j], np.complex64), "c128": np.array([[3 - 4j]], np.complex128),
        "b": np.array([True, False]), "i8": np.array([-128, 127], np.int8), "u64": np.array([2**64 - 1], np.uint64),
        "big": np.array([1, 2], dtype=">i4"), "empty": np.zeros((0, 3), np.float32), "scalar": np.array(7, np.int16),
    }
    t.annotations = dict(values)
    loaded = tl.load(t.save(tmp_path / "d.tlspec"))
    for k, v in values.items():
        w = loaded.annotations[k]
        assert w.dtype == v.dtype and w.shape == v.shape and w.tobytes() == v.tobytes(), k


def test_structure_only_capture_round_trips(tmp_path):
    from torchlens_reference import nn

    t = tl.trace(nn.LoopNet(), np.ones((2, 4), np.float32), save="none")
    loaded = tl.load(t.save(tmp_path / "s.tlspec"))
    assert tl.io.trace_differences(t, loaded) == [] and not loaded.ops[1].saved


def test_blobs_open_with_the_safetensors_library(tmp_path):
    from safetensors.numpy import load_file

    t = _trace("mlp")
    path = t.save(tmp_path / "m.tlspec")
    blobs = list((path / "blobs").iterdir())
    assert blobs and all(load_file(str(b)) for b in blobs)
    assert not any(p.suffix in (".pkl", ".pt", ".pickle") for p in path.rglob("*"))


def test_detect_tlspec_format(tmp_path):
    t = _trace("mlp")
    assert tl.io.detect_tlspec_format(t.save(tmp_path / "a.tlspec")) == "v3"
    old = tmp_path / "old.tlspec"
    old.mkdir()
    (old / "manifest.json").write_text('{"tlspec_version": 1, "kind": "trace"}')
    assert tl.io.detect_tlspec_format(old) == "pre_3"
    with pytest.raises(ArtifactError) as exc:
        tl.load(old)
    assert exc.value.code == "manifest_version_unsupported"
    plain = tmp_path / "plain"
    plain.mkdir()
    assert tl.io.detect_tlspec_format(plain) == "unknown"
    (plain / "manifest.json").write_text("{not json")
    assert tl.io.detect_tlspec_format(plain) == "unknown"


def test_safetensors_export_round_trip(tmp_path):
    t = _trace("loop")
    path = tl.export.safetensors(t, tmp_path / "t.safetensors")
    back = tl.io.read_safetensors(path)
    assert back.header["schema"] == "tl_trace_safetensors_v1" and back.header["format_version"] == 3
    for op in t:
        if op.saved:
            x = back.tensors[f"ops/{op.label}/out/0"]
            assert x.dtype == op.out.dtype and x.tobytes() == op.out.tobytes()
        assert back.op_fields[op.label]["label"] == op.label
    assert back.op_fields["linear_2_2:2"]["parents"] == ["tanh_1_3:1"] or back.op_fields["linear_2_2:2"]["parents"] == ("tanh_1_3:1",)
    assert "func" in back.omitted["ops"]["linear_1_1"]
    assert back.trace_fields["provenance.backend"] == "reference"
    with pytest.raises(TypeError):
        back.op_fields["x"] = {}
    with pytest.raises(ArtifactError) as exc:
        tl.export.safetensors(t, path)
    assert exc.value.code == "bundle_path_exists"
    raw = bytearray(path.read_bytes())
    raw[12] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError) as exc:
        tl.io.read_safetensors(path)
    assert exc.value.code == "safetensors_export_invalid"


def test_import_torchlens_io_imports_no_framework():
    import subprocess
    import sys

    code = ("import sys, numpy as np, torchlens as tl; tl.io; tl.export; tl.types; tl.validation; "
            "bad = [m for m in ('torch', 'jax', 'tensorflow', 'paddle', 'mlx', 'tinygrad') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
