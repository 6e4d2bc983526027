"""Issue 28, JAX as JAX researchers use it: one test per numbered item (refusals inside JAX
transforms, equinox containers, validation after load, shard_map, nnx transforms)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
eqx = pytest.importorskip("equinox")

import jax.numpy as jnp  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.errors import ArtifactError, InvalidArgumentError  # noqa: E402

X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)


# item 8: tl.trace inside jax.jit / jax.grad ---------------------------------------------------

def _f(x):
    return jnp.tanh(x) * 2.0


@pytest.mark.parametrize("transform", ["jit", "grad", "vmap"])
def test_trace_inside_a_jax_transform_refuses_typed(transform):
    calls = []

    def inner(x):
        try:
            tl.trace(_f, x)
        except InvalidArgumentError as exc:
            calls.append(exc)
            raise
        return x.sum()

    wrapped = {"jit": jax.jit(inner), "grad": jax.grad(inner), "vmap": jax.vmap(inner)}[transform]
    with pytest.raises(InvalidArgumentError) as info:
        wrapped(X)
    assert info.value.code == "trace_inside_jax_transform" and info.value.remedy
    assert info.value.fields["name"] == "args[0]"
    # outside the transform the same call traces concrete values
    t = tl.trace(_f, X)
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(_f(X)))


def test_trace_of_a_closure_over_a_jit_tracer_refuses_typed():
    @jax.jit
    def outer(y):
        tl.trace(lambda x: x * y, X)  # y is the outer transform's tracer, captured by closure
        return y

    with pytest.raises(InvalidArgumentError) as info:
        outer(X)
    assert info.value.code == "trace_inside_jax_transform" and info.value.fields["where"] == "closure constant"


# item 1: equinox containers ------------------------------------------------------------------

def test_equinox_mlp_layers_tuple_is_a_module_record_and_round_trips(tmp_path):
    m = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.PRNGKey(0))
    x = X[0]
    t = tl.trace(m, x)
    assert [(a, t._modules[a].class_name, t._modules[a].parent) for a in t._modules] == [
        ("self", "MLP", None), ("layers.0", "Linear", "layers"), ("layers.1", "Linear", "layers"),
        ("layers.2", "Linear", "layers")]
    assert "layers" in t.uncalled_modules  # the tuple is never called, like torch's ModuleList
    # each Linear's matmul, read by an independent forward through the layer objects
    h = x
    for i, layer in enumerate(m.layers):
        h = layer(h)
        out_ops = t._module_calls[f"layers.{i}:1"].output_labels
        np.testing.assert_array_equal(np.asarray(t[out_ops[-1]].out), np.asarray(h))
        if i < len(m.layers) - 1:
            h = m.activation(h)
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(m(x)))
    t.save(tmp_path / "m.tlspec")
    loaded = tl.load(tmp_path / "m.tlspec")
    assert list(loaded._modules) == list(t._modules) and loaded._modules["layers.1"].class_name == "Linear"
    assert loaded.validate_forward_pass()
    for i in range(3):
        assert t.find_sites(tl.module(f"layers.{i}")).labels == loaded.find_sites(tl.module(f"layers.{i}")).labels
        assert t.find_sites(tl.module(f"layers.{i}")).labels


def test_save_refuses_what_load_would_refuse_and_writes_nothing(tmp_path):
    t = tl.trace(eqx.nn.MLP(4, 2, 8, 1, key=jax.random.PRNGKey(0)), X[0])
    t._modules["layers.0"].parent = "nowhere"  # a record graph load refuses
    target = tmp_path / "bad.tlspec"
    with pytest.raises(ArtifactError) as info:
        t.save(target)
    assert info.value.code == "save_records_invalid" and info.value.fields["load_code"] == "record_reference_invalid"
    assert not target.exists() and not [p for p in tmp_path.iterdir()]


# item 4: validation after load ---------------------------------------------------------------

_IDX = jnp.array([2, 0, 1, 1])


def _gather(x):
    return jnp.take(x, _IDX % 3, axis=0) * 2.0


def _scatter(x):
    return x.at[0, 1].set(5.0) + 1.0


def _scatter_add(x):
    return x.at[_IDX % 3].add(1.0) * 1.5


def _fft(x):
    return jnp.abs(jnp.fft.rfft(x))


def _scan(x):
    def body(c, xi):
        return c + xi, c * xi

    return jax.lax.scan(body, jnp.zeros(4), x)


def _sharding_constraint(x):
    return jax.lax.with_sharding_constraint(x * 2.0, jax.sharding.SingleDeviceSharding(jax.devices()[0])) + 1.0


def _linear_solve(x):
    a = jnp.eye(4) * 2.0 + 0.1
    return jax.lax.custom_linear_solve(lambda v: a @ v, x[0], solve=lambda mv, b: b / 2.0, symmetric=True)


_LOADED_CASES = {"gather": (_gather, "gather"), "scatter": (_scatter, "scatter"),
                 "scatter-add": (_scatter_add, "scatter-add"), "fft": (_fft, "fft"), "scan": (_scan, "scan_slice"),
                 "sharding_constraint": (_sharding_constraint, "sharding_constraint"),
                 "custom_linear_solve": (_linear_solve, "div")}


@pytest.mark.parametrize("case", list(_LOADED_CASES))
def test_loaded_trace_validates_for_indexing_fft_scan_sharding_and_solves(case, tmp_path):
    fn, func_name = _LOADED_CASES[case]
    t = tl.trace(fn, X)
    for got, want in zip([o.out for o in t.output_ops], jax.tree_util.tree_leaves(fn(X))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    t.save(tmp_path / "t.tlspec")
    loaded = tl.load(tmp_path / "t.tlspec")
    ops = [o for o in loaded.ops if o.func_name == func_name]
    assert ops, [o.func_name for o in loaded.ops]
    assert loaded.validate_forward_pass(), loaded.validation_replay_status
    # the replay really re-ran the op: a changed saved output is caught at that op
    target = ops[0]
    target._outputs = tuple(jnp.asarray(v) + 1 if jnp.issubdtype(jnp.asarray(v).dtype, jnp.inexact) else v
                            for v in target._outputs)
    assert not loaded.validate_forward_pass()
    assert loaded.validation_replay_status.first_failure in (target.label, *target.children)


def test_scan_steps_share_one_compiled_slice():
    from torchlens_jax.interpret import _slice_at

    xs = jnp.arange(40.0, dtype=jnp.float32).reshape(10, 4)
    before = _slice_at._cache_size()
    t = tl.trace(lambda x: jax.lax.scan(lambda c, xi: (c + xi, c), jnp.zeros(4), x), xs)
    slices = [o for o in t.ops if o.func_name == "scan_slice"]
    assert len(slices) == 10
    for i, o in enumerate(slices):
        np.testing.assert_array_equal(np.asarray(o.out), np.asarray(xs[i]))
    assert _slice_at._cache_size() - before <= 1


# item 5: jax.shard_map -----------------------------------------------------------------------

def test_shard_map_on_one_device_records_its_body_and_round_trips(tmp_path):
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("d",))

    def f(x):
        g = jax.shard_map(lambda a: jnp.tanh(a) * 2.0 + a.sum(), mesh=mesh, in_specs=P(), out_specs=P())
        return g(x) + 1.0

    t = tl.trace(f, X)
    assert [o.func_name for o in t.ops if o.kind == "op"] == ["tanh", "mul", "reduce_sum", "add", "add"]
    tanh = next(o for o in t.ops if o.func_name == "tanh")
    assert tanh.meta["composite"] == "shard_map"
    np.testing.assert_array_equal(np.asarray(tanh.out), np.asarray(jnp.tanh(X)))
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(f(X)))
    t.save(tmp_path / "s.tlspec")
    assert tl.load(tmp_path / "s.tlspec").validate_forward_pass()


def test_shard_map_with_a_collective_is_one_op_that_validates_live():
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("d",))

    def f(x):
        return jax.shard_map(lambda a: jax.lax.psum(jnp.tanh(a), "d"), mesh=mesh, in_specs=P(), out_specs=P())(x) + 1.0

    t = tl.trace(f, X)
    assert [o.func_name for o in t.ops if o.kind == "op"] == ["shard_map", "add"]
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(f(X)))
    assert t.validate_forward_pass()


# item 2: flax.nnx transforms and jit wrappers ------------------------------------------------

def _nnx():
    from flax import nnx

    return nnx


def test_nnx_remat_and_vmap_keep_module_identity_by_graph_path():
    nnx = _nnx()

    class Two(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 4, rngs=rngs)
            self.b = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            h = nnx.remat(lambda m, v: m(v))(self.a, x)
            return nnx.vmap(lambda m, v: m(v), in_axes=(None, 0))(self.b, h)

    m = Two(nnx.Rngs(0))
    t = tl.trace(m, X)
    dots = [o for o in t.ops if o.func_name == "dot_general"]
    assert [(o.module, o.params) for o in dots] == [("a", ("a.kernel",)), ("b", ("b.kernel",))]
    assert dots[0].layer_label != dots[1].layer_label  # two modules, two layers (not one layer of two passes)
    assert list(t._module_calls) == ["self:1", "a:1", "b:1"]
    h = m.a(X)
    np.testing.assert_array_equal(np.asarray(t[t._module_calls["a:1"].output_labels[-1]].out), np.asarray(h))
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(m(X)))
    assert t.find_sites(tl.module("b")).labels


def test_nnx_scan_body_module_is_attributed_to_its_path():
    nnx = _nnx()

    class S(nnx.Module):
        def __init__(self, rngs):
            self.cell = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, xs):
            def step(cell, c, x):
                c = jnp.tanh(cell(x) + c)
                return c, c

            return nnx.scan(step, in_axes=(None, nnx.Carry, 0), out_axes=(nnx.Carry, 0))(self.cell, jnp.zeros(4), xs)[1]

    m = S(nnx.Rngs(0))
    t = tl.trace(m, X)
    dots = [o for o in t.ops if o.func_name == "dot_general"]
    assert len(dots) == 3 and {o.module for o in dots} == {"cell"} and {o.params for o in dots} == {("cell.kernel",)}
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(m(X)))


def test_nnx_jit_and_eqx_filter_jit_wrappers_trace_what_they_wrap():
    nnx = _nnx()
    lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    t = tl.trace(nnx.jit(lin), X)
    assert set(t._params) == {"kernel", "bias"}
    assert [o.params for o in t.ops if o.func_name == "dot_general"] == [("kernel",)]
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(lin(X)))
    em = eqx.nn.Linear(4, 4, key=jax.random.PRNGKey(0))
    t = tl.trace(eqx.filter_jit(em), X[0])
    assert set(t._params) == {"weight", "bias"}
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(em(X[0])))
    t = tl.trace(nnx.jit(lambda m, x: m(x) * 2.0), lin, X)  # a jitted function of a module: traced as the function
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(lin(X) * 2.0))


# item 9: composites of custom_vjp and checkpoint ---------------------------------------------

def test_ops_inside_custom_vjp_and_checkpoint_carry_their_composite():
    @jax.custom_vjp
    def doubled_sin(x):
        return jnp.sin(x) * 2.0

    doubled_sin.defvjp(lambda x: (doubled_sin(x), x), lambda r, g: (g * jnp.cos(r) * 2.0,))

    def f(x):
        return jax.checkpoint(lambda y: jnp.tanh(y) + 1.0)(doubled_sin(x))

    t = tl.trace(f, X)
    by_name = {o.func_name: o for o in t.ops if o.kind == "op"}
    assert by_name["sin"].meta["composite"] == "doubled_sin" and by_name["mul"].meta["composite"] == "doubled_sin"
    assert by_name["tanh"].meta["composite"] == "checkpoint" and by_name["add"].meta["composite"] == "checkpoint"
    np.testing.assert_array_equal(np.asarray(by_name["sin"].out), np.asarray(jnp.sin(X)))
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(f(X)))


def test_one_transformed_function_reused_on_two_modules_never_misattributes():
    nnx = _nnx()

    class Shared(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 4, rngs=rngs)
            self.b = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            f = nnx.remat(lambda m, v: m(v))  # JAX traces f once; the second call reuses that jaxpr
            return f(self.b, f(self.a, x))

    m = Shared(nnx.Rngs(0))
    t = tl.trace(m, X)
    dots = [o for o in t.ops if o.func_name == "dot_general"]
    assert dots[0].module == "a" and dots[1].params == ("b.kernel",)
    assert dots[1].module != "a"  # never the first module's scope: attributed to the caller
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(m(X)))
