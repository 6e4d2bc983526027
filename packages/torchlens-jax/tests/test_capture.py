"""Capture of plain functions, flax.nnx and equinox modules: records, refusals, values."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("equinox")

import jax.numpy as jnp  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.backends import REFUSAL_CODES, VALIDATION_REASONS  # noqa: E402
from torchlens.errors import BackendUnsupportedError  # noqa: E402
from torchlens_jax import zoo as Z  # noqa: E402

X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)


def test_plain_function_steps_into_relu_and_softmax():
    def f(x):
        return jax.nn.softmax(jax.nn.relu(x) * 2.0)

    t = tl.trace(f, X)
    names = [o.func_name for o in t.ops if o.kind == "op"]
    assert "max" in names and "exp" in names and "reduce_max" in names
    assert t.ops[[o.label for o in t.ops if o.func_name == "max"][0]].meta["composite"] == "relu"
    assert t.provenance.backend == "jax" and t.provenance.root_entry_point == "function"
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(f(X)))
    assert t._backend.validate(t).ok


def test_nnx_mlp_records_modules_params_and_calls():
    m = Z.MLP()
    t = tl.trace(m, X)
    assert list(t._modules) == ["self", "fc1", "fc2"]
    assert set(t._params) == {"fc1.kernel", "fc1.bias", "fc2.kernel", "fc2.bias"}
    dots = [o for o in t.ops if o.func_name == "dot_general"]
    assert [o.module for o in dots] == ["fc1", "fc2"] and dots[0].params == ("fc1.kernel",)
    assert t._params["fc1.kernel"].consumer_labels == [dots[0].label]
    call = t._module_calls["fc1:1"]
    assert call.input_labels == ["input_1"] and len(call.output_labels) == 1
    assert t._module_calls["self:1"].output_labels == [t.output_ops[0].parents[0]]


def test_loop_reusing_one_layer_groups_into_passes():
    t = tl.trace(Z.LoopNet(steps=3), X)
    layer = t.layers["dotgeneral_1_1"]
    assert layer.num_passes == 3
    assert [o.module_calls[-1] for o in layer.ops] == ["fc:1", "fc:2", "fc:3"]
    assert [c.label for c in t.module_calls if c.address == "fc"] == ["fc:1", "fc:2", "fc:3"]


def test_constant_is_a_source_with_children():
    t = tl.trace(Z.constant_fn, X)
    consts = [o for o in t.ops if o.kind == "constant"]
    assert len(consts) == 2 and all(c.children and not c.parents and c.saved for c in consts)


def test_random_draw_replays_from_the_explicit_key():
    m = Z.RandomNet()
    key = jax.random.PRNGKey(7)
    t = tl.trace(m, X, input_kwargs={"key": key})
    assert [o.path for o in t.input_ops] == ["args[0]", "kwargs['key']"]
    assert any("threefry" in o.func_name or o.func_name == "random_bits" for o in t.ops)
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(m(X, key)))
    assert t._backend.validate(t).ok


def test_typed_keys_and_host_copy():
    proto = tl.backends.get_protocol("jax")
    assert proto.host_copy(jnp.float32(3.0)).shape == ()
    k = jax.random.key(0)
    assert proto.host_copy(k).shape == (2,)
    t = tl.trace(lambda x, key: x + jax.random.uniform(key, x.shape), X, jax.random.key(3))
    assert t._backend.validate(t).ok
    for op in t.ops:
        for v, s in zip(op.outs, op.shapes):
            assert proto.host_copy(v).shape == tuple(s)


def test_control_flow_is_unrolled_with_regions():
    t = tl.trace(Z.control_flow_fn, X, Z._W)
    regions = [o.meta["region"]["kind"] for o in t.ops if "region" in o.meta]
    assert "cond" in regions and "scan" in regions
    assert t.layers["tanh_1_7"].num_passes == 3
    np.testing.assert_allclose(np.asarray(t.output_ops[0].out), np.asarray(Z.control_flow_fn(X, Z._W)), rtol=1e-6)
    assert t._backend.validate(t).ok


def test_scan_with_xs_and_while_loop():
    def f(x):
        def body(c, row):
            c = c + jnp.tanh(row)
            return c, c * 2.0
        c, ys = jax.lax.scan(body, jnp.zeros(4), x)
        n = jax.lax.while_loop(lambda v: v.sum() < 10.0, lambda v: v + 1.0, c)
        return ys, n

    t = tl.trace(f, X)
    names = [o.func_name for o in t.ops]
    assert names.count("scan_slice") == 3 and names.count("scan_stack") == 1 and "lt" in names
    ys, n = f(X)
    np.testing.assert_allclose(np.asarray(t.output_ops[0].out), np.asarray(ys), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(t.output_ops[1].out), np.asarray(n), rtol=1e-6)
    assert t._backend.validate(t).ok


def test_unroll_cap_refuses_typed(monkeypatch):
    from torchlens_jax import interpret

    monkeypatch.setattr(interpret, "MAX_UNROLL", 2)
    with pytest.raises(BackendUnsupportedError) as exc:
        tl.trace(lambda x: jax.lax.fori_loop(0, 5, lambda i, v: v * 2.0, x), X)
    assert exc.value.code == "value_dependent_branch_unsupported" and exc.value.code in REFUSAL_CODES


def test_refusals():
    m = Z.MLP()
    with pytest.raises(BackendUnsupportedError) as exc:
        tl.trace(m, X, capture=tl.CaptureOptions(seed=0))
    assert exc.value.code == "explicit_seed_unsupported"
    with pytest.raises(BackendUnsupportedError) as exc:
        tl.trace(m, X, backend="jax", grad_options=tl.backends.jax.GradOptions())
    assert exc.value.code == "intermediate_derived_grads_unsupported"
    torch = pytest.importorskip("torch")
    with pytest.raises(BackendUnsupportedError) as exc:
        tl.trace(m, torch.ones(3, 4), backend="jax")
    assert exc.value.code == "foreign_tensor_input"


def test_validation_names_the_corrupted_op():
    t = tl.trace(Z.MLP(), X)
    victim = t.ops["add_1_3"]
    victim._outputs = (victim.out + 1.0,)
    status = t._backend.validate(t)
    assert not status.ok and status.first_failure == "add_1_3" and status.reason == "replay_mismatch"
    assert status.reason in VALIDATION_REASONS


def test_repeat_capture_reuses_the_jaxpr_and_matches():
    m = Z.AttentionBlock()
    x = jnp.ones((2, 5, 16), jnp.float32)
    a, b = tl.trace(m, x), tl.trace(m, x)
    assert a.labels == b.labels
    for oa, ob in zip(a.ops, b.ops):
        np.testing.assert_array_equal(np.asarray(oa.outs[0]), np.asarray(ob.outs[0]))


def test_selectors_summary_and_save_plan():
    t = tl.trace(Z.AttentionBlock(), jnp.ones((2, 5, 16), jnp.float32), save=tl.module("up"))
    sel = t[tl.func("dot_general")]
    assert len(sel.labels) >= 6
    assert {o.module for o in t.ops if o.saved and o.kind == "op"} == {"up"}
    assert "AttentionBlock" in t.summary()


def test_save_and_load_roundtrip(tmp_path):
    if not hasattr(tl.Trace, "save"):
        pytest.skip("core has no persistence")
    t = tl.trace(Z.RandomNet(), X, input_kwargs={"key": jax.random.key(1)})
    path = tmp_path / "t.tlspec"
    t.save(path)
    loaded = tl.load(path)
    assert loaded.labels == t.labels
    for a, b in zip(t.ops, loaded.ops):
        for va, vb in zip(a.outs, b.outs):
            assert isinstance(vb, jax.Array)
            assert str(va.dtype) == str(vb.dtype)
            np.testing.assert_array_equal(t._backend.host_copy(va), t._backend.host_copy(vb))
    # primitives are re-bound from their recorded names and parameters: the loaded trace
    # validates, random draws included (their keys are recorded inputs)
    assert loaded.validate_forward_pass()
    op = next(o for o in loaded.ops if o.kind == "op")
    op._outputs = tuple(v + 1 for v in op.outs)
    assert not loaded.validate_forward_pass()
    assert loaded.validation_replay_status.first_failure == op.label


def test_namespace_and_plugin_are_light():
    import subprocess
    import sys

    code = ("import sys, torchlens as tl; spec = tl.backends.get_spec('jax'); import torchlens_jax.plugin; "
            "print('jax' in sys.modules, spec.maturity, spec.framework.pinned)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False" and out[1] == "preview"
    assert tl.backends.jax.JAXBackend is type(tl.backends.get_protocol("jax"))
    assert tl.backends.jax.GradOptions().wrt == "inputs"
