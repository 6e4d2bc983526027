"""Every recorded op equals an independent evaluation, and module paths follow the module
tree, for flax.nnx and equinox MLPs and attention blocks."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("equinox")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torchlens as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers next to this file
from jax_test_models import EqxAttentionBlock, seq_input  # noqa: E402
from jax_test_oracle import primitive_trail  # noqa: E402
from torchlens_jax import zoo as Z  # noqa: E402

_SYNTHETIC = {"scan_slice", "scan_stack"}


def _models():
    x = jax.numpy.linspace(-1.0, 1.0, 12, dtype=jax.numpy.float32).reshape(3, 4)
    return {
        "flax_mlp": (Z.MLP(), (x,)),
        "flax_attention": (Z.AttentionBlock(), (seq_input(),)),
        "eqx_mlp": (Z.EqxMLP(jax.random.PRNGKey(5)), (x[0],)),
        "eqx_attention": (EqxAttentionBlock(key=jax.random.PRNGKey(0)), (seq_input(None),)),
    }


MODELS = _models()


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request):
    model, args = MODELS[request.param]
    return request.param, model, args, tl.trace(model, *args, backend="jax")


def test_every_op_equals_an_independent_evaluation(case):
    name, model, args, t = case
    trail, out = primitive_trail(model, *args)
    ops = [o for o in t.ops if o.kind == "op" and o.func_name not in _SYNTHETIC]
    assert [o.func_name for o in ops] == [p for p, _ in trail], name
    for op, (_, outs) in zip(ops, trail):
        for got, want in zip(op.outs, outs):
            g, w = np.asarray(got), np.asarray(want)
            assert g.shape == w.shape and g.dtype == w.dtype, op.label
            assert np.array_equal(g, w, equal_nan=True), f"{name}: {op.label} differs from the independent evaluation"
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(out[0]))
    # A direct call runs jax.jit-compiled helpers (softmax, equinox internals) as fused XLA
    # computations, which may round differently in the last bit from op-by-op evaluation.
    np.testing.assert_allclose(np.asarray(t.output_ops[0].out), np.asarray(model(*args)), rtol=1e-5, atol=1e-6)


def test_module_paths_follow_the_module_tree(case):
    name, model, args, t = case
    for op in t.ops:
        if op.kind in ("input", "output"):
            assert op.modules == ()
            continue
        assert op.modules[0] == "self", op.label
        for parent, child in zip(op.modules, op.modules[1:]):
            assert t.modules[child].parent == parent, f"{name}: {op.label} path {op.modules}"
    called = {c.split(":")[0] for c in t.module_calls.labels} if hasattr(t.module_calls, "labels") else set(t._module_calls)
    assert {o.module for o in t.ops if o.module} <= {c.split(":")[0] for c in called}


def test_submodule_outputs_equal_calling_the_submodule_directly(case):
    """A module call's recorded output equals calling that submodule on its recorded input."""
    name, model, args, t = case
    checked = 0
    for call in t._module_calls.values():
        if call.address in ("self",) or len(call.input_labels) != 1 or len(call.output_labels) != 1:
            continue
        sub = t.modules[call.address]
        obj = _resolve(model, call.address)
        if obj is None or not callable(obj) or sub.class_name in ("MultiheadAttention", "MultiHeadAttention"):
            continue
        x = t.ops[call.input_labels[0]].out
        try:
            want = obj(x)
        except Exception:  # equinox submodules run unbatched under vmap; skip those
            continue
        got = t.ops[call.output_labels[0]].out
        if np.shape(want) == np.shape(got):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{name}: {call.label}")
            checked += 1
    assert checked >= 1 or name.startswith("eqx"), name


def _resolve(model, address):
    obj = model
    for part in address.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def test_expected_module_addresses():
    t = tl.trace(Z.AttentionBlock(), seq_input(), backend="jax")
    assert set(t._modules) >= {"self", "ln1", "attn", "attn.query", "attn.key", "attn.value", "attn.out", "ln2", "up", "down"}
    q = [o for o in t.ops if o.func_name == "dot_general" and o.module == "attn.query"]
    assert len(q) == 1 and q[0].modules == ("self", "attn", "attn.query")
    assert set(q[0].params) == {"attn.query.kernel"}
    e = tl.trace(EqxAttentionBlock(key=jax.random.PRNGKey(0)), seq_input(None), backend="jax")
    assert {"attn.query_proj", "attn.output_proj", "up", "down"} <= set(e._modules)
    assert "up.weight" in e._params and e._params["up.weight"].module == "up"
