"""Interventions on JAX traces (issue 14 §8): replay edits, patch_from, sweep, capture-time
`intervene=`, gradients of edited captures, bound module edits, and the refusals.

Every oracle is a hand-written forward in plain JAX that reads the model's own weights and
applies the edit where the site sits, independent of the recorded graph and of the replay
engine: flax.nnx and equinox attention blocks (one head zeroed at the per-head attention
output, a mid op), and the MLP for the cone, patch and sweep checks.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
eqx = pytest.importorskip("equinox")

import jax.numpy as jnp  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.errors import AmbiguousAxisError, InterventionError  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers next to this file
from jax_test_models import EqxAttentionBlock  # noqa: E402
from torchlens_jax import zoo as Z  # noqa: E402

X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
X2 = jnp.cos(jnp.arange(12, dtype=jnp.float32)).reshape(3, 4)
SEQ = jnp.sin(jnp.arange(160, dtype=jnp.float32)).reshape(2, 5, 16)
GRADS = tl.CaptureOptions(backward_ready=True, save_grads=True)


def _close(a, b, tol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _near(a, b, tol=1e-6) -> bool:
    """`_close` as a value, for tests that state their assertions in the body."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=tol, atol=tol))


# hand-written forwards ------------------------------------------------------------------------

def _mlp_parts(m):
    return m.fc1.kernel[...], m.fc1.bias[...], m.fc2.kernel[...], m.fc2.bias[...]


def mlp_forward(m, x, *, pre=None, hidden=None):
    """fc2(relu(fc1(x))); `pre` edits fc1's output (add_1_3), `hidden` the relu output (max_1_4)."""
    W1, b1, W2, b2 = _mlp_parts(m)
    h = x @ W1 + b1
    if pre is not None:
        h = pre(h)
    r = jnp.maximum(h, 0.0)
    if hidden is not None:
        r = hidden(r)
    return r @ W2 + b2


def _ln(x, w, b, eps):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * w + b


def _gelu(x):
    return jax.nn.gelu(x, approximate=True)


def flax_block_forward(m, x, head_edit=None):
    """Z.AttentionBlock by hand; `head_edit` edits the (batch, query, head, dim) attention
    output before the output projection (the op `reshape_9_43`)."""
    a = m.attn
    h = _ln(x, m.ln1.scale[...], m.ln1.bias[...], m.ln1.epsilon)
    q = jnp.einsum("bsi,ihd->bshd", h, a.query.kernel[...]) + a.query.bias[...]
    k = jnp.einsum("bsi,ihd->bshd", h, a.key.kernel[...]) + a.key.bias[...]
    v = jnp.einsum("bsi,ihd->bshd", h, a.value.kernel[...]) + a.value.bias[...]
    q = q / jnp.sqrt(jnp.float32(q.shape[-1]))
    w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", w, v)
    if head_edit is not None:
        o = head_edit(o)
    x = x + jnp.einsum("bqhd,hdo->bqo", o, a.out.kernel[...]) + a.out.bias[...]
    h = _ln(x, m.ln2.scale[...], m.ln2.bias[...], m.ln2.epsilon)
    u = h @ m.up.kernel[...] + m.up.bias[...]
    return x + _gelu(u) @ m.down.kernel[...] + m.down.bias[...]


def eqx_block_forward(m, x, head_edit=None):
    """EqxAttentionBlock (unbatched (seq, dim)) by hand; `head_edit` edits
    the (seq, head, dim) attention output before the output projection."""
    a = m.attn
    heads = a.num_heads
    h = _ln(x, m.ln1.weight, m.ln1.bias, m.ln1.eps)
    q = (h @ a.query_proj.weight.T).reshape(x.shape[0], heads, -1)
    k = (h @ a.key_proj.weight.T).reshape(x.shape[0], heads, -1)
    v = (h @ a.value_proj.weight.T).reshape(x.shape[0], heads, -1)
    q = q / jnp.sqrt(jnp.float32(q.shape[-1]))
    w = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k), axis=-1)
    o = jnp.einsum("hqk,khd->qhd", w, v)
    if head_edit is not None:
        o = head_edit(o)
    x = x + o.reshape(x.shape[0], -1) @ a.output_proj.weight.T
    h = _ln(x, m.ln2.weight, m.ln2.bias, m.ln2.eps)
    u = h @ m.up.weight.T + m.up.bias
    return x + _gelu(u) @ m.down.weight.T + m.down.bias


