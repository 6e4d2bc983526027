"""The JAX backend's small models for tests and the conformance suite.

Each entry is a dict: `model`, `args`, `kwargs`, and for the random-draw model `reseed`.
Roles the suite looks for: `mlp`, `conv`, `attention`, `loop` (one layer reused),
`constant` (a closure array), `random` (a `jax.random` draw inside the forward). Extra
entries cover equinox and a plain function with control flow.

JAX randomness is explicit: the random model takes its PRNG key as an argument, so the
same key gives the same draw and `reseed` has no hidden state to reset (it is a no-op).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
    """Linear -> relu -> Linear."""

    def __init__(self, din: int = 4, dhidden: int = 8, dout: int = 2, *, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.fc1 = nnx.Linear(din, dhidden, rngs=rngs)
        self.fc2 = nnx.Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.relu(self.fc1(x)))


class ConvNet(nnx.Module):
    """Conv -> relu -> mean pool -> Linear (NHWC)."""

    def __init__(self, *, seed: int = 1) -> None:
        rngs = nnx.Rngs(seed)
        self.conv = nnx.Conv(3, 4, kernel_size=(3, 3), rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.conv(x))
        return self.head(h.mean(axis=(1, 2)))


class AttentionBlock(nnx.Module):
    """Pre-norm transformer block: LayerNorm -> self-attention -> residual -> LayerNorm -> MLP(gelu) -> residual."""

    def __init__(self, dim: int = 16, heads: int = 2, *, seed: int = 2) -> None:
        rngs = nnx.Rngs(seed)
        self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.down = nnx.Linear(2 * dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class LoopNet(nnx.Module):
    """One Linear applied `steps` times: its ops are one layer with `steps` passes."""

    def __init__(self, dim: int = 4, steps: int = 3, *, seed: int = 3) -> None:
        self.fc = nnx.Linear(dim, dim, rngs=nnx.Rngs(seed))
        self.steps = steps

    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(self.steps):
            x = jnp.tanh(self.fc(x))
        return x


_SHIFT = jnp.array([0.5, -1.0, 2.0, 0.25], dtype=jnp.float32)
_W = jnp.linspace(-1.0, 1.0, 16, dtype=jnp.float32).reshape(4, 4)


def constant_fn(x: jax.Array) -> jax.Array:
    """A plain function reading closure arrays (neither inputs nor parameters)."""
    return jax.nn.relu(x @ _W + _SHIFT)


class RandomNet(nnx.Module):
    """Adds Gaussian noise drawn from an explicit key argument."""

    def __init__(self, *, seed: int = 4) -> None:
        self.fc = nnx.Linear(4, 4, rngs=nnx.Rngs(seed))

    def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
        return self.fc(x) + 0.1 * jax.random.normal(key, x.shape)


class EqxMLP(eqx.Module):
    """The MLP written in equinox."""

    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(4, 8, key=k1)
        self.fc2 = eqx.nn.Linear(8, 2, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.relu(self.fc1(x)))


def control_flow_fn(x: jax.Array, w: jax.Array) -> jax.Array:
    """A plain function with lax.cond and a fori_loop (both unrolled by the capture)."""
    x = jax.lax.cond(x.sum() > 0, lambda v: v * 2.0, lambda v: -v, x)
    return jax.lax.fori_loop(0, 3, lambda i, v: jnp.tanh(v @ w), x)


# Tier-3 oracles (conformance cells c3_*): each model's computation written by hand in JAX ----
#
# `forward(tap, *args, **kwargs)` recomputes the model with plain jax.numpy on the model's
# own weights (or its own submodules) and calls `tap(label, value)` at each op output it
# reproduces (labels are the trace's primitive-level labels), so the suite can edit the site.
# Gradients: `jax.grad` of the hand forward with a zero perturbation added at every tapped
# value (the gradient with respect to that value), never the backend's own backward.

def _square_sum(out: jax.Array) -> jax.Array:
    return jnp.sum(out * out)


def _jax_backward(trace: Any, loss: Any) -> Any:
    return trace.backward(loss)  # the JAX backend takes the loss as a callable of the outputs


def _autodiff(forward: Any) -> Any:
    def grads(loss: Any, *args: Any, **kwargs: Any) -> dict[str, jax.Array]:
        seen: dict[str, jax.Array] = {}

        def record(label: str, value: jax.Array) -> jax.Array:
            seen[label] = value
            return value

        forward(record, *args, **kwargs)
        zeros = {lb: jnp.zeros_like(v) for lb, v in seen.items() if jnp.issubdtype(v.dtype, jnp.floating)}

        def perturbed(eps: dict[str, jax.Array]) -> jax.Array:
            return loss(forward(lambda lb, v: v + eps[lb] if lb in eps else v, *args, **kwargs))

        return jax.grad(perturbed)(zeros)

    return grads


def _lin(layer: nnx.Linear, x: jax.Array, tap: Any, dot_label: str, bias_label: str, rank: int = 2) -> jax.Array:
    """x @ kernel + bias, as nnx.Linear computes it: the product tapped as `dot_label`, the
    bias reshaped to the product's rank as `bias_label`."""
    bias = layer.bias[...]
    return tap(dot_label, x @ layer.kernel[...]) + tap(bias_label, bias.reshape((1,) * (rank - 1) + bias.shape))


