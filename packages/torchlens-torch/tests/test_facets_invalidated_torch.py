"""Facets an edit marked stale on a trace (`trace.annotations["mi_invalidated_facets"]`, set by the
mechinterp kit's patch_head on its patched rerun) refuse on the raw trace with facet_invalidated;
the module's other facets and other modules' facets read as before."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl

pytest.importorskip("transformers")
from facet_models import gpt2, ids  # noqa: E402

ATTN = "transformer.h.0.attn"


def _refuses(read, code="facet_invalidated"):
    with pytest.raises(tl.errors.TorchLensError) as exc:
        read()
    assert exc.value.code == code and exc.value.remedy
    return exc.value


def test_marked_facets_refuse_typed_and_the_rest_read():
    model = gpt2("eager")
    log = tl.trace(model, ids(), save="all")
    z_before = log.modules[ATTN].facets["z"].value.clone()
    log.annotations["mi_invalidated_facets"] = {ATTN: ("z", "result")}
    f = log.modules[ATTN].facets
    exc = _refuses(lambda: f["z"])
    assert isinstance(exc, KeyError) and exc.fields == {"facet": "z", "module": ATTN}
    _refuses(lambda: f.result)
    _refuses(lambda: f.head(1)["z"])
    assert "z" not in f and "result" not in f.keys() and f.get("z") is None
    assert "invalidated" in f.reasons()["z"]
    assert torch.equal(f["q"].value, log.modules[ATTN].facets["q"].value) and "pattern" in f
    assert "z" in log.modules["transformer.h.1.attn"].facets  # another module's z is not marked
    tl.facets.enable_transformer_lens_aliases()
    try:
        _refuses(lambda: log.modules[ATTN].facets["hook_z"])
        assert "hook_q" in log.modules[ATTN].facets
    finally:
        tl.facets.enable_transformer_lens_aliases(False)
    del log.annotations["mi_invalidated_facets"]
    assert torch.equal(log.modules[ATTN].facets["z"].value, z_before)  # nothing was mutated


@pytest.mark.parametrize("marks", [["z"], {ATTN: 3}, {ATTN: ("z", 1)}])
def test_a_malformed_annotation_refuses_typed(marks):
    log = tl.trace(gpt2("eager"), ids(), save="all")
    log.annotations["mi_invalidated_facets"] = marks
    with pytest.raises(tl.errors.TorchLensError) as exc:
        log.modules[ATTN].facets["z"]  # noqa: B018
    assert exc.value.code == "facet_annotation_invalid" and exc.value.remedy
    del log.annotations["mi_invalidated_facets"]
    assert log.modules[ATTN].facets["z"].value.shape[-1] > 0  # the well-formed trace reads again


def test_the_kits_patched_rerun_refuses_its_invalidated_facets_on_the_raw_trace():
    mi = pytest.importorskip("torchlens_mechinterp")
    model = gpt2("sdpa")
    patched = mi.patch_head(model, ids(), module=ATTN, head=1, source=ids().flip(-1))
    stale = set(patched.receipt["invalidated_facets"])
    assert stale == {"z", "result"}
    raw = patched.trace.modules[ATTN].facets
    for name in stale:
        _refuses(lambda n=name: raw[n])
    assert raw["q"].shape == (2, 7, 4, 8)
    assert "z" in patched.trace.modules["transformer.h.1.attn"].facets