def _eqx_block():
    return EqxAttentionBlock(key=jax.random.PRNGKey(0)), jnp.sin(jnp.arange(80, dtype=jnp.float32)).reshape(5, 16)


def _head_site(t, shape):
    """The per-head attention output: the one op of `attn` with this (.., head, dim) shape
    feeding the output projection."""
    found = [o for o in t.ops if o.kind == "op" and tuple(o.shape) == shape and "attn" in (o.modules or ())
             and o.func_name in ("reshape", "transpose")]
    return found[-1].label


# capability and registration -------------------------------------------------------------------

def test_jax_declares_interventions_and_returns_jax_edit_ops():
    proto = tl.backends.get_protocol("jax")
    assert proto.capabilities().interventions
    assert "interventions_unsupported" not in proto.refusal_codes()
    from torchlens.backends.protocol import check_capability_protocols

    check_capability_protocols(proto)  # every SupportsInterventions / DifferentiableEditOps member is there
    ops = proto.edit_ops()
    z = ops.zeros_like(X)
    assert isinstance(z, jax.Array) and z.shape == X.shape and not np.any(np.asarray(z))


# replay: one head of an attention block -----------------------------------------------------

def _zero_head(head, axis):
    def edit(o):
        idx = [slice(None)] * o.ndim
        idx[axis] = head
        return o.at[tuple(idx)].set(0.0)

    return edit


def _head_mask(shape, head, axis):
    mask = np.zeros(shape, dtype=bool)
    idx = [slice(None)] * len(shape)
    idx[axis] = head
    mask[tuple(idx)] = True
    return mask


def test_zero_ablating_one_head_of_the_flax_block_equals_the_hand_edited_forward():
    m = Z.AttentionBlock()
    t = tl.trace(m, SEQ, backend="jax")
    _close(flax_block_forward(m, SEQ), t.output_ops[0].out)  # the hand forward is the model's forward
    site = _head_site(t, (2, 5, 2, 8))
    assert site == "reshape_9_43"
    mask = _head_mask((1, 1, 2, 1), 1, 2)
    f = t.fork().do(tl.units(site, mask), tl.zero_ablate())
    want = flax_block_forward(m, SEQ, head_edit=_zero_head(1, 2))
    _close(f.output_ops[0].out, want)
    assert isinstance(f.output_ops[0].out, jax.Array) and isinstance(f.ops[site].out, jax.Array)
    assert not np.any(np.asarray(f.ops[site].out)[:, :, 1]) and np.any(np.asarray(f.ops[site].out)[:, :, 0])
    assert np.abs(np.asarray(want) - np.asarray(t.output_ops[0].out)).max() > 1e-3  # the edit matters
    _close(t.output_ops[0].out, flax_block_forward(m, SEQ))  # the root trace is untouched


def test_zero_ablating_one_head_of_the_equinox_block_equals_the_hand_edited_forward():
    m, x = _eqx_block()
    t = tl.trace(m, x, backend="jax")
    _close(eqx_block_forward(m, x), t.output_ops[0].out)
    site = _head_site(t, (5, 2, 8))
    f = t.fork().do(site, lambda v, *, ctx: v.at[:, 0].set(0.0))  # a slice edit by a user hook
    want = eqx_block_forward(m, x, head_edit=_zero_head(0, 1))
    _close(f.output_ops[0].out, want)
    g = t.fork().do(tl.units(site, _head_mask((1, 2, 1), 0, 1)), tl.zero_ablate())  # the same through tl.units
    _close(g.output_ops[0].out, want)
    assert np.abs(np.asarray(want) - np.asarray(t.output_ops[0].out)).max() > 1e-3