def _mlp_forward(m: MLP) -> Any:
    def forward(tap, x):
        x = tap("input_1", x)
        h = tap("max_1_4", jax.nn.relu(tap("add_1_3", _lin(m.fc1, x, tap, "dotgeneral_1_1", "reshape_1_2"))))
        return tap("output_1", tap("add_2_7", _lin(m.fc2, h, tap, "dotgeneral_2_5", "reshape_2_6")))
    return forward


def _conv_forward(m: ConvNet) -> Any:
    def forward(tap, x):
        x = tap("input_1", x)
        c = jax.lax.conv_general_dilated(x, m.conv.kernel[...], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        bias = tap("reshape_1_2", m.conv.bias[...].reshape(1, 1, 1, -1))
        h = tap("max_1_4", jax.nn.relu(tap("add_1_3", tap("convgeneraldilated_1_1", c) + bias)))
        p = tap("div_1_6", tap("reducesum_1_5", jnp.sum(h, axis=(1, 2))) / (h.shape[1] * h.shape[2]))
        return tap("output_1", tap("add_2_9", _lin(m.head, p, tap, "dotgeneral_1_7", "reshape_2_8")))
    return forward


def _attention_forward(m: AttentionBlock) -> Any:
    def forward(tap, x):  # the attention and the LayerNorms run as the model's own submodules (untapped inside)
        x = tap("input_1", x)
        h = tap("add_7_47", x + tap("add_6_46", m.attn(m.ln1(x))))
        u = tap("add_10_66", m.up(m.ln2(h)))
        d = tap("add_13_77", _lin(m.down, jax.nn.gelu(u), tap, "dotgeneral_8_75", "reshape_16_76", rank=3))
        return tap("output_1", tap("add_14_78", h + d))
    return forward


def _loop_forward(m: LoopNet) -> Any:
    def forward(tap, x):
        x = tap("input_1", x)
        for i in range(1, m.steps + 1):
            h = _lin(m.fc, x, tap, f"dotgeneral_1_1:{i}", f"reshape_1_2:{i}")
            x = tap(f"tanh_1_4:{i}", jnp.tanh(tap(f"add_1_3:{i}", h)))
        return tap("output_1", x)
    return forward


def _constant_forward(_fn: Any) -> Any:
    def forward(tap, x):
        x = tap("input_1", x)
        shift = tap("broadcastindim_1_4", tap("constant_2_3", _SHIFT).reshape(1, -1))
        h = tap("add_1_5", tap("dotgeneral_1_2", x @ tap("constant_1_1", _W)) + shift)
        return tap("output_1", tap("max_1_6", jax.nn.relu(h)))
    return forward


def _random_forward(m: RandomNet) -> Any:
    def forward(tap, x, key):  # the draw is a function of the explicit key: the same key, the same noise
        x = tap("input_1", x)
        h = tap("add_1_3", _lin(m.fc, x, tap, "dotgeneral_1_1", "reshape_1_2"))
        return tap("output_1", tap("add_3_19", h + 0.1 * jax.random.normal(key, x.shape)))
    return forward


def _eqx_forward(m: EqxMLP) -> Any:
    def forward(tap, x):
        x = tap("input_1", x)
        h = tap("max_1_3", jax.nn.relu(tap("add_1_2", tap("dotgeneral_1_1", m.fc1.weight @ x) + m.fc1.bias)))
        return tap("output_1", tap("add_2_5", tap("dotgeneral_2_4", m.fc2.weight @ h) + m.fc2.bias))
    return forward


def _control_flow_forward(_fn: Any) -> Any:
    def forward(tap, x, w):
        x, w = tap("input_1", x), tap("input_2", w)
        if bool(x.sum() > 0):  # the branch lax.cond takes on these inputs
            v = tap("mul_1_4", x * 2.0)
        else:
            v = -x
        for i in range(1, 4):
            v = tap(f"tanh_1_7:{i}", jnp.tanh(tap(f"dotgeneral_1_6:{i}", v @ w)))
        return tap("output_1", v)
    return forward


def _c3(forward: Any, site: str, other_args: tuple, other_kwargs: dict | None = None) -> dict[str, Any]:
    return {"site": site, "forward": forward, "other_args": other_args, "other_kwargs": other_kwargs or {},
            "loss": _square_sum, "backward": _jax_backward, "grads": _autodiff(forward)}


def zoo() -> dict[str, dict[str, Any]]:
    x = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
    img = jnp.linspace(-1.0, 1.0, 2 * 6 * 6 * 3, dtype=jnp.float32).reshape(2, 6, 6, 3)
    seq = jnp.sin(jnp.arange(2 * 5 * 16, dtype=jnp.float32)).reshape(2, 5, 16)
    x2 = jnp.cos(jnp.arange(12, dtype=jnp.float32)).reshape(3, 4)
    img2 = jnp.cos(jnp.arange(2 * 6 * 6 * 3, dtype=jnp.float32)).reshape(2, 6, 6, 3)
    seq2 = jnp.cos(jnp.arange(2 * 5 * 16, dtype=jnp.float32)).reshape(2, 5, 16)
    mlp, conv, attention, loop = MLP(), ConvNet(), AttentionBlock(), LoopNet()
    random, eqx_mlp = RandomNet(), EqxMLP(jax.random.PRNGKey(5))
    key = jax.random.PRNGKey(1234)
    return {
        "mlp": {"model": mlp, "args": (x,), "kwargs": {}, "c3": _c3(_mlp_forward(mlp), "max_1_4", (x2,))},
        "conv": {"model": conv, "args": (img,), "kwargs": {}, "c3": _c3(_conv_forward(conv), "max_1_4", (img2,))},
        "attention": {"model": attention, "args": (seq,), "kwargs": {},
                      "c3": _c3(_attention_forward(attention), "add_7_47", (seq2,))},
        "loop": {"model": loop, "args": (x,), "kwargs": {}, "c3": _c3(_loop_forward(loop), "tanh_1_4:2", (x2,))},
        "constant": {"model": constant_fn, "args": (x,), "kwargs": {},
                     "c3": _c3(_constant_forward(constant_fn), "add_1_5", (x2,))},
        "random": {"model": random, "args": (x,), "kwargs": {"key": key}, "reseed": lambda: None,
                   "c3": _c3(_random_forward(random), "add_1_3", (x2,), {"key": key})},
        "eqx_mlp": {"model": eqx_mlp, "args": (x[0],), "kwargs": {},
                    "c3": _c3(_eqx_forward(eqx_mlp), "max_1_3", (x2[0],))},
        "control_flow": {"model": control_flow_fn, "args": (x, _W), "kwargs": {},
                         "compiled_reference": "lax.fori_loop runs as one fused XLA while-loop; the capture unrolls "
                                               "it and evaluates dot_general and tanh one primitive at a time",
                         "c3": _c3(_control_flow_forward(control_flow_fn), "tanh_1_7:2", (x2, _W))},
    }
