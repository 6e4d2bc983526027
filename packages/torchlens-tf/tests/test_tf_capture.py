"""The TensorFlow / Keras backend: capture, restore, module scopes, validation, persistence,
edits, gradients and refusals, each checked against an independent computation."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import torchlens as tl  # noqa: E402
from torchlens_tf import patch  # noqa: E402
from torchlens_tf.zoo import count_tf_ops, zoo  # noqa: E402


@pytest.fixture(scope="module")
def entries():
    return zoo()


def _trace(entry, **kw):
    return tl.trace(entry["model"], *entry["args"], backend="tf", **kw)


def _taps(entry, *args):
    seen = {}

    def tap(label, value):
        seen[label] = value
        return value

    entry["c3"]["forward"](tap, *(args or entry["args"]))
    return seen


def _layer_classes():
    from keras.src.layers.layer import Layer
    from keras.src.ops.operation import Operation

    return {Layer: Layer.__dict__["__call__"], Operation: Operation.__dict__["__call__"]}


def test_capture_restores_the_framework_exactly(entries):
    originals = _layer_classes()
    for eager in (False, True):
        tf.config.run_functions_eagerly(eager)
        before = patch.framework_state()
        _trace(entries["attention"])
        assert patch.framework_state() == before
        assert all(cls.__dict__["__call__"] is fn for cls, fn in originals.items())
    tf.config.run_functions_eagerly(False)


def test_forward_that_raises_leaves_nothing_patched():
    class Boom(keras.layers.Layer):
        def call(self, x):
            tf.nn.relu(x)
            raise RuntimeError("boom")

    originals = _layer_classes()
    layer = Boom()
    layer.build((2, 3))
    before = patch.framework_state()
    with pytest.raises(tl.errors.TraceCaptureError) as info:
        tl.trace(layer, tf.ones((2, 3)), backend="tf")
    assert info.value.code == "forward_failed"
    assert [o.func_name for o in info.value.partial_trace.ops if o.kind == "op"] == ["relu"]
    assert patch.framework_state() == before
    assert all(cls.__dict__["__call__"] is fn for cls, fn in originals.items())
    assert patch.ACTIVE.recorder is None


@pytest.mark.parametrize("name", ["mlp", "conv", "attention", "loop", "constant", "random"])
def test_every_op_equals_an_independent_evaluation(entries, name):
    """Every op is either reproduced by the hand forward (raw TF ops) or lies inside a layer call
    whose output is reproduced by calling that Keras layer by hand; every reproduced value is
    bit-equal to the recorded one, and sits in the layer the model's structure says."""
    entry = entries[name]
    t = _trace(entry)
    taps = _taps(entry)
    if name == "random":  # the steps of tf.random.stateless_normal, as raw TF ops
        seed = entry["args"][1]
        key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
        want_kc = t.ops["statelessrandomgetkeycounter_1_3"].outs
        assert np.array_equal(np.asarray(want_kc[0]), key.numpy()) and np.array_equal(np.asarray(want_kc[1]), counter.numpy())
        taps["statelessrandomgetkeycounter_1_3"] = None
        rnd = tf.raw_ops.StatelessRandomNormalV2(shape=[3, 4], key=key, counter=counter, alg=3)  # 3: AUTO_SELECT
        taps["statelessrandomnormalv2_1_6"] = rnd
        taps["mul_1_8"] = rnd * 1.0
        taps["addv2_1_10"] = taps["mul_1_8"] + 0.0
    for label, value in taps.items():
        if value is None:
            continue
        assert np.array_equal(np.asarray(t.ops[label].out), np.asarray(value)), label
    # a layer call whose output the hand forward reproduces (by calling that Keras layer)
    checked_layers = {c.label.rpartition(":")[0] for c in t.module_calls
                      if any(label in taps for label in c.output_labels)} - {"self"}
    for op in t.ops:
        if op.kind == "op":
            inside = op.module or "self"
            assert op.label in taps or any(inside == a or inside.startswith(a + ".") for a in checked_layers), op.label
    final = t.output_ops[0].parents[0]
    assert final in taps and np.array_equal(np.asarray(t.output_ops[0].out), np.asarray(taps[final]))


