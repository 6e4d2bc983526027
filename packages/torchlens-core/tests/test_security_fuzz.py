"""Hostile files: bounded allocation, typed loader refusals, and a seeded fuzz suite.

The targeted tests reproduce the issue's findings (a declared blob size of 10**15 or 3 GiB,
20,000 one-wide subspace rows, a deeply nested manifest, spec file names outside the spec,
validate_tlspec accepting what tl.load refuses). The fuzz test runs
`torchlens_conformance.hostile` over every artifact kind the reference backend writes (trace,
intervention spec, recipe, safetensors export); TORCHLENS_FUZZ_BIG=1 runs ten times more.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tracemalloc

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import ArtifactError, TorchLensError
from torchlens_conformance.hostile import Template, fuzz

BIG = os.environ.get("TORCHLENS_FUZZ_BIG") == "1"


@pytest.fixture
def setup():
    from torchlens_reference import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    rng = np.random.default_rng(0)
    return model, rng.standard_normal((3, 4)).astype(np.float32), rng


def _reseal(root):
    """What an attacker does after an edit: rewrite the manifest's sizes and digests."""
    m = json.loads((root / "manifest.json").read_text())
    for name in m["files"]:
        data = (root / name).read_bytes()
        m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (root / "manifest.json").write_text(json.dumps(m))


