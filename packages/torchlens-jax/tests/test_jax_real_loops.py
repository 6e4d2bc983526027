"""Issue 28 item 6: a module called inside a loop body (`lax.scan`, `lax.while_loop`,
`nnx.RNN`) is one module call per iteration, as a Python loop would give, and each call's
output equals JAX's own per-step value (the scan's stacked outputs, computed by `lax.scan`
itself, not by torchlens). `loops="rolled"` records each loop as one op with no step cap."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.errors import BackendUnsupportedError, InvalidArgumentError  # noqa: E402


class Cell(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, h, x):
        return jnp.tanh(self.lin(h) + x)


class ScanNet(nnx.Module):
    def __init__(self, rngs):
        self.cell = Cell(rngs)
        self.head = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, xs):
        def step(h, x):
            h = self.cell(h, x)
            return h, h

        _, hs = jax.lax.scan(step, jnp.zeros(3), xs)
        return self.head(hs), hs


XS = (jnp.arange(15, dtype=jnp.float32).reshape(5, 3) - 7) / 5


def _module_outs(t, address):
    return [np.asarray(c.out) for c in t._modules[address].calls]


def test_a_module_in_lax_scan_is_one_call_per_step_with_jaxs_per_step_values():
    m = ScanNet(nnx.Rngs(0))
    t = tl.trace(m, XS, backend="jax")
    _, hs = m(XS)  # JAX's own per-step hidden states (lax.scan stacks them)
    assert t._modules["cell"].num_calls == 5 and t._modules["cell.lin"].num_calls == 5
    assert t._modules["head"].num_calls == 1
    outs = _module_outs(t, "cell")
    for k in range(5):
        np.testing.assert_array_equal(outs[k], np.asarray(hs[k]))
        # call k+1 of cell holds exactly step k's ops: its ops all ran in iteration k
        call = t._modules["cell"].calls[k]
        assert call.call == k + 1
        assert {t[label].meta["region"]["iteration"] for label in call.op_labels} == {k}
    assert t.find_sites(tl.module("cell:3")).labels == (t._modules["cell"].calls[2].output_labels[0],)
    # the scan-level ops are the caller's; the head runs once after the loop
    assert all(o.modules == ("self",) for o in t.ops if o.func_name in ("scan_slice", "scan_stack"))
    assert t.validate_forward_pass()


def test_a_reverse_scan_numbers_its_calls_in_the_order_they_ran():
    class Rev(ScanNet):
        def __call__(self, xs):
            _, hs = jax.lax.scan(lambda h, x: (self.cell(h, x),) * 2, jnp.zeros(3), xs, reverse=True)
            return hs

    m = Rev(nnx.Rngs(1))
    t = tl.trace(m, XS, backend="jax")
    hs = m(XS)
    outs = _module_outs(t, "cell")
    assert len(outs) == 5
    for k in range(5):  # call 1 is the last step (reverse), call 5 the first
        np.testing.assert_array_equal(outs[k], np.asarray(hs[4 - k]))


def test_a_module_in_a_while_loop_is_one_call_per_iteration():
    class WhileNet(nnx.Module):
        def __init__(self, rngs):
            self.cell = Cell(rngs)

        def __call__(self, x):
            return jax.lax.while_loop(lambda c: c[1] < 4, lambda c: (self.cell(c[0], x), c[1] + 1), (x, 0))[0]

    m = WhileNet(nnx.Rngs(2))
    x = XS[0]
    t = tl.trace(m, x, backend="jax")
    want, h = [], x
    for _ in range(4):  # the same cell, called eagerly per iteration
        h = m.cell(h, x)
        want.append(np.asarray(h))
    outs = _module_outs(t, "cell")
    assert len(outs) == 4
    for got, w in zip(outs, want):
        np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(m(x)))


def test_nnx_rnn_gru_cell_is_one_call_per_step():
    rnn = nnx.RNN(nnx.GRUCell(3, 4, rngs=nnx.Rngs(3)))
    x = XS[None]  # (batch 1, time 5, features 3)
    t = tl.trace(rnn, x, backend="jax")
    ys = np.asarray(rnn(x))  # nnx.RNN's own per-step outputs, (1, 5, 4)
    outs = [c.out for c in t._modules["cell"].calls]
    assert len(outs) == 5
    for k, out in enumerate(outs):
        # GRUCell returns (new carry, output), both the new hidden state
        got = np.asarray(out[1] if isinstance(out, (tuple, list)) else out)
        np.testing.assert_allclose(got.reshape(-1), ys[0, k], rtol=1e-6, atol=1e-6)
    assert t.validate_forward_pass()


def test_rolled_loops_lift_the_step_cap_and_record_each_scan_as_one_op(tmp_path):
    m = ScanNet(nnx.Rngs(0))
    xs = jnp.sin(jnp.arange(2000 * 3, dtype=jnp.float32)).reshape(2000, 3)
    with pytest.raises(BackendUnsupportedError) as err:
        tl.trace(m, xs, backend="jax")
    assert err.value.code == "value_dependent_branch_unsupported" and "rolled" in err.value.remedy
    t = tl.trace(m, xs, backend="jax", loops="rolled")
    scans = [o for o in t.ops if o.func_name == "scan"]
    assert len(scans) == 1 and scans[0].modules == ("self",)
    out, hs = m(xs)
    np.testing.assert_array_equal(np.asarray(scans[0].outs[1]), np.asarray(hs))  # the stacked per-step states
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(out))
    assert t._modules["head"].num_calls == 1
    assert "cell" not in {a for o in t.ops for a in o.modules}  # the body's calls are inside the one op
    assert len(t.ops) < 20
    assert t.validate_forward_pass()


def test_rolled_while_loop_is_one_op():
    f = lambda x: jax.lax.while_loop(lambda c: c[1] < 3000, lambda c: (c[0] * 0.999 + 0.001, c[1] + 1), (x, 0))[0]  # noqa: E731
    t = tl.trace(f, XS, backend="jax", loops="rolled")
    assert [o.func_name for o in t.ops if o.kind == "op"] == ["while"]
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), np.asarray(f(XS)))


def test_loops_option_refuses_an_unknown_mode_before_anything_runs():
    calls = []

    def f(x):
        calls.append(1)
        return x + 1

    with pytest.raises(InvalidArgumentError) as err:
        tl.trace(f, XS, backend="jax", loops="folded")
    assert err.value.code == "invalid_argument" and calls == []


def test_rolled_scan_backward_matches_jax_grad():
    from torchlens.options import CaptureOptions

    def f(w, xs):
        return jax.lax.scan(lambda h, x: (jnp.tanh(h * w + x),) * 2, jnp.zeros(3), xs)[1].sum()

    w = jnp.float32(0.5)
    t = tl.trace(f, w, XS, backend="jax", loops="rolled", capture=CaptureOptions(backward_ready=True, save_grads=True))
    t.backward(None)
    gw, gx = jax.grad(f, argnums=(0, 1))(w, XS)
    inputs = [o for o in t.ops if o.kind == "input"]
    np.testing.assert_allclose(np.asarray(inputs[0].grads[0]), np.asarray(gw), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(inputs[1].grads[0]), np.asarray(gx), rtol=1e-5)


def test_nested_scans_in_a_submodule_count_every_inner_step():
    class Inner(nnx.Module):
        def __init__(self, rngs):
            self.cell = Cell(rngs)
            self.post = nnx.Linear(3, 3, rngs=rngs)

        def __call__(self, xs):
            def outer_step(h, row):
                h2, _ = jax.lax.scan(lambda c, x: (self.cell(c, x), None), h, row)
                return self.post(h2), h2

            return jax.lax.scan(outer_step, jnp.zeros(3), xs)[1]

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.pre = nnx.Linear(3, 3, rngs=rngs)
            self.rnn = Inner(rngs)
            self.head = nnx.Linear(3, 1, rngs=rngs)

        def __call__(self, xs):
            return self.head(self.rnn(self.pre(xs)))

    m = Net(nnx.Rngs(4))
    xs = jnp.linspace(-1, 1, 18, dtype=jnp.float32).reshape(3, 2, 3)
    t = tl.trace(m, xs, backend="jax")
    counts = {a: t._modules[a].num_calls for a in ("pre", "rnn", "rnn.cell", "rnn.cell.lin", "rnn.post", "head")}
    assert counts == {"pre": 1, "rnn": 1, "rnn.cell": 6, "rnn.cell.lin": 6, "rnn.post": 3, "head": 1}
    order = [(c.address, c.call) for c in t.module_calls if c.address in ("rnn.cell", "rnn.post")]
    assert order[:6] == [("rnn.cell", 1), ("rnn.cell", 2), ("rnn.post", 1), ("rnn.cell", 3), ("rnn.cell", 4), ("rnn.post", 2)]
    h2 = m.rnn(m.pre(xs))  # the inner scans' final states, per outer step (JAX's own values)
    posts = [np.asarray(c.out) for c in t._modules["rnn.cell"].calls][1::2]
    for k in range(3):
        np.testing.assert_array_equal(posts[k], np.asarray(h2[k]))
    assert t.validate_forward_pass()


def test_a_cond_in_a_scan_opens_only_the_branch_taken_each_step():
    class Branchy(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(3, 3, rngs=rngs)
            self.b = nnx.Linear(3, 3, rngs=rngs)

        def __call__(self, xs):
            def step(h, x):
                h = jax.lax.cond(x.sum() > 0, lambda v: self.a(v), lambda v: self.b(v), h + x)
                return h, h

            return jax.lax.scan(step, jnp.zeros(3), xs)[1]

    m = Branchy(nnx.Rngs(5))
    xs = jnp.array([[1.0, 1, 1], [-1, -1, -1], [1, 1, 1], [1, 1, 1]]) / 4
    t = tl.trace(m, xs, backend="jax")
    assert [(c.address, c.call) for c in t.module_calls if c.address != "self"] == [("a", 1), ("b", 1), ("a", 2), ("a", 3)]
    assert all(c.op_labels for c in t.module_calls)  # no empty call for an untaken branch
    hs = m(xs)
    outs = [np.asarray(t._modules[a].calls[n - 1].out) for a, n in (("a", 1), ("b", 1), ("a", 2), ("a", 3))]
    for k in range(4):
        np.testing.assert_array_equal(outs[k], np.asarray(hs[k]))