# the downstream cone ---------------------------------------------------------------------------

def _count_primitive_calls(monkeypatch):
    from torchlens_jax.interpret import PrimitiveCall

    calls = []
    original = PrimitiveCall.__call__

    def counted(self, *args):
        calls.append(self.primitive.name)
        return original(self, *args)

    monkeypatch.setattr(PrimitiveCall, "__call__", counted)
    return calls


def test_a_last_layer_edit_recomputes_only_its_downstream_cone(monkeypatch):
    m = Z.MLP()
    t = tl.trace(m, X, backend="jax")
    calls = _count_primitive_calls(monkeypatch)
    f = t.fork().do("max_1_4", tl.scale(0.5))
    # by hand: relu's output feeds fc2's dot_general, whose output the bias add reads; the bias
    # reshape (reshape_2_6) reads only a parameter, so it is outside the cone
    assert f.last_run["reexecuted"] == [t.ops[lb].label for lb in ("dotgeneral_2_5", "add_2_7")]
    assert calls == ["dot_general", "add"]  # exactly two equations ran, counted at the primitive
    _close(f.output_ops[0].out, mlp_forward(m, X, hidden=lambda r: 0.5 * r))
    calls.clear()
    f.do("add_2_7", tl.scale(2.0))  # the last op: nothing downstream is an equation
    assert f.last_run["reexecuted"] == [] and calls == []
    _close(f.output_ops[0].out, 2.0 * mlp_forward(m, X, hidden=lambda r: 0.5 * r))


def test_an_edit_in_the_attention_block_reruns_exactly_the_ops_after_it(monkeypatch):
    m = Z.AttentionBlock()
    t = tl.trace(m, SEQ, backend="jax")
    calls = _count_primitive_calls(monkeypatch)
    f = t.fork().do("dotgeneral_8_75", tl.zero_ablate())  # the `down` projection's matmul
    # by hand: its bias add (add_13_77) and the residual add (add_14_78)
    assert f.last_run["reexecuted"] == ["add_13_77", "add_14_78"] and calls == ["add", "add"]
    x1 = t.ops["add_7_47"].out
    _close(f.output_ops[0].out, x1 + m.down.bias[...])


# patch_from, sweep, capture-time intervene= ----------------------------------------------------

def test_patch_from_another_jax_trace_equals_the_hand_patched_forward():
    m = Z.MLP()
    clean = tl.trace(m, X, backend="jax")
    donor = tl.trace(m, X2, backend="jax")
    W1, b1, _, _ = _mlp_parts(m)
    f = clean.fork().do("add_1_3", tl.patch_from(donor))
    assert _near(f.output_ops[0].out, mlp_forward(m, X, pre=lambda h: X2 @ W1 + b1))
    assert _near(f.ops["add_1_3"].out, donor.ops["add_1_3"].out)
    live = tl.trace(m, X, backend="jax", intervene=tl.when("add_1_3", tl.patch_from(donor)))
    assert _near(live.output_ops[0].out, f.output_ops[0].out)