def test_module_paths_follow_the_model_structure(entries):
    conv = _trace(entries["conv"])
    assert [m.address for m in conv.modules] == ["self", "conv", "bn", "relu", "pool", "head"]
    assert conv.ops["conv2d_1_1"].module == "conv" and conv.ops["conv2d_1_1"].params == ("conv.kernel",)
    assert conv.ops["relu_1_14"].module == "relu" and conv.ops["mean_1_16"].module == "pool"
    bn_params = {p for o in conv.ops if o.module == "bn" for p in o.params}
    assert bn_params == {"bn.gamma", "bn.beta", "bn.moving_mean", "bn.moving_variance"}
    attn = _trace(entries["attention"])
    addrs = [m.address for m in attn.modules]
    assert addrs[:3] == ["self", "norm", "attn"] and "attn._query_dense" in addrs and "attn._output_dense" in addrs
    assert attn.ops["biasadd_1_53"].module == "attn._output_dense"
    assert attn.ops["addv2_7_54"].module == "self"
    loop = _trace(entries["loop"])
    assert [c.label for c in loop.module_calls if c.label.startswith("cell")] == ["cell:1", "cell:2", "cell:3"]
    assert [loop.ops[f"biasadd_2_4:{i}"].module for i in (1, 2, 3)] == ["cell"] * 3


def test_op_count_matches_an_independent_counter(entries):
    for name, entry in entries.items():
        t = _trace(entry)
        assert sum(o.kind == "op" for o in t.ops) == count_tf_ops(entry["model"], *entry["args"]), name

    def f(x):
        return tf.nn.relu(x) * 2.0 + tf.reduce_sum(x)

    x = tf.ones((2, 3))
    assert sum(o.kind == "op" for o in tl.trace(f, x, backend="tf").ops) == count_tf_ops(f, x) == 4


def test_tf_function_runs_op_by_op_and_eager_setting_is_restored():
    @tf.function
    def inner(x):
        return tf.tanh(x) * 3.0

    class M(keras.layers.Layer):
        def call(self, x):
            return inner(x) + 1.0

    m = M()
    m.build((2, 2))
    x = tf.constant([[0.5, -1.0], [2.0, 0.0]])
    assert not tf.config.functions_run_eagerly()
    t = tl.trace(m, x, backend="tf")
    assert not tf.config.functions_run_eagerly()
    assert [o.func_name for o in t.ops if o.kind == "op"] == ["tanh", "mul", "addv2"]
    assert np.allclose(np.asarray(t.output_ops[0].out), np.tanh(x.numpy()) * 3.0 + 1, atol=1e-6)


def test_a_graph_call_is_refused_and_a_jit_function_is_traced_through():
    @tf.function(jit_compile=True)
    def jitted(x):
        return tf.tanh(x) * 2.0

    @tf.function
    def plain(x):
        return tf.tanh(x) * 2.0

    concrete = plain.get_concrete_function(tf.TensorSpec((2,), tf.float32))
    x = tf.ones(2)
    assert [o.func_name for o in tl.trace(jitted, x, backend="tf").ops if o.kind == "op"] == ["tanh", "mul"]
    before = patch.framework_state()
    with pytest.raises(tl.errors.BackendUnsupportedError) as info:
        tl.trace(lambda v: concrete(v), x, backend="tf")
    assert info.value.code == "unwrapped_op_in_capture"
    assert patch.framework_state() == before


def test_validation_replays_and_names_a_corrupted_op(entries):
    proto = tl.backends.get_protocol("tf")
    for name in ("conv", "attention", "random"):
        assert proto.validate(_trace(entries[name]), None).ok, name
    t = _trace(entries["mlp"])
    t.ops["relu_1_3"]._outputs = (t.ops["relu_1_3"].out + 1.0,)
    status = proto.validate(t, None)
    assert not status.ok and status.first_failure in ("relu_1_3", "matmul_2_4")


