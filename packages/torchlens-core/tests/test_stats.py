"""tl.stats accumulators against NumPy on the full concatenated data (issue 23 acceptance):
10,000 rows streamed in batches of 64 equal NumPy's answer on all rows at once; save/load
mid-stream then continuing equals the uninterrupted run bit for bit; hostile files refuse."""

from __future__ import annotations

import json

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import ArtifactError, InvalidArgumentError
from torchlens.stats import (CKA, PCA, Covariance, CrossCovariance, Histogram, Mean, Norm, Quantile, RunningStats, TopK,
                             UnitTopK, load_fitted, save_fitted)

N, D, B = 10_000, 6, 64


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    mix = rng.normal(size=(D, D))
    x = rng.normal(size=(N, D)) @ mix + 1e3  # a large offset: naive sum-of-squares would lose digits
    y = np.tanh(x[:, :4] @ rng.normal(size=(4, 5)) * 1e-3) + 0.1 * rng.normal(size=(N, 5))
    return x, y


def batches(a, b=B):
    return [a[i:i + b] for i in range(0, len(a), b)]


def fold(stat, *arrays):
    for parts in zip(*(batches(a) for a in arrays)):
        stat.update(*parts)
    return stat


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def test_mean_and_covariance_equal_numpy_on_full_data(data):
    x, _ = data
    assert rel(fold(Mean(), x).mean, x.mean(axis=0)) < 1e-10
    cov = fold(Covariance(), x)
    assert cov.count == N
    assert rel(cov.covariance(), np.cov(x, rowvar=False)) < 1e-10
    assert rel(cov.covariance(ddof=0), np.cov(x, rowvar=False, ddof=0)) < 1e-10


def test_cross_covariance_equals_numpy(data):
    x, y = data
    want = np.cov(np.hstack([x, y]), rowvar=False)[:D, D:]
    assert rel(fold(CrossCovariance(), x, y).covariance(), want) < 1e-10


def test_pca_equals_svd_up_to_sign(data):
    x, _ = data
    pca = fold(PCA(n_components=3), x)
    c = x - x.mean(axis=0)
    _, s, vt = np.linalg.svd(c, full_matrices=False)
    var = s ** 2 / (N - 1)
    assert rel(pca.explained_variance, var[:3]) < 1e-10
    assert rel(pca.explained_variance_ratio, var[:3] / var.sum()) < 1e-10
    for got, want in zip(pca.components, vt[:3]):
        assert min(np.abs(got - want).max(), np.abs(got + want).max()) < 1e-8
    proj = pca.transform(x[:10])
    assert rel(np.abs(proj), np.abs(c[:10] @ vt[:3].T)) < 1e-8


def _cka_numpy(x, y):
    xc, yc = x - x.mean(0), y - y.mean(0)
    return np.linalg.norm(yc.T @ xc) ** 2 / (np.linalg.norm(xc.T @ xc) * np.linalg.norm(yc.T @ yc))


def test_cka_is_exact_full_data_linear_cka(data):
    x, y = data
    got = fold(CKA(), x, y).result()
    assert abs(got - _cka_numpy(x, y)) / _cka_numpy(x, y) < 1e-10
    # a minibatch average of CKA is a different number: the accumulator must not be that
    per_batch = np.mean([_cka_numpy(a, b) for a, b in zip(batches(x), batches(y))])
    assert abs(per_batch - got) > 1e-3


def test_quantile_exact_and_per_unit(data):
    x, _ = data
    q = [0.01, 0.25, 0.5, 0.9]
    assert np.array_equal(fold(Quantile(q), x).result(), np.quantile(x, q))
    per_unit = fold(Quantile(q, unit_axis=-1), x).result()
    assert np.array_equal(per_unit, np.quantile(x, q, axis=0).T)
    assert fold(Quantile(0.5), x).result() == np.median(x)


