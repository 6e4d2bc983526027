"""Hostile files with JAX payloads: typed refusals for bogus JAX literals and payload metadata
(validate_tlspec refusing exactly what tl.load refuses, no allocation from a literal's
declared shape or dtype), and the seeded fuzz suite over JAX traces, specs and safetensors
exports (TORCHLENS_FUZZ_BIG=1 runs ten times more cases)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tracemalloc

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("torchlens_jax")

import jax.numpy as jnp  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.errors import TorchLensError  # noqa: E402
from torchlens_conformance.hostile import Template, fuzz  # noqa: E402

BIG = os.environ.get("TORCHLENS_FUZZ_BIG") == "1"
X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)


def f(x, key):
    noise = jax.random.normal(key, x.shape)  # a typed PRNG key payload (prng_impl metadata)
    return jax.nn.relu(x.astype(jnp.bfloat16)).astype(jnp.float32) * 2.0 + noise


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("jax_hostile")
    t = tl.trace(f, X, jax.random.key(0))
    return t, t.save(root / "t.tlspec")


def _reseal(root):
    m = json.loads((root / "manifest.json").read_text())
    for name in m["files"]:
        data = (root / name).read_bytes()
        m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (root / "manifest.json").write_text(json.dumps(m))


def _edit(src, dst, kind, edit):
    shutil.copytree(src, dst)
    p = dst / "records" / f"{kind}.json"
    table = json.loads(p.read_text())
    edit(table)
    p.write_text(json.dumps(table, separators=(",", ":")))
    _reseal(dst)
    return dst


def _codes_and_peak(path):
    out = []
    tracemalloc.start()
    try:
        for fn in (tl.load, tl.validation.validate_tlspec):
            with pytest.raises(TorchLensError) as info:
                fn(path)
            out.append(info.value.code)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return out, peak


def _literal_cells(x):
    if isinstance(x, dict):
        if set(x) == {"$literal"}:
            yield x
        for v in x.values():
            yield from _literal_cells(v)
    elif isinstance(x, list):
        for v in x:
            yield from _literal_cells(v)


def _tuple(*xs):
    return {"$tuple": list(xs)}


@pytest.mark.parametrize("kind,plain", [
    ("numpy.dtype", "V100000000"), ("numpy.dtype", "(1000000000,)f8"), ("numpy.dtype", "O"),
    ("jax.TypedNdArray", _tuple("(1000000000,)f8", False, _tuple(1), [0])),  # was: 8 GB per element
    ("jax.TypedNdArray", _tuple("float32", False, _tuple(100000, 100000), [0])),
    ("jax.TypedNdArray", _tuple("V100000000", False, _tuple(1), [0])),
    ("jax.TypedInt", _tuple("int32", 10**30)), ("jax.TypedFloat", _tuple("S9", 1.0)),
    ("jax.lax.Precision", "__class__"), ("jax.PRNGImpl", "bogus"),
    ("jax.lax.ConvDimensionNumbers", _tuple(_tuple("a"), _tuple(), _tuple()))])
def test_bogus_jax_literals_refuse_typed_without_allocating(saved, tmp_path, kind, plain):
    _, path = saved

    def edit(table):
        cell = next(_literal_cells(table["rows"]))
        cell["$literal"] = [kind, plain]

    codes, peak = _codes_and_peak(_edit(path, tmp_path / "b.tlspec", "ops", edit))
    assert codes == ["record_schema_invalid", "record_schema_invalid"]
    assert peak < 32 * 2**20


@pytest.mark.parametrize("meta", [{"prng_impl": "bogus", "key_shape": ""}, {"prng_impl": "threefry2x32"},
                                  {"prng_impl": "threefry2x32", "key_shape": "7"}, {"pickle": "1"}])
def test_jax_payload_metadata_is_checked_in_load_and_validate(saved, tmp_path, meta):
    _, path = saved

    def edit(table):
        cols = table["columns"]
        row = next(r for r in table["rows"] if "prng_impl" in r[cols.index("meta")])
        m = row[cols.index("meta")]
        if "pickle" not in meta:
            m.pop("prng_impl"), m.pop("key_shape")
        m.update(meta)

    codes, _ = _codes_and_peak(_edit(path, tmp_path / "m.tlspec", "payloads", edit))
    assert codes == ["payload_meta_invalid", "payload_meta_invalid"]


def _templates(tmp_path, trace, path):
    out = [Template("trace:jax", path, "tlspec"),
           Template("export:jax", tl.export.safetensors(trace, tmp_path / "e.safetensors"), "safetensors")]
    return out  # the JAX preview backend has no interventions, so no JAX intervention spec exists to mutate


def test_hostile_files_fuzz_jax(saved, tmp_path):
    trace, path = saved
    report = fuzz(_templates(tmp_path, trace, path), cases=1200 if BIG else 120, seed=91, workdir=tmp_path / "cases",
                  alloc_a=64.0, alloc_b=8 * 2**20)
    print("\nhostile files (jax):", report.summary())
    assert report.failures == [], "\n".join(report.failures[:20])
    assert report.outcomes["raw"] == 0 and report.outcomes["refused"] > report.cases // 2
    assert np.isfinite(report.max_ratio)