def test_host_copy_and_saved_trace_validates_after_load(entries, tmp_path):
    proto = tl.backends.get_protocol("tf")
    t = _trace(entries["conv"])
    h = proto.host_copy(t.ops["relu_1_14"].out)
    assert isinstance(h, np.ndarray) and h.dtype == np.float32
    t.save(tmp_path / "conv.tlspec")
    loaded = tl.load(tmp_path / "conv.tlspec")
    assert loaded.ops["conv2d_1_1"].func is t.ops["conv2d_1_1"].func  # re-bound from the op table
    assert isinstance(loaded.ops["relu_1_14"].out, tf.Tensor)
    assert np.array_equal(np.asarray(loaded.ops["relu_1_14"].out), h)
    assert proto.validate(loaded, None).ok


def test_fork_edit_matches_hand_computation(entries):
    entry = entries["mlp"]
    t = _trace(entry)
    fc2 = entry["model"].layers[1]
    relu = np.asarray(t.ops["relu_1_3"].out)
    f = t.fork()
    f.do("relu_1_3", tl.intervention.scale(2.0))
    want = (relu * 2.0) @ fc2.kernel.numpy() + fc2.bias.numpy()
    assert np.allclose(np.asarray(f.output_ops[0].out), want, atol=1e-6)
    assert np.array_equal(np.asarray(t.output_ops[0].out), np.asarray(entry["model"](*entry["args"])))


def test_gradients_match_gradient_tape(entries):
    entry = entries["mlp"]
    m, (x,) = entry["model"], entry["args"]
    t = _trace(entry, capture=tl.CaptureOptions(backward_ready=True, save_grads=True))
    t.backward(lambda out: tf.reduce_sum(out ** 2))
    fc1, fc2 = m.layers
    with tf.GradientTape() as tape:
        h = tf.nn.relu(tf.nn.bias_add(x @ fc1.kernel.value, fc1.bias.value))
        tape.watch(h)
        loss = tf.reduce_sum((tf.nn.bias_add(h @ fc2.kernel.value, fc2.bias.value)) ** 2)
    assert np.allclose(np.asarray(t.ops["relu_1_3"].grad), tape.gradient(loss, h).numpy(), atol=1e-6)
    with pytest.raises(tl.errors.InvalidArgumentError) as info:
        t.fork().backward(lambda out: tf.reduce_sum(out))
    assert info.value.code == "backward_not_requested"


def test_bad_inputs_are_refused_typed(entries):
    m = entries["mlp"]["model"]
    with pytest.raises(tl.errors.BackendUnsupportedError) as info:
        tl.trace(m, np.ones((3, 4), np.float32), backend="tf")
    assert info.value.code == "foreign_tensor_input"
    with pytest.raises(tl.errors.InvalidArgumentError) as info:
        tl.trace(42, tf.ones((3, 4)), backend="tf")
    assert info.value.code == "model_type_unsupported"
    with pytest.raises(tl.errors.InvalidArgumentError) as info:
        tl.trace(keras.Sequential([keras.layers.Dense(2)]), tf.ones((3, 4)), backend="tf")
    assert info.value.code == "model_type_unsupported"  # not built: its first call would create variables
    for bad in ([[1.0, 2.0, 3.0, 4.0]], tf.Variable(tf.ones((3, 4))), tf.RaggedTensor.from_row_lengths([1.0, 2.0], [1, 1])):
        before = patch.framework_state()
        with pytest.raises(tl.errors.InvalidArgumentError) as info:
            tl.trace(m, bad, backend="tf")
        assert info.value.code == "invalid_argument", bad
        assert patch.framework_state() == before


