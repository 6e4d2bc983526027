"""Issue 28 item 3, haiku: a `hk.transform`ed function's params dict names its parameters by
haiku's own module paths when passed with `param_args=` (never guessed), every op equals
haiku's own forward, and the trace validates after save/load."""

from __future__ import annotations

import numpy as np
import pytest

hk = pytest.importorskip("haiku")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import torchlens as tl  # noqa: E402


def _mlp(x):
    return hk.nets.MLP([8, 3])(x)


def test_haiku_mlp_params_are_named_by_haiku_path_and_validate_after_load(tmp_path):
    f = hk.without_apply_rng(hk.transform(_mlp))
    x = jnp.linspace(-1, 1, 8, dtype=jnp.float32).reshape(2, 4)
    params = f.init(jax.random.PRNGKey(0), x)
    t = tl.trace(f.apply, params, x, backend="jax", param_args=(0,))
    assert sorted(p.address for p in t.params) == ["mlp/~/linear_0.b", "mlp/~/linear_0.w",
                                                   "mlp/~/linear_1.b", "mlp/~/linear_1.w"]
    np.testing.assert_array_equal(np.asarray(t.params["mlp/~/linear_1.w"].value),
                                  np.asarray(params["mlp/~/linear_1"]["w"]))
    dots = [o for o in t.ops if o.func_name == "dot_general"]
    assert [o.params for o in dots] == [("mlp/~/linear_0.w",), ("mlp/~/linear_1.w",)]
    # independent evaluation: the same layers written with jnp from haiku's params
    p0, p1 = params["mlp/~/linear_0"], params["mlp/~/linear_1"]
    np.testing.assert_allclose(np.asarray(dots[0].out), np.asarray(x @ p0["w"]), rtol=1e-6, atol=1e-6)
    hidden = jax.nn.relu(x @ p0["w"] + p0["b"])
    np.testing.assert_allclose(np.asarray(t.output_ops[0].out), np.asarray(hidden @ p1["w"] + p1["b"]),
                               rtol=1e-6, atol=1e-6)
    t.save(tmp_path / "haiku.tlspec")
    assert tl.load(tmp_path / "haiku.tlspec").validate_forward_pass()