def test_topk_global_with_ids_and_positions(data):
    x, _ = data
    r = fold(TopK(k=7), x).result()
    flat = x.ravel()
    want = np.sort(flat)[::-1][:7]
    assert np.array_equal(r.values, want)
    assert np.array_equal(x[r.example_ids, r.positions], r.values)
    r2 = fold(TopK(k=5, largest=False), x).result()
    assert np.array_equal(r2.values, np.sort(flat)[:5])


def test_unit_topk_per_unit_and_ties():
    rng = np.random.default_rng(1)
    acts = rng.integers(0, 4, size=(300, 5, 3)).astype(np.float64)  # [examples, positions, units], many ties
    t = TopK(k=4, unit_axis=-1)
    for i in range(0, 300, 64):
        t.update(acts[i:i + 64])
    r = t.result()
    assert isinstance(r, UnitTopK) and r.values.shape == (3, 4)
    for u in range(3):
        cells = sorted(((-acts[e, p, u], e, p) for e in range(300) for p in range(5)))[:4]
        assert r.values[u].tolist() == [-c[0] for c in cells]
        assert r.example_ids[u].tolist() == [c[1] for c in cells]
        assert r.positions[u].tolist() == [c[2] for c in cells]


def test_histogram_norm_runningstats(data):
    x, _ = data
    h = fold(Histogram(bins=20, range=(990, 1010)), x).result()
    inside = x[(x >= 990) & (x <= 1010)]
    assert np.array_equal(h["counts"], np.histogram(inside, bins=20, range=(990, 1010))[0])
    assert h["underflow"] == int((x < 990).sum()) and h["overflow"] == int((x > 1010).sum())
    n = fold(Norm(), x).result()
    norms = np.linalg.norm(x, axis=1)
    assert abs(n["mean"] - norms.mean()) / norms.mean() < 1e-10 and abs(n["var"] - norms.var(ddof=1)) / norms.var() < 1e-8
    z = x.copy()
    z[3, 2], z[9, 0], z[11, 1] = np.nan, np.inf, 0.0
    rs = fold(RunningStats(), z).result()
    fin = z[np.isfinite(z)]
    c = fin - fin.mean()
    assert rs["count"] == fin.size and rs["numel"] == z.size and rs["nan_count"] == 1 and rs["posinf_count"] == 1
    assert rs["zero_count"] == 1
    assert abs(rs["mean"] - fin.mean()) / abs(fin.mean()) < 1e-12
    for slot, power in (("m2", 2), ("m3", 3), ("m4", 4)):
        want = (c ** power).sum()
        assert abs(rs[slot] - want) / abs(want) < 1e-8, slot
    assert rs["min"] == fin.min() and rs["max"] == fin.max()


@pytest.mark.parametrize("make", [Mean, Covariance, lambda: PCA(2), CKA, lambda: Quantile([0.1, 0.7]),
                                  lambda: TopK(3, unit_axis=-1), lambda: Histogram(8, (995, 1005)), Norm, RunningStats,
                                  CrossCovariance, lambda: Quantile([0.2, 0.9], mode="reservoir", size=500, seed=3),
                                  lambda: Quantile(0.5, mode="reservoir", unit_axis=-1, size=300)])
def test_save_load_mid_stream_continues_exactly(tmp_path, data, make):
    x, y = data
    two = isinstance(make(), (CKA, CrossCovariance))
    parts = list(zip(batches(x), batches(y))) if two else [(b,) for b in batches(x)]
    whole = make()
    for p in parts:
        whole.update(*p)
    first = make()
    for p in parts[:70]:
        first.update(*p)
    path = save_fitted(first, tmp_path / "state.safetensors")
    again = load_fitted(path)
    assert type(again) is type(first) and again.config() == first.config()
    for p in parts[70:]:
        again.update(*p)
    got, want = again.state_dict(), whole.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert np.array_equal(got[k], want[k]), k


