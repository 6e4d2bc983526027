"""Spec fidelity (issue 13, edit helpers), on the reference backend: each test checks one
statement of spec/glossary.md l. 341-367, 774-775 or spec/interventions.md l. 91-98, 154,
221 against an independent numpy computation or a reproduced refusal."""

import hashlib
import json
import warnings

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import ArtifactError, InterventionError


@pytest.fixture
def mlp():
    from torchlens_reference import nn

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    return model, x


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _projector(basis):
    """Independent: the orthogonal projector onto the row span (pseudo-inverse form)."""
    b = np.asarray(basis, dtype=np.float64)
    return b.T @ np.linalg.inv(b @ b.T) @ b


BASIS = np.array([[1.0, 1.0, 0, 0, 0, 0, 0, 0], [0, 2.0, 0, 0, 1.0, 0, 0, 0]])  # not orthonormal, full rank


def _code(fn):
    with pytest.raises(InterventionError) as ei:
        fn()
    assert ei.value.remedy
    return ei.value.code


# subspace_ablate(basis, *, mode=, dim=, mean=, seed=) (glossary l. 341-345) -----------------------
def test_subspace_ablate_zero_and_mean_modes_match_the_projector(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    h = t["linear_1_1"].out.astype(np.float64)
    p = _projector(BASIS)
    zero = t.fork().do("linear_1_1", tl.intervention.subspace_ablate(BASIS, mode="zero"))["linear_1_1"].out
    assert np.allclose(zero, h - h @ p, atol=1e-5)
    mu = np.linspace(0.5, 1.5, 8)
    mean = t.fork().do("linear_1_1", tl.intervention.subspace_ablate(BASIS, mode="mean", mean=mu))["linear_1_1"].out
    assert np.allclose(mean, h - h @ p + mu @ p, atol=1e-5)


def test_subspace_ablate_resample_writes_a_permuted_rows_component(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    h = t["linear_1_1"].out.astype(np.float64)
    p = _projector(BASIS)
    out = t.fork().do("linear_1_1", tl.intervention.subspace_ablate(BASIS, mode="resample", seed=3))["linear_1_1"].out
    perm = np.random.default_rng(3).permutation(3)  # the documented batch permutation of seed=3
    assert np.allclose(out, h - h @ p + h[perm] @ p, atol=1e-5)
    assert np.allclose(out - out @ p, h - h @ p, atol=1e-5)  # the orthogonal complement is untouched


def test_subspace_ablate_dim_picks_the_axis(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    h = t["linear_1_1"].out.astype(np.float64)
    b = np.array([[1.0, 0.0, 1.0]])  # acts on the batch axis (length 3)
    out = t.fork().do("linear_1_1", tl.intervention.subspace_ablate(b, dim=0))["linear_1_1"].out
    assert np.allclose(out, (h.T - h.T @ _projector(b)).T, atol=1e-5)


@pytest.mark.parametrize("make,code", [
    (lambda: tl.intervention.subspace_ablate(np.array([[1.0, 0], [2.0, 0]])), "subspace_basis_invalid"),
    (lambda: tl.intervention.subspace_ablate(np.array([[np.nan, 1.0]])), "subspace_basis_invalid"),
    (lambda: tl.intervention.subspace_ablate(np.eye(2), mode="bogus"), "subspace_mode_invalid"),
    (lambda: tl.intervention.subspace_ablate(np.eye(2), mode="mean"), "subspace_mode_invalid"),
    (lambda: tl.intervention.subspace_ablate(np.eye(2), mode="resample"), "subspace_mode_invalid"),
    (lambda: tl.intervention.subspace_ablate(np.eye(2), mode="zero", seed=1), "subspace_mode_invalid"),
    (lambda: tl.intervention.subspace_ablate(np.eye(2), mode="resample", seed=1, mean=np.ones(2)), "subspace_mode_invalid"),
    (lambda: tl.intervention.subspace_ablate(np.eye(2), mode="mean", mean=np.ones(3)), "subspace_mode_invalid"),
])
def test_subspace_ablate_refusals(make, code):
    assert _code(make) == code


def test_subspace_ablate_wrong_width_refuses_before_anything_changes(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    before = t["linear_1_1"].out.copy()
    assert _code(lambda: t.do("linear_1_1", tl.intervention.subspace_ablate(np.ones((1, 5))))) == \
        "subspace_basis_dim_mismatch"
    assert np.array_equal(t["linear_1_1"].out, before) and t.is_pristine


# subspace_interchange(basis, source, *, dim=-1) (glossary l. 352) -------------------------------
def test_subspace_interchange_takes_the_basis_first(mlp):
    model, x = mlp
    base, donor = tl.trace(model, x), tl.trace(model, x * 3)
    h, s = base["linear_1_1"].out.astype(np.float64), donor["linear_1_1"].out.astype(np.float64)
    p = _projector(BASIS)
    out = base.fork().do("linear_1_1", tl.intervention.subspace_interchange(BASIS, donor, dim=-1))["linear_1_1"].out
    assert np.allclose(out, h - h @ p + s @ p, atol=1e-5)


# set_affine_coordinates refusals (glossary l. 347-350) ------------------------------------------
@pytest.mark.parametrize("weight,bias", [
    (np.ones((1, 8), np.complex64), None), (np.ones((1, 8), bool), None), (np.ones(8), None),
    (np.ones((1, 1, 8)), None), (np.full((1, 8), np.nan), None), ("W", None), (None, None),
    (np.ones((1, 8)), np.ones(1, bool)), (np.ones((1, 8)), np.array([np.inf])), (np.ones((1, 8)), "b"),
])
def test_set_affine_coordinates_refuses_anything_but_finite_real_tensors(weight, bias):
    assert _code(lambda: tl.intervention.set_affine_coordinates(weight, bias=bias)) == "affine_source_invalid"


def test_set_affine_coordinates_accepts_an_integer_weight_and_computes_loreft(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    h = t["linear_1_1"].out.astype(np.float64)
    q = np.eye(8)[:1]
    w = np.zeros((1, 8), np.int64)
    w[0, 3] = 2  # a finite real (integer) weight is a real tensor
    out = t.fork().do(tl.subspace("linear_1_1", q, origin="e0"),
                      tl.intervention.set_affine_coordinates(w, bias=np.array([1.0])))["linear_1_1"].out
    c_new = h @ w.T + 1.0
    assert np.allclose(out, h + (c_new - h @ q.T) @ q, atol=1e-5)


def test_set_affine_coordinates_under_units_refuses_at_staging(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    edit = tl.intervention.set_affine_coordinates(np.ones((1, 8)))
    for site in ("linear_1_1", tl.units("linear_1_1", np.ones((3, 8), bool))):
        assert _code(lambda: t.do(site, edit, intervention=tl.InterventionOptions(engine="set_only"))) == \
            "affine_source_needs_subspace"
    assert t.is_pristine and len(t.recipe) == 0


# keep_grad (glossary l. 356-363) ------------------------------------------------------------------
def test_keep_grad_refuses_backward_edits_and_rules():
    from torchlens.intervention.edits import Edit

    backward = Edit("grad_scale", (("factor", 0.0),), lambda v, ctx: v * 0.0, signal="backward")
    for bad in (backward, tl.when(tl.grad("relu_1_2"), tl.scale(0.0)).rules[0], tl.grad("relu_1_2"), tl.label("a"), 3):
        assert _code(lambda: tl.intervention.keep_grad(bad)) == "keep_grad_edit_invalid", bad


# tl.positions (glossary l. 365-367) -----------------------------------------------------------------
@pytest.fixture
def tokens():
    x = np.arange(24, dtype=np.float64).reshape(2, 4, 3) + 1.0  # (batch, tokens, features)
    return x


def _apply(edit, value):
    from torchlens.intervention.edits import HookContext, fire
    from torchlens.intervention.numpy_ops import NumpyEditOps

    edit.check_site(value.shape)
    return fire(edit, value, HookContext("s", None, None, NumpyEditOps()))


def test_positions_last_real_token_from_the_mask(tokens):
    mask = np.array([[1, 1, 0, 0], [0, 1, 1, 1]])  # right- and left-padded rows
    out = _apply(tl.positions(tl.zero_ablate(), "last", mask=mask), tokens)
    expect = tokens.copy()
    expect[0, 1] = 0.0
    expect[1, 3] = 0.0
    assert np.array_equal(out, expect)
    out = _apply(tl.positions(tl.zero_ablate(), "first", mask=mask.astype(bool)), tokens)
    expect = tokens.copy()
    expect[0, 0] = 0.0
    expect[1, 1] = 0.0
    assert np.array_equal(out, expect)


def test_positions_other_forms(tokens):
    out = _apply(tl.positions(tl.zero_ablate(), "last", assume_no_padding=True), tokens)
    assert np.array_equal(out[:, 3], np.zeros((2, 3))) and np.array_equal(out[:, :3], tokens[:, :3])
    out = _apply(tl.positions(tl.zero_ablate(), slice(1, 3)), tokens)
    assert np.array_equal(out[:, 1:3], np.zeros((2, 2, 3))) and np.array_equal(out[:, [0, 3]], tokens[:, [0, 3]])
    out = _apply(tl.positions(tl.zero_ablate(), np.array([2, 0])), tokens)
    expect = tokens.copy()
    expect[0, 2] = 0.0
    expect[1, 0] = 0.0
    assert np.array_equal(out, expect)


def test_positions_refusals(tokens):
    assert _code(lambda: tl.positions(tl.zero_ablate(), "last")) == "transform_mask_missing"
    assert _code(lambda: tl.positions(tl.zero_ablate(), "first")) == "transform_mask_missing"
    assert _code(lambda: _apply(tl.positions(tl.zero_ablate(), "last", mask=np.ones((2, 5))), tokens)) == \
        "transform_mask_incompatible"
    assert _code(lambda: _apply(tl.positions(tl.zero_ablate(), "last", mask=np.zeros((2, 4))), tokens)) == \
        "transform_mask_incompatible"
    assert _code(lambda: _apply(tl.positions(tl.zero_ablate(), np.array([4, 0])), tokens)) == "position_edit_out_of_range"
    assert _code(lambda: _apply(tl.positions(tl.zero_ablate(), [5]), tokens)) == "position_edit_out_of_range"
    assert _code(lambda: tl.positions(tl.zero_ablate(), "middle")) == "position_edit_invalid"


# mean_ablate dims and codes (interventions.md l. 154) ------------------------------------------------
def test_mean_ablate_dims(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    h = t["linear_1_1"].out
    for dim, expect in ((None, np.full_like(h, h.mean())), (0, np.broadcast_to(h.mean(0, keepdims=True), h.shape)),
                        ((0, 1), np.full_like(h, h.mean()))):
        out = t.fork().do("linear_1_1", tl.mean_ablate(dim=dim))["linear_1_1"].out
        assert np.allclose(out, expect, atol=1e-6), dim
    src = np.arange(8, dtype=np.float32)
    out = t.fork().do("linear_1_1", tl.mean_ablate(src, dim=None))["linear_1_1"].out
    assert np.allclose(out, np.full_like(h, src.mean()))
    with pytest.raises(TypeError):
        tl.mean_ablate()  # dim is required
    assert _code(lambda: tl.mean_ablate(dim="batch")) == "axis_semantics_unknown"
    assert _code(lambda: tl.mean_ablate(dim="members")) == "intervention_over_invalid"
    assert _code(lambda: tl.mean_ablate(dim=1.5)) == "intervention_over_invalid"


# coordinate verbs, unsupported verbs (interventions.md l. 91-98) -----------------------------------
def test_mean_ablate_without_source_is_a_coordinate_verb(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    h = t["linear_1_1"].out.astype(np.float64)
    q = np.eye(8)[:2]
    out = t.fork().do(tl.subspace("linear_1_1", q, origin="e01"), tl.mean_ablate(dim=None))["linear_1_1"].out
    c = h @ q.T
    assert np.allclose(out, h + (np.full_like(c, c.mean()) - c) @ q, atol=1e-5)  # the mean of the coordinates


def test_splice_module_out_is_a_coordinate_verb(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    h = t["linear_1_1"].out.astype(np.float64)
    q = np.eye(8)[:2]
    seen = []

    def double(c):
        seen.append(c.shape)
        return 2.0 * c

    out = t.fork().do(tl.subspace("linear_1_1", q, origin="e01"),
                      tl.intervention.splice_module(double, input_route="out"))["linear_1_1"].out
    assert seen == [(3, 2)]  # the module receives the k coordinates
    assert np.allclose(out, h + (h @ q.T) @ q, atol=1e-5)


@pytest.mark.parametrize("verb,hint", [
    (lambda: tl.project_out(np.ones(8)), "without tl.subspace"),
    (lambda: tl.intervention.subspace_ablate(np.eye(8)[:1]), "subspace_ablate"),
    (lambda: tl.positions(tl.zero_ablate(), [0]), "within="),
])
def test_other_verbs_refuse_naming_the_spelling_that_works(mlp, verb, hint):
    model, x = mlp
    t = tl.trace(model, x)
    with pytest.raises(InterventionError) as ei:
        t.do(tl.subspace("linear_1_1", np.eye(8)[:2], origin="e01"), verb())
    assert ei.value.code == "subspace_edit_unsupported" and hint in ei.value.remedy
    assert t.is_pristine


# subspace_projection_composed, resolve() (interventions.md l. 98) ----------------------------------
def test_subspace_composition_refuses(mlp):
    sub = tl.subspace("linear_1_1", np.eye(8)[:2], origin="e01")
    for make in (lambda: sub | tl.label("relu_1_2"), lambda: tl.label("relu_1_2") | sub, lambda: sub & tl.label("x"),
                 lambda: tl.label("x") - sub, lambda: ~sub, lambda: tl.subspace(sub, np.eye(8)[:1])):
        assert _code(make) == "subspace_projection_composed"
    model, x = mlp
    t = tl.trace(model, x)
    resolved = sub.resolve(t)
    assert _code(lambda: tl.subspace(resolved, np.eye(8)[:1])) == "subspace_projection_composed"
    assert _code(lambda: tl.subspace(tl.label("linear_1_1").resolve(t), np.eye(8)[:1])) == "subspace_projection_composed"


def test_subspace_resolve_answers_the_support_set(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    basis = np.zeros((2, 8))
    basis[0, 1], basis[1, 5], basis[1, 6] = 1.0, 0.6, 0.8
    resolved = tl.subspace("linear_1_1", basis, origin="sparse").resolve(t)
    assert [r.label for r in resolved] == ["linear_1_1"]
    expect = np.zeros((3, 8), bool)
    expect[:, [1, 5, 6]] = True
    assert np.array_equal(resolved[0].mask, expect)
    rows = np.zeros((3, 8), bool)
    rows[2] = True
    within = tl.subspace(tl.units("linear_1_1", rows), basis, origin="sparse").resolve(t)
    assert np.array_equal(within[0].mask, expect & rows)
    h = t["linear_1_1"].out
    out = t.fork().do(tl.units("linear_1_1", resolved[0].mask), tl.zero_ablate())["linear_1_1"].out
    assert np.array_equal(out, np.where(expect, 0, h))


# what a saved subspace edit stores (interventions.md l. 154, 221) ------------------------------------
def _saved(mlp, tmp_path, with_mask=True):
    model, x = mlp
    t = tl.trace(model, x)
    mask = np.zeros((3, 8), bool)
    mask[1] = True
    basis = np.array([[2.0, 0, 0, 0, 0, 0, 0, 0]], np.float32)
    site = tl.units("linear_1_1", mask) if with_mask else "linear_1_1"
    fork = t.fork().do(tl.subspace(site, basis, origin="learned", method="das"), tl.zero_ablate())
    path = tl.io.save_intervention(fork, tmp_path / "s.tlspec", level="portable")
    doc = json.loads((path / "intervention.json").read_bytes())
    return t, fork, path, dict((k, v) for k, v in doc["rules"][0]["edit"]["kwargs"]), basis, mask


def test_saved_subspace_edit_stores_verb_rows_axis_digests_and_provenance(mlp, tmp_path):
    from torchlens.intervention.subspace import array_sha256

    t, fork, path, kw, basis, mask = _saved(mlp, tmp_path)
    assert kw["verb"] == "zero_ablate" and kw["axis"] == -1
    assert kw["origin"] == "learned" and kw["method"] == "das" and kw["orthonormalised"] is True
    assert kw["basis_dtype"] == "float32" and kw["basis_sha256"] == array_sha256(basis)
    assert kw["mask_sha256"] == array_sha256(mask)
    rows = np.eye(8)[:1]  # Gram-Schmidt of [2, 0, ...]
    assert kw["rows_sha256"] == hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest()
    spec = tl.io.load_intervention_spec(path)
    again = t.fork().do(spec)
    assert np.array_equal(again["linear_1_1"].out, fork["linear_1_1"].out)
    assert f"basis_sha256='{array_sha256(basis)}'" in again.intervention_audit[-1]["edit_identity"]


def _rewrite(path, mutate):
    doc = json.loads((path / "intervention.json").read_bytes())
    mutate(doc["rules"][0]["edit"]["kwargs"])
    body = json.dumps(doc).encode()
    (path / "intervention.json").write_bytes(body)
    m = json.loads((path / "manifest.json").read_bytes())
    m["files"]["intervention.json"] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
    (path / "manifest.json").write_text(json.dumps(m))


def _set(kwargs, key, value):
    for pair in kwargs:
        if pair[0] == key:
            pair[1] = value


def test_a_mask_changed_after_saving_refuses_mask_tampered(mlp, tmp_path):
    t, fork, path, kw, basis, mask = _saved(mlp, tmp_path)
    _rewrite(path, lambda kws: _set(kws, "mask_sha256", "0" * 64))  # the digest no longer matches the mask
    with pytest.raises(ArtifactError) as ei:
        tl.io.load_intervention_spec(path)
    assert ei.value.code == "subspace_spec_mask_tampered"
    _, _, path2, *_ = _saved(mlp, tmp_path / "b")
    _rewrite(path2, lambda kws: kws.__setitem__(slice(None), [p for p in kws if p[0] != "mask_sha256"]))
    with pytest.raises(ArtifactError) as ei:
        tl.io.load_intervention_spec(path2)
    assert ei.value.code == "subspace_spec_mask_tampered"


# compose (glossary l. 356; interventions.md l. 94) ---------------------------------------------------
def test_compose_applies_in_order_and_has_no_subspace_form(mlp, tmp_path):
    model, x = mlp
    t = tl.trace(model, x)
    v = np.linspace(0, 1, 8, dtype=np.float32)
    fixed = tl.intervention.compose(tl.scale(0.0), tl.add(v))
    out = t.fork().do("linear_1_1", fixed)["linear_1_1"].out
    assert np.allclose(out, np.broadcast_to(v, (3, 8)))
    out = t.fork().do("linear_1_1", tl.intervention.keep_grad(fixed))["linear_1_1"].out
    assert np.allclose(out, np.broadcast_to(v, (3, 8)))
    with pytest.raises(InterventionError) as ei:
        t.do(tl.subspace("linear_1_1", np.eye(8)[:2], origin="e01"), fixed)
    assert ei.value.code == "subspace_edit_unsupported" and "one at a time" in ei.value.remedy
    with pytest.raises(tl.errors.OpaqueCallableError):
        tl.io.save_intervention(tl.when("linear_1_1", fixed), tmp_path / "c.tlspec", level="portable")
    assert tl.Edit is tl.intervention.Edit and tl.splice_module is tl.intervention.splice_module
