"""Issue 28 items 3 (functional models: flax.linen with its variables) and 7 (nnx state
written in the forward: BatchNorm running stats, RNG counters, Module.training)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.errors import InvalidArgumentError  # noqa: E402

X = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).reshape(2, 4)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(3)(jax.nn.relu(x))


def _linen():
    m = LinenMLP()
    return m, m.init(jax.random.key(0), X)


# item 3: flax.linen apply with a params dict --------------------------------------------------

@pytest.mark.parametrize("form", ["apply", "module"])
def test_linen_params_are_named_by_their_pytree_path_and_modules_select(form, tmp_path):
    m, v = _linen()
    t = tl.trace(m.apply, v, X) if form == "apply" else tl.trace(m, X, input_kwargs={"variables": v})
    # parameters named from the params collection's path, values the arrays passed in
    params = {p.address: p for p in t.params}
    assert set(params) == {"Dense_0.kernel", "Dense_0.bias", "BatchNorm_0.scale", "BatchNorm_0.bias",
                           "Dense_1.kernel", "Dense_1.bias"}
    for address, p in params.items():
        mod, name = address.split(".")
        np.testing.assert_array_equal(np.asarray(p.value), np.asarray(v["params"][mod][name]))
    assert {b.address for b in t.buffers} == {"BatchNorm_0.mean", "BatchNorm_0.var"}
    assert [(a, t._modules[a].class_name) for a in t._modules] == [
        ("self", "LinenMLP"), ("Dense_0", "Dense"), ("BatchNorm_0", "BatchNorm"), ("Dense_1", "Dense")]
    # the matmul reading Dense_1.kernel runs in Dense_1's call
    dots = [o for o in t.ops if o.params and "kernel" in o.params[0]]
    assert [(o.module, o.params) for o in dots] == [("Dense_0", ("Dense_0.kernel",)), ("Dense_1", ("Dense_1.kernel",))]
    # tl.module selects each submodule's output: linen's own intermediates are the oracle
    _, inter = m.apply(v, X, capture_intermediates=True)
    for name in ("Dense_0", "BatchNorm_0", "Dense_1"):
        (label,) = t.find_sites(tl.module(name)).labels
        np.testing.assert_array_equal(np.asarray(t[label].out), np.asarray(inter["intermediates"][name]["__call__"][0]))
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(m.apply(v, X)))
    t.save(tmp_path / "l.tlspec")
    loaded = tl.load(tmp_path / "l.tlspec")
    assert loaded.validate_forward_pass()
    assert loaded.find_sites(tl.module("Dense_1")).labels == t.find_sites(tl.module("Dense_1")).labels


def test_linen_train_mode_batch_stats_are_outputs_and_training_is_recorded():
    m, v = _linen()
    t = tl.trace(m, X, input_kwargs={"variables": v, "train": True, "mutable": ["batch_stats"]})
    assert t._modules["BatchNorm_0"].training and not t._modules["Dense_0"].training and t._modules["self"].training
    _, upd = m.apply(v, X, train=True, mutable=["batch_stats"])
    outs = {o.path: o for o in t.output_ops}
    np.testing.assert_array_equal(np.asarray(outs["output[1]['batch_stats']['BatchNorm_0']['mean']"].out),
                                  np.asarray(upd["batch_stats"]["BatchNorm_0"]["mean"]))


def test_linen_without_variables_refuses_typed():
    m, _ = _linen()
    with pytest.raises(InvalidArgumentError) as info:
        tl.trace(m, X)
    assert info.value.code == "linen_variables_missing" and info.value.remedy
    with pytest.raises(InvalidArgumentError) as info:
        tl.trace(m.apply, [1, 2], X)
    assert info.value.code == "linen_variables_missing"


# item 7: nnx state written in the forward ----------------------------------------------------

class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.bn(self.fc(x))))


def _state_arrays(m):
    def host(v):
        return np.asarray(jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v)

    return {jax.tree_util.keystr(k): host(v) for k, v in jax.tree_util.tree_leaves_with_path(nnx.state(m))}


def test_nnx_state_writes_are_recorded_with_values_and_the_model_is_untouched(tmp_path):
    m = NnxNet(nnx.Rngs(0))
    m.train()
    before = _state_arrays(m)
    ref = nnx.clone(m)
    expected_out = ref(X)  # the independent forward: a clone, run by flax itself
    t = tl.trace(m, X)
    # capture is a pure observer: every leaf of the model's state unchanged
    after = _state_arrays(m)
    assert set(after) == set(before) and all(np.array_equal(after[k], before[k]) for k in before)
    # the writes, with the values flax's own forward left in the clone
    w_bn, w_drop = t._modules["bn"].attribute_writes, t._modules["drop"].attribute_writes
    assert set(w_bn) == {"mean", "var"} and set(w_drop) == {"rngs.count"}
    assert all(w.kind == "replaced" for w in [*w_bn.values(), *w_drop.values()])
    np.testing.assert_array_equal(w_bn["mean"].value, np.asarray(ref.bn.mean[...]))
    np.testing.assert_array_equal(w_bn["var"].value, np.asarray(ref.bn.var[...]))
    assert int(w_drop["rngs.count"].value) == int(ref.drop.rngs.count[...]) == 1
    assert t._modules["fc"].attribute_writes == {}
    # the op that computed each written value is marked, and its value is the written one
    marked = {o.meta["state_write"]: o for o in t.ops if o.meta.get("state_write")}
    assert set(marked) == {"bn.mean", "bn.var", "drop.rngs.count"}
    np.testing.assert_array_equal(np.asarray(marked["bn.mean"].out), w_bn["mean"].value)
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(expected_out))
    # Module.training as the model is set
    assert t._modules["bn"].training and t._modules["drop"].training and t._modules["self"].training
    m.eval()
    assert not tl.trace(m, X)._modules["bn"].training
    t.save(tmp_path / "s.tlspec")
    assert tl.load(tmp_path / "s.tlspec").validate_forward_pass()


def test_nnx_advancing_the_rng_state_from_the_recorded_write_gives_a_new_dropout_mask():
    m = NnxNet(nnx.Rngs(1))
    m.train()
    t1, t2 = tl.trace(m, X), tl.trace(m, X)  # an observer: the held counter never advances
    np.testing.assert_array_equal(np.asarray(t1.output_ops[0].out), np.asarray(t2.output_ops[0].out))
    ref = nnx.clone(m)
    ref(X)
    second = ref(X)  # flax's own second call
    # the docs' recipe: write the recorded state back, then trace again
    for address, rec in t1._modules.items():
        mod = m if address == "self" else getattr(m, address)
        for name, w in rec.attribute_writes.items():
            var = mod
            for part in name.split("."):
                var = getattr(var, part)
            var[...] = w.value
    t3 = tl.trace(m, X)
    np.testing.assert_array_equal(np.asarray(t3.output_ops[0].out), np.asarray(second))
    assert not np.array_equal(np.asarray(t3.output_ops[0].out), np.asarray(t1.output_ops[0].out))