@pytest.mark.parametrize("make", [Mean, Covariance, CKA, lambda: TopK(4), Norm, RunningStats, lambda: Quantile(0.3)])
def test_merge_of_split_streams_equals_numpy(data, make):
    x, y = data
    two = isinstance(make(), CKA)
    a, b = make(), make()
    for i, part in enumerate(batches(x)):
        args = (part, y[i * B:(i + 1) * B]) if two else (part,)
        kw = {"example_ids": range(i * B, i * B + len(part))} if isinstance(a, TopK) else {}
        (a if i % 2 else b).update(*args, **kw)
    whole = make()
    whole.update(*((x, y) if two else (x,)))
    merged = b.merge(a)
    for k, v in whole.state_dict().items():
        if k in ("values", "ids", "positions") and isinstance(merged, Quantile):
            continue
        assert rel(merged.state_dict()[k], v) < 1e-10, k
    if isinstance(merged, Quantile):
        assert merged.result() == whole.result()


def test_merge_refuses_other_kind_or_config():
    with pytest.raises(InvalidArgumentError) as e:
        Mean().merge(Covariance())
    assert e.value.code == "stats_merge_mismatch"
    with pytest.raises(InvalidArgumentError) as e:
        TopK(3).merge(TopK(4))
    assert e.value.code == "stats_merge_mismatch"


def test_bad_inputs_refuse_typed_before_mutation():
    m = Mean().update(np.ones((4, 3)))
    with pytest.raises(InvalidArgumentError) as e:
        m.update(np.ones((4, 2)))
    assert e.value.code == "stats_shape_mismatch"
    assert m.count == 4
    with pytest.raises(InvalidArgumentError) as e:
        Mean().update(np.array(["a", "b"]))
    assert e.value.code == "stats_input_invalid"
    with pytest.raises(InvalidArgumentError) as e:
        Histogram(bins=5)
    assert e.value.code == "stats_histogram_range_required"
    c = CKA().update(np.ones((3, 2)), np.ones((3, 2)))
    with pytest.raises(InvalidArgumentError):
        c.update(np.ones((3, 2)), np.ones((4, 2)))
    assert c.count == 3
    with pytest.raises(InvalidArgumentError) as e:
        Quantile(0.5, mode="tdigest")
    assert e.value.code == "stats_option_unsupported"
    for bad in ({"size": 0}, {"seed": -1}, {"size": 2.5}):
        with pytest.raises(InvalidArgumentError) as e:
            Quantile(0.5, mode="reservoir", **bad)
        assert e.value.code == "invalid_argument"
    r = Quantile(0.5, mode="reservoir", size=10).update(np.ones((4, 2)))
    for bad_ids in ([0, 1], [0.5, 1, 2, 3]):
        with pytest.raises(InvalidArgumentError) as e:
            r.update(np.ones((4, 2)), example_ids=bad_ids)
        assert e.value.code == "stats_input_invalid"
    assert r.count == 8


def _rewrite(path, tensors, meta):
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata=meta)


def test_hostile_state_files_refuse_typed(tmp_path):
    from safetensors import safe_open

    good = save_fitted(Covariance().update(np.arange(12.0).reshape(4, 3)), tmp_path / "c.safetensors")
    with safe_open(str(good), framework="numpy") as f:
        meta, arrays = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    cases = {
        "garbage": (None, None),
        "foreign_tag": (arrays, {**meta, "format": "something_else"}),
        "unknown_kind": (arrays, {**meta, "kind": "os.system"}),
        "extra_array": ({**arrays, "evil": np.zeros(2)}, meta),
        "bad_shape": ({**arrays, "m2": np.zeros((2, 2))}, meta),
        "bad_dtype": ({**arrays, "mean": arrays["mean"].astype(np.float32)}, meta),
        "bad_config": (arrays, {**meta, "config": json.dumps({"nope": 1})}),
        "bad_json": (arrays, {**meta, "config": "{"}),
    }
    want = {"foreign_tag": "stats_state_foreign", "unknown_kind": "stats_state_foreign"}
    for name, (tensors, m) in cases.items():
        p = tmp_path / f"{name}.safetensors"
        if tensors is None:
            p.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage" + b"\x00" * 20)
        else:
            _rewrite(p, tensors, m)
        with pytest.raises(ArtifactError) as e:
            load_fitted(p)
        assert e.value.code == want.get(name, "stats_state_invalid"), name
    truncated = tmp_path / "trunc.safetensors"
    truncated.write_bytes(good.read_bytes()[:-8])
    with pytest.raises(ArtifactError) as e:
        load_fitted(truncated)
    assert e.value.code == "stats_state_invalid"