def test_a_model_mixing_frameworks_is_refused():
    jnp = pytest.importorskip("jax.numpy")

    class Mixed(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.offset = jnp.ones(3)

        def call(self, x):
            return x + 1.0

    m = Mixed()
    m.build((2, 3))
    before = patch.framework_state()
    with pytest.raises(tl.errors.BackendUnsupportedError) as info:
        tl.trace(m, tf.ones((2, 3)), backend="tf")
    assert info.value.code == "foreign_tensor_input" and "offset" in str(info.value)
    assert patch.framework_state() == before


def test_stateful_random_draw_is_refused_and_nothing_stays_patched():
    def noisy(x):
        return x + tf.random.normal((2, 3))

    before = patch.framework_state()
    with pytest.raises(tl.errors.BackendUnsupportedError) as info:
        tl.trace(noisy, tf.ones((2, 3)), backend="tf")
    assert info.value.code == "tf_stateful_op_unsupported"
    assert patch.framework_state() == before


def test_deterministic_ops_marked_stateful_are_recorded():
    def checked(x):
        return tf.debugging.check_numerics(tf.nn.relu(x), "relu") * 2.0

    x = tf.constant([[-1.0, 2.0]])
    t = tl.trace(checked, x, backend="tf")
    assert [o.func_name for o in t.ops if o.kind == "op"] == ["relu", "checknumerics", "mul"]
    assert tl.backends.get_protocol("tf").validate(t, None).ok


def test_plain_function_and_closure_variable():
    v = tf.Variable([1.0, 2.0, 3.0])

    def f(x):
        return tf.nn.relu(x) * v

    x = tf.constant([[-1.0, 2.0, 0.5]])
    t = tl.trace(f, x, backend="tf")
    consts = [o for o in t.ops if o.kind == "constant"]
    assert len(consts) == 1 and np.array_equal(np.asarray(consts[0].out), v.numpy())
    assert np.array_equal(np.asarray(t.output_ops[0].out), np.maximum(x.numpy(), 0) * v.numpy())
    assert tl.backends.get_protocol("tf").validate(t, None).ok


def test_tf_module_variables_are_parameters_by_attribute_path():
    class Affine(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable([[1.0, -1.0], [0.5, 2.0]])
            self.parts = [tf.Variable([0.1, 0.2]), tf.Variable([3.0, 4.0], trainable=False)]

        def __call__(self, x):
            return x @ self.w + self.parts[0] * self.parts[1]

    m, x = Affine(), tf.constant([[1.0, 2.0]])
    t = tl.trace(m, x, backend="tf")
    assert sorted(p.address for p in t.params) == ["parts.0", "parts.1", "w"]
    assert t.ops["matmul_1_1"].params == ("w",) and t.ops["mul_1_2"].params == ("parts.0", "parts.1")
    assert not [o for o in t.ops if o.kind == "constant"]
    np.testing.assert_array_equal(np.asarray(t.output_ops[0].out), m(x).numpy())
    assert tl.backends.get_protocol("tf").validate(t, None).ok


def test_a_variable_the_forward_writes_is_a_constant_after_the_write():
    class Twice(keras.Model):
        def __init__(self):
            super().__init__()
            self.bn = keras.layers.BatchNormalization(momentum=0.5)

        def call(self, x):
            return self.bn(self.bn(x, training=True) * 2.0, training=True)

    m = Twice()
    x = tf.reshape(tf.range(12, dtype=tf.float32), (3, 4))
    m(x)
    mean0 = m.bn.moving_mean.numpy().copy()
    t = tl.trace(m, x, backend="tf")
    # the first call reads the captured moving_mean (a parameter); the second call reads the
    # value the first call's update wrote, so that read is a constant holding the new value
    readers = [o for o in t.ops if "bn.moving_mean" in o.params]
    assert readers and all(o.label.endswith(":1") for o in readers)
    np.testing.assert_array_equal(np.asarray(t.params["bn.moving_mean"].value), mean0)
    mean1 = 0.5 * mean0 + 0.5 * x.numpy().mean(axis=0)
    consts = [np.asarray(o.out) for o in t.ops if o.kind == "constant" and o.shapes[0] == (4,)]
    assert any(np.allclose(c, mean1, atol=1e-6) for c in consts)
    assert tl.backends.get_protocol("tf").validate(t, None).ok


def test_namespace_exports():
    assert tl.backends.tf.TFBackend is tl.backends.get_protocol("tf").__class__
    assert tl.backends.tf.GradOptions(wrt="params").wrt == "params"
    with pytest.raises(tl.errors.BackendUnsupportedError) as info:
        tl.trace(lambda x: x * 2.0, tf.ones(2), backend="tf", grad_options=tl.backends.tf.GradOptions())
    assert info.value.code in ("intermediate_derived_grads_unsupported", "trace_option_unsupported")


def test_nested_models_and_attribute_addresses():
    class Head(keras.Model):
        def __init__(self):
            super().__init__()
            self.proj = keras.layers.Dense(2, name="zzz")   # addressed by attribute, not by layer name
            self.blocks = [keras.layers.Dense(3, name="b0"), keras.layers.Dense(3, name="b1")]

        def call(self, x):
            for b in self.blocks:
                x = b(x)
            return self.proj(x)

    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")], name="inner")
    inp = keras.Input((4,))
    outer = keras.Model(inp, Head()(inner(inp)), name="outer")
    x = tf.reshape(tf.linspace(-1.0, 1.0, 8), (2, 4))
    t = tl.trace(outer, x, backend="tf")
    head = outer.layers[-1].name
    assert [m.address for m in t.modules] == ["self", "inner", "inner.d", head, f"{head}.proj", f"{head}.blocks.0",
                                              f"{head}.blocks.1"]
    assert [o.module for o in t.ops if o.func_name == "matmul"] == ["inner.d", f"{head}.blocks.0", f"{head}.blocks.1",
                                                                    f"{head}.proj"]
    assert t.ops["matmul_1_1"].params == ("inner.d.kernel",)
    assert np.array_equal(np.asarray(t.output_ops[0].out), outer(x).numpy())


def test_importing_the_plugin_imports_no_framework():
    import subprocess
    import sys

    code = ("import sys, torchlens, torchlens_tf, torchlens_tf.plugin, torchlens_tf.options; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'tensorflow', 'keras', 'torch', 'jax'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_shipped_scorecard_is_current():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "torchlens_conformance.scorecard", "--backend", "tf", "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_attention_gradients_equal_gradient_tape_of_the_hand_forward(entries):
    e = entries["attention"]
    t = _trace(e, capture=tl.CaptureOptions(backward_ready=True, save_grads=True))
    loss = e["c3"]["loss"]
    t.backward(loss)
    want = e["c3"]["grads"](loss, *e["args"])
    assert len(want) == 3
    for label, g in want.items():
        np.testing.assert_allclose(np.asarray(t.ops[label].grad), g.numpy(), rtol=1e-5, atol=1e-6, err_msg=label)


def test_bound_layer_edit_matches_hand_computation(entries):
    m, (x,) = entries["mlp"]["model"], entries["mlp"]["args"]
    fc1, fc2 = m.layers

    def by_hand(pre):
        h = tf.nn.relu(pre(tf.nn.bias_add(x @ fc1.kernel.value, fc1.bias.value)))
        return tf.nn.bias_add(h @ fc2.kernel.value, fc2.bias.value).numpy()

    originals = _layer_classes()
    bound = tl.when(tl.module("fc1"), tl.scale(2.0)).bind(m)
    # Dense(activation="relu") returns relu(x W + b): the edit scales the layer's output
    np.testing.assert_allclose(np.asarray(bound(x)), tf.nn.bias_add((2.0 * tf.nn.relu(
        tf.nn.bias_add(x @ fc1.kernel.value, fc1.bias.value))) @ fc2.kernel.value, fc2.bias.value).numpy(),
        rtol=1e-6, atol=1e-6)
    assert bound.last_report["fire_counts"] == {0: 1}
    assert all(cls.__dict__["__call__"] is fn for cls, fn in originals.items())
    np.testing.assert_array_equal(m(x).numpy(), by_hand(lambda h: h))  # unpatched again