def test_sweep_over_scales_equals_the_hand_forward_for_each_scale():
    m = Z.MLP()
    scales = [0.0, 0.5, 2.0]
    traces = tl.sweep(m, X, "max_1_4", scales, edit=tl.scale, backend="jax")
    assert len(traces) == 3
    for s, t in zip(scales, traces):
        _close(t.output_ops[0].out, mlp_forward(m, X, hidden=lambda r, s=s: s * r))
        _close(t.output, mlp_forward(m, X, hidden=lambda r, s=s: s * r))  # the model's return is the edited one
    # glossary l. 794: loss= needs a gradient site (tl.grad); a forward site refuses before any capture
    graded = tl.sweep(m, X, tl.grad("add_1_3"), [0.5, 3.0], edit=tl.scale, backend="jax", capture=GRADS,
                      loss=lambda t: loss)  # on JAX the backward takes the loss function of the output
    plain = jax.grad(lambda x: loss(mlp_forward(m, x)))(X)  # add_1_3 is the only path back to the input
    for s, t in zip((0.5, 3.0), graded):
        _close(t.output, mlp_forward(m, X))  # a gradient edit leaves the forward alone
        _close(t.input_ops[0].grad, s * plain)
    calls = []
    with pytest.raises(InterventionError) as exc:
        tl.sweep(lambda x: calls.append(x) or x, X, "mul_1_1", [1.0], backend="jax", loss=lambda t: loss)
    assert exc.value.code == "do_loss_without_gradient_site" and calls == []
    with pytest.raises(InterventionError) as exc:
        tl.sweep(lambda x: calls.append(x) or x, X, "mul_1_1", [1.0], backend="jax", loss="sum")
    assert exc.value.code == "do_loss_not_callable" and calls == []  # refused before any capture ran


def test_capture_time_intervene_gives_what_replay_gives():
    for m, x, site, edit in ((Z.MLP(), X, "add_1_3", tl.scale(-1.5)),
                             (Z.AttentionBlock(), SEQ, "reshape_9_43", tl.add_noise(0.3, seed=2**40 + 5)),
                             (Z.AttentionBlock(), SEQ, "ln1", None)):
        if edit is None:
            site, edit = tl.module("ln1"), tl.clamp(min=-0.5, max=0.5)
        t = tl.trace(m, x, backend="jax")
        replayed = t.fork().do(site, edit)
        live = tl.trace(m, x, backend="jax", intervene=tl.when(site, edit))
        assert live.last_run["engine"] == "live" and live.last_run["hooks_fired"] == 1
        assert [o.label for o in live.ops] == [o.label for o in t.ops]
        for op in t.ops:
            _close(live.ops[op.label].out, replayed.ops[op.label].out)
        _close(live.output, replayed.output_ops[0].out)


def test_add_noise_uses_the_whole_64_bit_seed():
    ops = tl.backends.get_protocol("jax").edit_ops()
    a, b = ops.randn_like(X, 5), ops.randn_like(X, 2**40 + 5)
    assert not np.allclose(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(ops.randn_like(X, 2**40 + 5)), np.asarray(b))


def test_the_rerun_engine_on_a_jax_trace():
    m = Z.MLP()
    t = tl.trace(m, X, backend="jax")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # editing a root trace in place warns
        t.do("max_1_4", tl.zero_ablate(), model=m, inputs=X)
    assert t.last_run["engine"] == "rerun"
    _close(t.output_ops[0].out, mlp_forward(m, X, hidden=lambda r: 0.0 * r))


# gradients of edited captures -------------------------------------------------------------------

def loss(y):
    return jnp.sum(jnp.sin(3.0 * y) * y)


def test_gradients_of_a_live_edited_capture_are_those_of_the_edited_forward():
    m = Z.MLP()
    t = tl.trace(m, X, backend="jax", capture=GRADS, intervene=tl.when("add_1_3", tl.scale(2.0)))
    t.backward(loss)
    W1, b1, W2, b2 = _mlp_parts(m)
    h = 2.0 * (X @ W1 + b1)
    r = jnp.maximum(h, 0.0)
    assert _near(t.ops["max_1_4"].grad, jax.grad(lambda v: loss(v @ W2 + b2))(r))
    assert _near(t.ops["add_1_3"].grad, jax.grad(lambda v: loss(jnp.maximum(v, 0.0) @ W2 + b2))(h))
    # upstream of the edit the gradient flows through the scale
    d1 = X @ W1
    assert _near(t.ops["dotgeneral_1_1"].grad, jax.grad(lambda d: loss(jnp.maximum(2.0 * (d + b1), 0.0) @ W2 + b2))(d1))
    assert _near(t.input_ops[0].grad, jax.grad(lambda x: loss(mlp_forward(m, x, pre=lambda v: 2.0 * v)))(X))


