"""Integrity refusals of Trace.save / tl.load: each failure has its own registered code."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import ERROR_CODES, ArtifactError
from torchlens_reference import nn


@pytest.fixture
def trace():
    return tl.trace(nn.LoopNet(), np.ones((2, 4), np.float32))


@pytest.fixture
def saved(tmp_path, trace):
    return trace.save(tmp_path / "t.tlspec")


def _code(fn, *args, **kwargs):
    with pytest.raises(ArtifactError) as exc:
        fn(*args, **kwargs)
    assert exc.value.code in ERROR_CODES
    return exc.value.code


def _edit_manifest(path, fn):
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_save_refuses_an_existing_path_without_overwrite(tmp_path, trace, saved):
    assert _code(trace.save, saved) == "bundle_path_exists"
    trace.annotations = {"v": 2}
    trace.save(saved, overwrite=True)
    assert tl.load(saved).annotations == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.tlspec"]  # no temp or old dirs left


def test_overwrite_refuses_a_path_that_is_not_an_artifact(tmp_path, trace):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "precious.txt").write_text("keep")
    assert _code(trace.save, d, overwrite=True) == "bundle_path_not_artifact"
    assert (d / "precious.txt").read_text() == "keep"


def test_symlinks_refuse_at_save_and_load(tmp_path, trace, saved):
    link = tmp_path / "link.tlspec"
    link.symlink_to(saved)
    assert _code(trace.save, link, overwrite=True) == "save_path_symlink_rejected"
    assert _code(tl.load, link) == "load_path_symlink_rejected"
    real_parent = tmp_path / "real"
    real_parent.mkdir()
    parent_link = tmp_path / "plink"
    parent_link.symlink_to(real_parent)
    assert tl.load(trace.save(parent_link / "x.tlspec")).labels == trace.labels  # a symlinked parent passes
    blob = next((saved / "blobs").iterdir())
    moved = tmp_path / "blob.bin"
    os.rename(blob, moved)
    blob.symlink_to(moved)
    assert _code(tl.load, saved) == "load_path_symlink_rejected"


def test_manifest_symlink_refuses(tmp_path, saved):
    m = saved / "manifest.json"
    other = tmp_path / "m.json"
    os.rename(m, other)
    m.symlink_to(other)
    assert _code(tl.load, saved) == "load_path_symlink_rejected"
    assert _code(tl.io.detect_tlspec_format, saved) == "load_path_symlink_rejected"


@pytest.mark.parametrize("part", ["blobs", "records"])
def test_a_flipped_byte_refuses_with_a_digest_mismatch(saved, part):
    f = sorted((saved / part).iterdir())[-1]
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))
    assert _code(tl.load, saved) == "artifact_digest_mismatch"
    assert _code(tl.validation.validate_tlspec, saved) == "artifact_digest_mismatch"


def test_truncated_and_missing_files_refuse(saved):
    blob = next((saved / "blobs").iterdir())
    blob.write_bytes(blob.read_bytes()[:-3])
    assert _code(tl.load, saved) == "artifact_size_mismatch"
    blob.unlink()
    assert _code(tl.load, saved) == "artifact_file_missing"


def test_truncated_or_missing_manifest_refuses(saved):
    m = saved / "manifest.json"
    m.write_bytes(m.read_bytes()[:100])
    assert _code(tl.load, saved) == "manifest_malformed"
    m.unlink()
    assert _code(tl.load, saved) == "manifest_missing"


def test_unknown_format_version_refuses(saved):
    _edit_manifest(saved, lambda m: m.update(format_version=4))
    assert _code(tl.load, saved) == "manifest_version_unsupported"
    assert tl.io.detect_tlspec_format(saved) == "unknown"


def test_a_record_that_fails_its_schema_refuses(saved):
    import hashlib

    f = saved / "records" / "ops.json"
    table = json.loads(f.read_text())
    table["rows"][1][4] = "one"  # index must be an int
    data = json.dumps(table).encode()
    f.write_bytes(data)
    _edit_manifest(saved, lambda m: m["files"]["records/ops.json"].update(sha256=hashlib.sha256(data).hexdigest(),
                                                                         size=len(data)))
    assert _code(tl.load, saved) == "record_schema_invalid"
    assert _code(tl.validation.validate_tlspec, saved) == "record_schema_invalid"


def test_a_dangling_label_refuses(saved):
    import hashlib

    f = saved / "records" / "ops.json"
    table = json.loads(f.read_text())
    table["rows"][2][7] = ["no_such_op"]
    data = json.dumps(table).encode()
    f.write_bytes(data)
    _edit_manifest(saved, lambda m: m["files"]["records/ops.json"].update(sha256=hashlib.sha256(data).hexdigest(),
                                                                         size=len(data)))
    assert _code(tl.load, saved) == "record_reference_invalid"


def test_disclosures_must_match_the_records(saved):
    _edit_manifest(saved, lambda m: m["disclosures"].update(unencodable_values=3))
    assert _code(tl.load, saved) == "manifest_disclosure_mismatch"


def test_unlisted_files_refuse(saved):
    (saved / "blobs" / "extra.safetensors").write_bytes(b"x")
    assert _code(tl.load, saved) == "artifact_file_unlisted"


def test_other_path_refusals(tmp_path, trace):
    assert _code(tl.load, tmp_path / "nope") == "artifact_not_found"
    assert _code(trace.save, tmp_path / "x", level="portable") == "artifact_save_level_unsupported"


def test_validate_tlspec_returns_the_manifest_without_building(saved):
    m = tl.validation.validate_tlspec(saved)
    assert m["format_version"] == 3 and m["counts"]["ops"] == 9
