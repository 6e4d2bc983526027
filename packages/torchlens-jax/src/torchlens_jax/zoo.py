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


def zoo() -> dict[str, dict[str, Any]]:
    x = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
    img = jnp.linspace(-1.0, 1.0, 2 * 6 * 6 * 3, dtype=jnp.float32).reshape(2, 6, 6, 3)
    seq = jnp.sin(jnp.arange(2 * 5 * 16, dtype=jnp.float32)).reshape(2, 5, 16)
    return {
        "mlp": {"model": MLP(), "args": (x,), "kwargs": {}},
        "conv": {"model": ConvNet(), "args": (img,), "kwargs": {}},
        "attention": {"model": AttentionBlock(), "args": (seq,), "kwargs": {}},
        "loop": {"model": LoopNet(), "args": (x,), "kwargs": {}},
        "constant": {"model": constant_fn, "args": (x,), "kwargs": {}},
        "random": {"model": RandomNet(), "args": (x,), "kwargs": {"key": jax.random.PRNGKey(1234)},
                   "reseed": lambda: None},
        "eqx_mlp": {"model": EqxMLP(jax.random.PRNGKey(5)), "args": (x[0],), "kwargs": {}},
        "control_flow": {"model": control_flow_fn, "args": (x, _W), "kwargs": {},
                         "compiled_reference": "lax.fori_loop runs as one fused XLA while-loop; the capture unrolls "
                                               "it and evaluates dot_general and tanh one primitive at a time"},
    }