def test_a_gradient_edit_changes_what_flows_back_from_its_site():
    m = Z.MLP()
    t = tl.trace(m, X, backend="jax", capture=GRADS, intervene=tl.when(tl.grad("max_1_4"), tl.scale(0.0)))
    t.backward(loss)
    W1, b1, W2, b2 = _mlp_parts(m)
    r = jnp.maximum(X @ W1 + b1, 0.0)
    assert not np.any(np.asarray(t.ops["max_1_4"].grad))  # the edited gradient is what the op holds
    assert not np.any(np.asarray(t.input_ops[0].grad))  # and all that flows further back
    _close(t.ops["dotgeneral_2_5"].grad, jax.grad(lambda d: loss(d + b2))(r @ W2))  # downstream is untouched


def test_a_replayed_fork_refuses_backward_and_names_the_edited_capture():
    t = tl.trace(Z.MLP(), X, backend="jax", capture=GRADS)
    f = t.fork().do("max_1_4", tl.scale(0.5))  # a plain replayed fork keeps no graph
    with pytest.raises(tl.errors.InvalidArgumentError) as exc:
        f.backward(loss)
    assert exc.value.code == "backward_not_requested" and "intervene=" in exc.value.remedy
    assert not any(op.has_grad for op in f.ops)


# module edits through the bound executor ------------------------------------------------------

def test_bind_edits_a_module_output_of_an_nnx_and_an_equinox_model():
    m = Z.MLP()
    bound = tl.when(tl.module("fc1"), tl.scale(2.0)).bind(m)
    _close(bound(X), mlp_forward(m, X, pre=lambda h: 2.0 * h))
    assert bound.last_report["mode"] == "module_hooks" and bound.last_report["fire_counts"] == {0: 1}
    _close(m(X), mlp_forward(m, X))  # the patch is gone after the call
    e = Z.EqxMLP(jax.random.PRNGKey(5))
    bound = tl.when(tl.module("fc2"), tl.zero_ablate()).bind(e)
    _close(bound(X[0]), jnp.zeros(2))
    _close(e(X[0]), e.fc2(jax.nn.relu(e.fc1(X[0]))))


# refusals: the codes torch uses --------------------------------------------------------------

def test_bad_edits_on_jax_refuse_with_the_torch_codes_before_anything_changes():
    m = Z.MLP()
    t = tl.trace(m, X, backend="jax")
    f = t.fork()
    before = np.asarray(f.output_ops[0].out).copy()
    cases = [
        (lambda: f.do("add_1_3", tl.replace_with(jnp.zeros((3, 3), jnp.float32))), "intervention_shape_changed"),
        (lambda: f.do("add_1_3", tl.add(jnp.ones((5,), jnp.float32))), "edit_argument_shape_mismatch"),
        (lambda: f.do("add_1_3", tl.steer(jnp.ones((7,), jnp.float32))), "steer_direction_invalid"),
        (lambda: tl.add(jnp.array([1.0, jnp.nan])), "edit_argument_invalid"),
        (lambda: tl.add(jnp.array([True, False])), "edit_argument_invalid"),
        (lambda: tl.steer(jnp.zeros((8,), jnp.float32)).check_site((3, 8)) or
         f.do("add_1_3", tl.project_out(jnp.zeros((8,), jnp.float32))), "steer_direction_invalid"),
        (lambda: f.do("add_1_3", lambda v, *, ctx: v[:, :2]), "intervention_shape_changed"),
        (lambda: f.do(tl.subspace("add_1_3", jnp.ones((1, 5), jnp.float32)), tl.zero_ablate()),
         "subspace_basis_dim_mismatch"),
        (lambda: tl.units("add_1_3", jnp.ones((3, 8), jnp.float32)), "edit_argument_invalid"),
    ]
    for run, code in cases:
        with pytest.raises(InterventionError) as exc:
            run()
        assert exc.value.code == code, (code, exc.value.code)
        assert exc.value.remedy
    with pytest.raises(AmbiguousAxisError) as exc:
        tl.trace(lambda x: x * 2.0, jnp.ones((4, 4)), backend="jax").fork().do("mul_1_1", tl.steer(jnp.ones(4)))
    assert exc.value.code == "axis_ambiguous"
    np.testing.assert_array_equal(np.asarray(f.output_ops[0].out), before)  # nothing was mutated
    assert f.last_run is None


