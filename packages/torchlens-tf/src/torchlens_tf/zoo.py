"""The TensorFlow backend's small Keras models for tests and the conformance suite (roles
`mlp`, `conv`, `attention`, `loop`, `constant`, `random`), each with its tier-3 oracle: the
model's computation written by hand on the model's own weights, calling `tap(label, value)` at
op outputs it reproduces (labels are the trace's). Layer steps are the same Keras layers called
one at a time (`conv`, `attention`); the other steps are raw TensorFlow ops.

Every entry also carries `count_ops`, the conformance no-silent-gap counter
(`count_tf_ops`), written without the capture machinery.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf

CONST = tf.constant([0.5, -1.0, 2.0, 0.25])


def _square_sum(out):
    return tf.reduce_sum(out ** 2)


def _backward(trace, loss):
    return trace.backward(loss)  # the tf backend takes the loss as a callable of the outputs


def _autodiff(forward):
    """The gradient oracle: `tf.GradientTape` over the hand forward, differentiating the loss
    with respect to a zero perturbation added at every tapped value (never the backend's own
    backward)."""
    def grads(loss, *args, **kwargs):
        seen = {}

        def find(label, v):
            seen[label] = v
            return v

        forward(find, *args, **kwargs)
        labels = list(seen)
        eps = [tf.zeros_like(seen[label]) for label in labels]
        by = dict(zip(labels, eps))
        with tf.GradientTape() as tape:
            for e in eps:
                tape.watch(e)
            value = loss(forward(lambda label, v: v + by[label], *args, **kwargs))
        g = tape.gradient(value, eps, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return dict(zip(labels, g))
    return grads


# models ---------------------------------------------------------------------------------------

def mlp_model() -> keras.Model:
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="fc1"),
                             keras.layers.Dense(2, name="fc2")], name="mlp")


def conv_model() -> keras.Model:
    """A functional-API CNN with BatchNormalization (called in inference mode)."""
    inp = keras.Input((5, 5, 2))
    h = keras.layers.Conv2D(3, 3, padding="same", name="conv")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.ReLU(name="relu")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(inp, keras.layers.Dense(2, name="head")(h), name="cnn")


class AttentionBlock(keras.Model):
    """Pre-norm self-attention with a residual: LayerNormalization + MultiHeadAttention."""

    def __init__(self, heads: int = 2, key_dim: int = 4, **kw) -> None:
        super().__init__(**kw)
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.attn = keras.layers.MultiHeadAttention(heads, key_dim, name="attn")

    def call(self, x):
        h = self.norm(x)
        return x + self.attn(h, h)


class LoopNet(keras.Model):
    """One layer applied three times."""

    def __init__(self, steps: int = 3, **kw) -> None:
        super().__init__(**kw)
        self.inp = keras.layers.Dense(4, name="inp")
        self.cell = keras.layers.Dense(4, name="cell")
        self.steps = steps

    def call(self, x):
        h = self.inp(x)
        for _ in range(self.steps):
            h = tf.tanh(self.cell(h))
        return h


class ConstantNet(keras.Model):
    """Adds a closure constant (a tensor that is no input, variable or op output)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.fc = keras.layers.Dense(4, name="fc")

    def call(self, x):
        return tf.nn.relu(self.fc(x) + CONST)


