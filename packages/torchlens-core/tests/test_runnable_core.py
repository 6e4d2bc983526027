"""The runnable artifact's framework-free parts: the save refusal for a non-replayable capture,
and the manifest's `runnable` object as load checks it (the reference backend cannot capture
replayable, so these artifacts are level "full" ones edited by hand)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import ArtifactError
from torchlens.io import runnable
from torchlens_reference import nn


@pytest.fixture
def saved(tmp_path):
    return tl.trace(nn.LoopNet(), np.ones((2, 4), np.float32)).save(tmp_path / "t.tlspec")


def _edit(path, fn):
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def _code(path):
    with pytest.raises(ArtifactError) as exc:
        tl.load(path)
    return exc.value.code


def test_a_non_replayable_trace_refuses_before_writing(tmp_path):
    t = tl.trace(nn.LoopNet(), np.ones((2, 4), np.float32))
    with pytest.raises(ArtifactError) as exc:
        t.save(tmp_path / "r.tlspec", level="runnable")
    assert exc.value.code == "runnable_capture_not_replayable" and "replayable=True" in exc.value.remedy
    assert not (tmp_path / "r.tlspec").exists()
    assert tl.load(t.save(tmp_path / "f.tlspec")).runnable is None


def test_the_runnable_object_belongs_to_the_runnable_level_only(saved):
    empty = hashlib.sha256(b"").hexdigest()
    obj = {"schema": runnable.SCHEMA, "files": {n: {"sha256": empty, "size": 0} for n in runnable.FILES}}
    _edit(saved, lambda m: m.__setitem__("runnable", obj))
    assert _code(saved) == "manifest_malformed"  # a full save has no runnable object
    _edit(saved, lambda m: m.__setitem__("level", "runnable"))
    assert _code(saved) == "artifact_file_missing"  # listed, but runnable/ is not there
    (saved / "runnable").mkdir()
    for name in runnable.FILES:
        (saved / name).write_bytes(b"")
    assert _code(saved) == "runnable_descriptor_invalid"  # empty: not a descriptor
    _edit(saved, lambda m: m.pop("runnable"))
    assert _code(saved) == "runnable_descriptor_invalid"  # the runnable level needs its object


def test_runnable_files_are_digest_pinned(saved):
    (saved / "runnable").mkdir()
    data = b'{"schema":"tl.runnable/1"}'
    (saved / runnable.DESCRIPTOR).write_bytes(data)
    (saved / runnable.STATE).write_bytes(b"x")
    files = {runnable.DESCRIPTOR: {"sha256": hashlib.sha256(b"other bytes" + b"x" * 15).hexdigest(), "size": len(data)},
             runnable.STATE: {"sha256": hashlib.sha256(b"x").hexdigest(), "size": 1}}
    _edit(saved, lambda m: m.update(level="runnable", runnable={"schema": runnable.SCHEMA, "files": files}))
    assert _code(saved) == "artifact_digest_mismatch"
    files[runnable.DESCRIPTOR]["sha256"] = hashlib.sha256(data).hexdigest()
    _edit(saved, lambda m: m.update(runnable={"schema": runnable.SCHEMA, "files": files}))
    assert _code(saved) == "blob_malformed"  # one byte is no safetensors file
    (saved / "runnable" / "more.bin").write_bytes(b"")
    assert _code(saved) == "artifact_file_unlisted"


@pytest.mark.parametrize("bad", [None, {}, {"schema": "tl.runnable/0", "files": {}},
                                 {"schema": runnable.SCHEMA, "files": {runnable.DESCRIPTOR: {"sha256": "0" * 64, "size": 1}}},
                                 {"schema": runnable.SCHEMA, "files": {n: {"sha256": "x", "size": 1} for n in runnable.FILES}},
                                 {"schema": runnable.SCHEMA,
                                  "files": {n: {"sha256": "0" * 64, "size": -1} for n in runnable.FILES}}])
def test_malformed_runnable_objects_refuse(bad):
    with pytest.raises(ArtifactError) as exc:
        runnable.check_manifest_object(bad)
    assert exc.value.code == "runnable_descriptor_invalid"


def test_read_values_round_trip_through_json():
    for v in (True, False, 3, -2.5, [1, [2.0, True]], float("inf")):
        assert runnable._unplain(json.loads(json.dumps(runnable._plain(v)))) == v
    nan = runnable._unplain(json.loads(json.dumps(runnable._plain(float("nan")))))
    assert nan != nan
    assert runnable._plain(1 + 2j) is None  # not recordable: the read is unverifiable, never guessed