def test_helper_arguments_given_as_jax_arrays_are_read_through_the_backend():
    from torchlens.intervention import checks as C

    bf = jnp.ones((4,), jnp.bfloat16)
    arr = C.to_numpy(bf)
    assert isinstance(arr, np.ndarray) and arr.dtype == np.float32 and arr.shape == (4,)
    assert C.owning_backend(bf) is tl.backends.get_protocol("jax")
    m = Z.MLP()
    t = tl.trace(m, X, backend="jax")
    d = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    f = t.fork().do("max_1_4", tl.steer(d, 0.5))
    _close(f.output_ops[0].out, mlp_forward(m, X, hidden=lambda r: r + 0.5 * d))
    u = d / jnp.linalg.norm(d)
    g = t.fork().do("max_1_4", tl.project_out(d))
    _close(g.output_ops[0].out, mlp_forward(m, X, hidden=lambda r: r - (r @ u)[:, None] * u))


# RNG replay, loaded traces, the guarded fast rerun ---------------------------------------------

def test_random_ops_in_the_cone_replay_from_the_edited_key():
    m = Z.RandomNet()
    k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
    t1 = tl.trace(m, X, backend="jax", input_kwargs={"key": k1})
    t2 = tl.trace(m, X, backend="jax", input_kwargs={"key": k2})
    key_site = next(o.label for o in t1.input_ops if o.path == "kwargs['key']")
    f = t1.fork().do(key_site, tl.patch_from(t2))
    assert "random_bits" in [t1.ops[lb].func_name for lb in f.last_run["reexecuted"]]  # the draw ran again
    _close(f.output_ops[0].out, m(X, k2))  # from the patched key: the other key's draw, exactly
    assert np.abs(np.asarray(m(X, k1)) - np.asarray(m(X, k2))).max() > 1e-2
    g = t1.fork().do("add_1_3", tl.scale(2.0))  # upstream of nothing random: the recorded draw is reused
    noise = m(X, k1) - m.fc(X)
    _close(g.output_ops[0].out, 2.0 * m.fc(X) + noise)


def test_a_loaded_jax_trace_replays_edits(tmp_path):
    m = Z.MLP()
    tl.trace(m, X, backend="jax").save(tmp_path / "m.tlspec")
    loaded = tl.load(tmp_path / "m.tlspec")
    f = loaded.fork().do("max_1_4", tl.scale(0.5))
    assert isinstance(f.output_ops[0].out, jax.Array)
    _close(f.output_ops[0].out, mlp_forward(m, X, hidden=lambda r: 0.5 * r))


def test_the_guarded_fast_rerun_refreshes_saved_module_outputs():
    for m, x, x2 in ((Z.MLP(), X, X2), (Z.EqxMLP(jax.random.PRNGKey(5)), X[0], X2[0])):
        t = tl.trace(m, x, backend="jax", save=tl.module("fc2"))
        r = t.run(m, x2)
        assert r.last_run["engine"] == "guarded_fast"
        (label,) = r.last_run["refreshed"]
        _close(r.ops[label].out, m(x2))
        _close(r.output, m(x2))