def _refusal(fn, *args):
    """(code, peak traced bytes) of a call that must refuse with a typed error. One untraced call
    first: the modules a loader imports on first use are not an allocation the input caused."""
    try:
        fn(*args)
    except TorchLensError:
        pass
    tracemalloc.start()
    try:
        with pytest.raises(TorchLensError) as info:
            fn(*args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return info.value.code, peak


@pytest.mark.parametrize("declared", [3 * 2**30, 10**15])
def test_declared_blob_size_is_checked_against_the_file_before_allocating(tmp_path, declared):
    path = (tl.when("relu_1_2", tl.steer(np.ones(4, np.float32), 2.0))).save(tmp_path / "r.tlspec")
    m = json.loads((path / "manifest.json").read_text())
    m["files"]["blobs/recipe-0000.safetensors"]["size"] = declared
    (path / "manifest.json").write_text(json.dumps(m))
    for fn in (tl.load, tl.validation.validate_tlspec, tl.io.load_intervention_spec):
        code, peak = _refusal(fn, path)
        assert code == "artifact_size_mismatch"
        assert peak < 1024 * 1024  # was: 3 GiB allocated and hashed, or a raw MemoryError


def test_many_one_wide_subspace_rows_refuse_before_rows_at_rows_t(tmp_path, setup):
    model, x, _ = setup
    fork = tl.trace(model, x).fork().do(tl.subspace("linear_1_1", np.eye(4)[:1]), tl.zero_ablate())
    path = tl.io.save_intervention(fork, tmp_path / "s.tlspec")
    doc = json.loads((path / "intervention.json").read_text())
    rows = [[1.0]] * 20000  # 20,000 rows of width 1: rows @ rows.T would be 20000 x 20000 float64 (3.2 GB)
    kwargs = dict(doc["rules"][0]["edit"]["kwargs"])
    kwargs["rows"] = rows
    kwargs["rows_sha256"] = hashlib.sha256(np.asarray(rows, np.float64).tobytes()).hexdigest()
    doc["rules"][0]["edit"]["kwargs"] = [[k, v] for k, v in kwargs.items()]
    doc["tensors"] = {}
    (path / "intervention.json").write_text(json.dumps(doc))
    (path / "blobs" / "recipe-0000.safetensors").unlink()
    m = json.loads((path / "manifest.json").read_text())
    del m["files"]["blobs/recipe-0000.safetensors"]
    (path / "manifest.json").write_text(json.dumps(m))
    _reseal(path)
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    code, peak = _refusal(tl.load, path)
    assert code == "subspace_spec_basis_not_orthonormal"
    assert peak < 64 * size + 8 * 2**20, (peak, size)


def test_deeply_nested_manifest_is_a_typed_refusal(tmp_path):
    path = tl.when("relu_1_2", tl.scale(2.0)).save(tmp_path / "r.tlspec")
    (path / "manifest.json").write_text("[" * 100000 + "]" * 100000)
    for fn in (tl.load, tl.validation.validate_tlspec):
        code, _ = _refusal(fn, path)
        assert code == "manifest_malformed"  # was: RecursionError from the pre-read in tl.load
    assert tl.io.detect_tlspec_format(path) == "unknown"


@pytest.mark.parametrize("name", ["/etc/passwd", "../../outside.txt", "blobs/../../outside.txt", "intervention.json\x00",
                                  "records/ops.json"])
def test_spec_file_names_are_confined_to_the_spec_layout(tmp_path, name):
    (tmp_path / "outside.txt").write_text("secret")
    path = tl.when("relu_1_2", tl.scale(2.0)).save(tmp_path / "a" / "b" / "r.tlspec")
    m = json.loads((path / "manifest.json").read_text())
    m["files"][name] = {"sha256": "0" * 64, "size": 6}
    (path / "manifest.json").write_text(json.dumps(m))
    for fn in (tl.load, tl.validation.validate_tlspec, tl.io.load_intervention_spec):
        code, _ = _refusal(fn, path)
        assert code == "manifest_malformed"  # was: probed (artifact_file_missing vs. loads) outside the spec


def test_validate_tlspec_reads_specs_and_refuses_exactly_what_load_refuses(tmp_path, setup):
    model, x, _ = setup
    recipe = tl.when("relu_1_2", tl.steer(np.ones(4, np.float32), 2.0))
    path = recipe.save(tmp_path / "r.tlspec")
    assert tl.validation.validate_tlspec(path)["kind"] == "recipe"  # was: manifest_malformed on every spec
    t = tl.trace(model, x)
    saved = t.save(tmp_path / "t.tlspec")
    # codec "pickle": load refused, validate accepted
    bad = tmp_path / "codec.tlspec"
    shutil.copytree(saved, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["codec"] = "pickle"
    (bad / "manifest.json").write_text(json.dumps(m))
    assert _refusal(tl.load, bad)[0] == _refusal(tl.validation.validate_tlspec, bad)[0] == "payload_codec_unavailable"
    # an op marked saved=false that still carries payloads (digests resealed)
    bad = tmp_path / "saved.tlspec"
    shutil.copytree(saved, bad)
    table = json.loads((bad / "records" / "ops.json").read_text())
    col = table["columns"].index("saved")
    out = table["columns"].index("outputs")
    row = next(r for r in table["rows"] if r[col] and any(v is not None for v in r[out]))
    row[col] = False
    (bad / "records" / "ops.json").write_text(json.dumps(table, separators=(",", ":")))
    _reseal(bad)
    assert _refusal(tl.load, bad)[0] == _refusal(tl.validation.validate_tlspec, bad)[0] == "record_schema_invalid"


def test_trace_manifest_codec_must_match_its_blobs(tmp_path, setup):
    model, x, _ = setup
    saved = tl.trace(model, x).save(tmp_path / "t.tlspec")
    blob = next((saved / "blobs").iterdir())
    raw = blob.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    head["__metadata__"]["codec"] = "torch"  # the blob (digested) disagrees with the manifest's codec
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    blob.write_bytes(raw[:8] + text + raw[8 + n:])
    _reseal(saved)
    assert _refusal(tl.load, saved)[0] == _refusal(tl.validation.validate_tlspec, saved)[0] == "blob_malformed"


def test_export_carries_a_content_digest(tmp_path, setup):
    model, x, _ = setup
    path = tl.export.safetensors(tl.trace(model, x), tmp_path / "e.safetensors")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # one payload bit
    path.write_bytes(bytes(raw))
    assert _refusal(tl.io.read_safetensors, path)[0] == "artifact_digest_mismatch"  # was: loaded the changed value


def test_export_header_of_the_wrong_shape_is_typed(tmp_path, setup):
    from torchlens.io import blobfile
    from torchlens.io.trace_safetensors import DIGEST_KEY, SCHEMA

    model, x, _ = setup
    path = tl.export.safetensors(tl.trace(model, x), tmp_path / "e.safetensors")
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    inner = json.loads(head["__metadata__"][SCHEMA])
    inner["accuracy"] = []  # was: AttributeError ('list' object has no attribute 'get')
    head["__metadata__"][SCHEMA] = json.dumps(inner)
    meta = {k: v for k, v in head["__metadata__"].items() if k != DIGEST_KEY}
    text = json.dumps(head).encode()
    fake = blobfile.Blob("e", {}, meta, raw[:8] + raw[8 + n:])  # digest: metadata, then the data section
    head["__metadata__"][DIGEST_KEY] = blobfile.content_digest(fake, DIGEST_KEY, 8)
    text = json.dumps(head).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    assert _refusal(tl.io.read_safetensors, path)[0] == "safetensors_export_invalid"


def test_read_blob_refuses_a_size_that_is_not_the_files(tmp_path):
    from torchlens.io import blobfile

    p = tmp_path / "b.safetensors"
    p.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ArtifactError) as info:
        blobfile.read_blob(str(p), "b", 10**15, None)
    assert info.value.code == "artifact_size_mismatch"


def _templates(tmp_path):
    from torchlens_reference.zoo import zoo

    out = []
    for name, entry in sorted(zoo().items())[:3]:
        if "reseed" in entry:
            entry["reseed"]()
        t = tl.trace(entry["model"], *entry["args"], input_kwargs=entry["kwargs"])
        t.annotations = {"opaque": object(), "shared": t.ops[1].out, "nested": {"a": (1, 2.5, None)}}
        out.append(Template(f"trace:{name}", t.save(tmp_path / "templates" / f"{name}.tlspec"), "tlspec"))
        out.append(Template(f"export:{name}", tl.export.safetensors(t, tmp_path / "templates" / f"{name}.safetensors"),
                            "safetensors"))
    from torchlens_reference import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    basis = np.linalg.qr(rng.standard_normal((4, 4)))[0].T[:2]
    fork = tl.trace(model, x).fork().do(tl.subspace("linear_1_1", basis), tl.replace_with(np.ones((3, 4), np.float32)))
    out.append(Template("spec:subspace", tl.io.save_intervention(fork, tmp_path / "templates" / "s.tlspec"), "spec"))
    audit = tl.trace(model, x).fork().do("relu_1_2", lambda v, *, ctx: v * 2)
    out.append(Template("spec:audit", tl.io.save_intervention(audit, tmp_path / "templates" / "a.tlspec", level="audit"),
                        "spec"))
    recipe = (tl.when("relu_1_2", tl.steer(np.ones(4, np.float32), 2.0))
              & tl.when(tl.module("2") | tl.func("relu") - tl.label("x"), tl.clamp(-1.0, 1.0)))
    out.append(Template("recipe", recipe.save(tmp_path / "templates" / "r.tlspec"), "spec"))
    return out


def test_hostile_files_fuzz(tmp_path):
    report = fuzz(_templates(tmp_path), cases=5000 if BIG else 500, seed=20260607, workdir=tmp_path / "cases",
                  alloc_a=64.0, alloc_b=8 * 2**20)
    print("\nhostile files (reference backend):", report.summary())
    assert report.failures == [], "\n".join(report.failures[:20])
    assert report.outcomes["raw"] == 0
    assert len(report.codes) >= 12, report.codes  # the mutations reach many distinct checks
    assert report.outcomes["equal"] > 0 and report.outcomes["refused"] > report.cases // 2
