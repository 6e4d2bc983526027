"""Issue 28 item 3 (plain functions): `param_args=` names the arguments that hold a plain
function's parameters (never guessed from names or shapes); their array leaves become
parameters named by pytree path, the rest stay inputs."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.errors import InvalidArgumentError  # noqa: E402

PARAMS = {"dense": {"kernel": jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 12, "bias": jnp.ones(3)},
          "head": {"kernel": jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(3, 2)}}
X = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).reshape(2, 4)


def mlp(params, x):
    h = jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
    return h @ params["head"]["kernel"]


def test_param_args_name_parameters_by_pytree_path(tmp_path):
    t = tl.trace(mlp, PARAMS, X, backend="jax", param_args=(0,))
    assert sorted(p.address for p in t.params) == ["dense.bias", "dense.kernel", "head.kernel"]
    np.testing.assert_array_equal(np.asarray(t.params["dense.kernel"].value), np.asarray(PARAMS["dense"]["kernel"]))
    assert [o.kind for o in t.ops if o.kind == "input"] == ["input"]  # only x is an input
    dots = [o for o in t.ops if o.func_name == "dot_general"]
    assert [o.params for o in dots] == [("dense.kernel",), ("head.kernel",)]
    np.testing.assert_array_equal(np.asarray(dots[0].out), np.asarray(X @ PARAMS["dense"]["kernel"]))
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(mlp(PARAMS, X)))
    without = tl.trace(mlp, PARAMS, X, backend="jax")  # not named: the dict's leaves are inputs
    assert not list(without.params) and len([o for o in without.ops if o.kind == "input"]) == 4
    t.save(tmp_path / "p.tlspec")
    assert tl.load(tmp_path / "p.tlspec").validate_forward_pass()


def test_param_args_by_keyword():
    t = tl.trace(lambda x, params: mlp(params, x), X, backend="jax", input_kwargs={"params": PARAMS},
                 param_args=("params",))
    assert sorted(p.address for p in t.params) == ["dense.bias", "dense.kernel", "head.kernel"]
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(mlp(PARAMS, X)))


@pytest.mark.parametrize("bad", [(5,), ("nope",), (), (0, 0)])
def test_param_args_refuses_what_names_no_argument(bad):
    with pytest.raises(InvalidArgumentError) as err:
        tl.trace(mlp, PARAMS, X, backend="jax", param_args=bad)
    assert err.value.code == "invalid_argument" and err.value.fields.get("option") == "param_args"


def test_param_args_reach_the_backend_on_the_live_intervention_path():
    # tl.trace(..., intervene=...) runs two captures through core's live path; the backend's own
    # trace options (param_args=) must reach both, never be dropped.
    t = tl.trace(mlp, PARAMS, X, backend="jax", param_args=(0,),
                 intervene=tl.when(tl.func("tanh"), tl.zero_ablate()))
    assert sorted(p.address for p in t.params) == ["dense.bias", "dense.kernel", "head.kernel"]
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.zeros((2, 2), np.float32))