def test_every_deterministic_helper_gives_on_jax_what_it_gives_on_numpy():
    """Each helper edits the JAX site through JaxEditOps; the oracle applies the same helper
    to the site's host copy through core's numpy edit ops (no JAX involved)."""
    from torchlens.backends.sdk import HookContext, NumpyEditOps

    m = Z.MLP()
    t = tl.trace(m, X, backend="jax")
    site = t.ops["max_1_4"]  # (3, 8)
    host = np.asarray(site.out)
    d = np.linspace(-1.0, 1.0, 8).astype(np.float32)
    basis = np.eye(8, dtype=np.float32)[:2] + 0.1
    helpers = {
        "zero": tl.zero_ablate(), "scale": tl.scale(-0.5), "add": tl.add(jnp.asarray(d)), "clamp": tl.clamp(min=0.1, max=0.4),
        "mean": tl.mean_ablate(dim=0), "replace": tl.replace_with(jnp.ones((3, 8))), "steer": tl.steer(jnp.asarray(d), 2.0),
        "onto": tl.project_onto(jnp.asarray(d)), "out": tl.project_out(d), "clip_norm": tl.clip_norm(0.5),
        "positions": tl.positions(tl.zero_ablate(), [0, 2], axis=1),
        "sub_ablate": tl.intervention.subspace_ablate(jnp.asarray(basis)),
    }
    for name, edit in helpers.items():
        got = t.fork().do("max_1_4", edit).ops["max_1_4"].out
        assert isinstance(got, jax.Array), name
        want = edit(host.copy(), HookContext("max_1_4", None, None, NumpyEditOps()))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=name)
    sub = t.fork().do(tl.subspace("max_1_4", jnp.asarray(basis)), tl.scale(0.0)).ops["max_1_4"].out
    q, _ = np.linalg.qr(basis.T.astype(np.float64))
    np.testing.assert_allclose(np.asarray(sub), host - (host @ q) @ q.T, rtol=1e-5, atol=1e-6)
    noisy = [t.fork().do("max_1_4", tl.add_noise(1.0, seed=3)).ops["max_1_4"].out for _ in range(2)]
    np.testing.assert_array_equal(np.asarray(noisy[0]), np.asarray(noisy[1]))  # the seeded stream repeats
    assert np.abs(np.asarray(noisy[0]) - host).std() > 0.5
    scrambled = np.asarray(t.fork().do("max_1_4", tl.intervention.scramble_elements(seed=1)).ops["max_1_4"].out)
    np.testing.assert_array_equal(np.sort(scrambled, axis=None), np.sort(host, axis=None))  # a permutation of the values


def test_replay_refuses_an_edit_that_would_change_a_branch_the_capture_took(tmp_path):
    """A cond's branch index and a while loop's predicate are read into Python by the capture:
    replay past an edit that changes them refuses; the live capture follows the new branch."""
    x = X + 0.2  # sum > 0: the cond doubles x
    t = tl.trace(Z.control_flow_fn, x, Z._W, backend="jax")
    with pytest.raises(InterventionError) as exc:
        t.fork().do("reducesum_1_1", tl.scale(-1.0))  # the predicate flips: the other branch would run
    assert exc.value.code == "replay_value_read_changed"
    f = t.fork().do("reducesum_1_1", tl.scale(2.0))  # same branch: replay is exact
    _close(f.output_ops[0].out, Z.control_flow_fn(x, Z._W))
    t.save(tmp_path / "cf.tlspec")
    with pytest.raises(InterventionError) as exc:
        tl.load(tmp_path / "cf.tlspec").fork().do("reducesum_1_1", tl.scale(-1.0))  # the reads are saved
    assert exc.value.code == "replay_value_read_changed"

    def loop(v):
        return jax.lax.while_loop(lambda u: u.sum() < 10.0, lambda u: u * 2.0, v)

    t = tl.trace(loop, jnp.ones(2), backend="jax")
    with pytest.raises(InterventionError) as exc:
        t.fork().do("input_1", tl.scale(3.0))  # fewer iterations would run
    assert exc.value.code == "replay_value_read_changed"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the edited run records fewer iterations after the edit
        live = tl.trace(loop, jnp.ones(2), backend="jax", intervene=tl.when("input_1", tl.scale(3.0)))
    _close(live.output, loop(3.0 * jnp.ones(2)))