def test_encoder_is_applied_and_not_stored(tmp_path):
    x = np.arange(40.0).reshape(10, 4)
    t = TopK(2, encoder=lambda a: -np.asarray(a))
    t.update(x)
    assert t.result().values.tolist() == [0.0, -1.0]
    back = load_fitted(save_fitted(t, tmp_path / "t.safetensors"), encoder=lambda a: np.asarray(a) * 0)
    back.update(x)
    assert back.result().values.tolist() == [0.0, 0.0]


def test_namespace_and_distances():
    assert tl.stats.Mean is Mean and isinstance(Mean(), tl.stats.StreamingStat)
    a, b = np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 4.0])
    assert abs(float(tl.stats.relative_l2(a, b)) - 1 / np.sqrt(14)) < 1e-15
    assert abs(float(tl.stats.cosine_distance(a, a))) < 1e-15
    with pytest.raises(InvalidArgumentError):
        tl.stats.relative_l1(a, b[:2])


QS = [0.05, 0.25, 0.5, 0.75, 0.95]


def _rank_errors(values, estimates, qs):
    """|F_n(estimate) - q| on the full data (F_n its empirical distribution function)."""
    v = np.sort(values)
    return np.array([abs(np.searchsorted(v, e, side="right") / len(v) - q) for e, q in zip(estimates, qs)])


def test_reservoir_quantile_within_its_rank_error_bound(data):
    x, _ = data
    col = x[:, 2]
    r = fold(Quantile(QS, mode="reservoir", size=1000, seed=11), col)
    assert r.count == N and r.state_dict()["values"].shape == (1, 1000)
    bound = r.rank_error(1e-6)
    assert 0 < bound < 0.1
    errs = _rank_errors(col, r.result(), QS)
    assert np.all(errs <= bound + 1.0 / N), (errs, bound)
    exact = np.quantile(col, QS)
    assert not np.allclose(r.result(), exact, rtol=0, atol=1e-12)  # a sample, not the data: the bound is what holds
    # per unit: one reservoir per feature column, each within the bound on its own column
    u = fold(Quantile(QS, mode="reservoir", unit_axis=-1, size=1000, seed=5), x)
    got = u.result()
    assert got.shape == (D, len(QS))
    for j in range(D):
        assert np.all(_rank_errors(x[:, j], got[j], QS) <= u.rank_error(1e-6) + 1.0 / N), j


def test_reservoir_holding_everything_is_exact_and_splits_merge_exactly(data):
    x, _ = data
    small = fold(Quantile(QS, mode="reservoir", size=N, seed=1), x[:, 0])
    assert np.array_equal(small.result(), np.quantile(x[:, 0], QS)) and small.rank_error() == 0.0
    whole = fold(Quantile(QS, mode="reservoir", unit_axis=-1, size=700, seed=2), x)
    a, b = Quantile(QS, mode="reservoir", unit_axis=-1, size=700, seed=2), Quantile(QS, mode="reservoir", unit_axis=-1,
                                                                                    size=700, seed=2)
    for i, part in enumerate(batches(x)):
        (a if i % 3 else b).update(part, example_ids=range(i * B, i * B + len(part)))
    merged = b.merge(a)
    assert merged.count == whole.count == N
    assert np.array_equal(np.sort(merged.state_dict()["keys"], axis=1), np.sort(whole.state_dict()["keys"], axis=1))
    assert np.array_equal(merged.result(), whole.result())  # the same sample: the same estimate, bit for bit
    other_seed = fold(Quantile(QS, mode="reservoir", unit_axis=-1, size=700, seed=3), x)
    assert not np.array_equal(other_seed.result(), whole.result())