class RandomNet(keras.Model):
    """Adds stateless normal noise drawn from the seed it is given."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.fc = keras.layers.Dense(4, name="fc")

    def call(self, x, seed):
        return self.fc(x) + tf.random.stateless_normal((3, 4), seed=seed)


# hand forwards ----------------------------------------------------------------------------------

def _dense(layer, x):
    return tf.nn.bias_add(tf.linalg.matmul(x, layer.kernel.value), layer.bias.value)


def _mlp_forward(m):
    fc1, fc2 = m.layers

    def forward(tap, x):
        h = tap("matmul_1_1", tf.linalg.matmul(x, fc1.kernel.value))
        h = tap("biasadd_1_2", tf.nn.bias_add(h, fc1.bias.value))
        h = tap("relu_1_3", tf.nn.relu(h))
        h = tap("matmul_2_4", tf.linalg.matmul(h, fc2.kernel.value))
        return tap("biasadd_2_5", tf.nn.bias_add(h, fc2.bias.value))
    return forward


def _conv_forward(m):
    conv, bn, relu, pool, head = (m.get_layer(n) for n in ("conv", "bn", "relu", "pool", "head"))

    def forward(tap, x):  # the same layers, one at a time
        h = tap("biasadd_1_5", conv(x))
        h = tap("addv2_2_13", bn(h, training=False))
        h = tap("relu_1_14", relu(h))
        h = tap("mean_1_16", pool(h))
        return tap("biasadd_2_18", head(h))
    return forward


def _attention_forward(m):
    def forward(tap, x):
        h = tap("addv2_3_19", m.norm(x))
        a = tap("biasadd_1_53", m.attn(h, h))
        return tap("addv2_7_54", x + a)
    return forward


def _loop_forward(m):
    def forward(tap, x):
        h = tap("biasadd_1_2", _dense(m.inp, x))
        for i in range(m.steps):
            h = tap(f"biasadd_2_4:{i + 1}", _dense(m.cell, h))
            h = tap(f"tanh_1_5:{i + 1}", tf.tanh(h))
        return h
    return forward


def _constant_forward(m):
    def forward(tap, x):
        h = tap("biasadd_1_2", _dense(m.fc, x))
        h = tap("addv2_1_4", h + CONST)
        return tap("relu_1_5", tf.nn.relu(h))
    return forward


def _random_forward(m):
    def forward(tap, x, seed):
        h = tap("biasadd_1_2", _dense(m.fc, x))
        return tap("addv2_2_11", h + tf.random.stateless_normal((3, 4), seed=seed))
    return forward


# the independent op counter -----------------------------------------------------------------------

#: op types that are no array computation of the forward: a variable read is the variable
#: itself (a parameter, or a constant for any other variable)
_NOT_OPS = frozenset({"ReadVariableOp"})


def count_tf_ops(model, *args, **kwargs) -> int:
    """The conformance no-silent-gap counter: how many TensorFlow ops a plain forward executes
    that return arrays, counted without the capture machinery (no op callback). It wraps the
    two Python entry points eager ops run through, the generated wrappers' fast path
    (`pywrap_tfe.TFE_Py_FastPathExecute`) and the slow path (`execute.execute`), runs
    `tf.function`s eagerly as a capture does, counts every op whose outputs include a
    non-resource tensor (a fast-path call that falls back to the slow path counts once, there),
    and restores everything."""
    from tensorflow.python import pywrap_tfe
    from tensorflow.python.eager import execute

    count = [0]
    fast, slow = pywrap_tfe.TFE_Py_FastPathExecute, execute.execute

    def arrays(result) -> bool:
        items = result if isinstance(result, (list, tuple)) else [result]
        return any(isinstance(r, tf.Tensor) and r.dtype not in (tf.resource, tf.variant) for r in items)

    @functools.wraps(fast)
    def counted_fast(ctx, op_name, *a):
        out = fast(ctx, op_name, *a)
        if op_name not in _NOT_OPS and arrays(out):
            count[0] += 1
        return out

    @functools.wraps(slow)
    def counted_slow(op_name, num_outputs, inputs, attrs, ctx, name=None):
        out = slow(op_name, num_outputs, inputs, attrs, ctx, name)
        op = op_name.decode() if isinstance(op_name, bytes) else op_name
        if op not in _NOT_OPS and arrays(out):
            count[0] += 1
        return out

    eager = tf.config.functions_run_eagerly()
    pywrap_tfe.TFE_Py_FastPathExecute, execute.execute = counted_fast, counted_slow
    try:
        tf.config.run_functions_eagerly(True)
        model(*args, **kwargs)
    finally:
        pywrap_tfe.TFE_Py_FastPathExecute, execute.execute = fast, slow
        tf.config.run_functions_eagerly(eager)
    return count[0]


def _c3(forward, site, other_args) -> dict:
    return {"site": site, "forward": forward, "other_args": other_args, "other_kwargs": {},
            "loss": _square_sum, "backward": _backward, "grads": _autodiff(forward)}


def zoo() -> dict[str, dict]:
    keras.utils.set_random_seed(7)
    x = tf.reshape(tf.linspace(-1.0, 1.0, 12), (3, 4))
    other = tf.reshape(tf.cos(tf.range(12, dtype=tf.float32)), (3, 4))
    img = tf.reshape(tf.sin(tf.range(2 * 5 * 5 * 2, dtype=tf.float32)), (2, 5, 5, 2))
    seq = tf.reshape(tf.sin(tf.range(2 * 5 * 8, dtype=tf.float32) * 0.37), (2, 5, 8))
    seed = tf.constant([1234, 7], dtype=tf.int32)
    mlp, conv, attn = mlp_model(), conv_model(), AttentionBlock(name="block")
    loop, constant, random = LoopNet(name="loop"), ConstantNet(name="constant"), RandomNet(name="random")
    for model, args in ((mlp, (x,)), (conv, (img,)), (attn, (seq,)), (loop, (x,)), (constant, (x,)),
                        (random, (x, seed))):
        model(*args)  # build: create the variables before any capture
    bn = conv.get_layer("bn")  # non-trivial running statistics, so inference mode matters
    bn.moving_mean.assign(tf.constant([0.1, -0.2, 0.3]))
    bn.moving_variance.assign(tf.constant([0.5, 2.0, 1.5]))
    entries = {
        "mlp": {"model": mlp, "args": (x,), "kwargs": {}, "c3": _c3(_mlp_forward(mlp), "relu_1_3", (other,))},
        "conv": {"model": conv, "args": (img,), "kwargs": {}, "c3": _c3(_conv_forward(conv), "relu_1_14", (tf.cos(img),))},
        "attention": {"model": attn, "args": (seq,), "kwargs": {},
                      "c3": _c3(_attention_forward(attn), "biasadd_1_53", (tf.cos(seq),))},
        "loop": {"model": loop, "args": (x,), "kwargs": {}, "c3": _c3(_loop_forward(loop), "tanh_1_5:2", (other,))},
        "constant": {"model": constant, "args": (x,), "kwargs": {},
                     "c3": _c3(_constant_forward(constant), "addv2_1_4", (other,))},
        "random": {"model": random, "args": (x, seed), "kwargs": {}, "reseed": lambda: None,
                   "c3": _c3(_random_forward(random), "biasadd_1_2", (other, seed))},
    }
    for entry in entries.values():
        entry["count_ops"] = count_tf_ops
    return entries
