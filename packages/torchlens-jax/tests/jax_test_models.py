"""Small flax.nnx and equinox models shared by the tests (built once per session)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx


class EqxAttentionBlock(eqx.Module):
    """Pre-norm transformer block in equinox (unbatched: (seq, dim))."""

    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim: int = 16, heads: int = 2, *, key: jax.Array) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.ln2 = eqx.nn.LayerNorm(dim)
        self.up = eqx.nn.Linear(dim, 2 * dim, key=k2)
        self.down = eqx.nn.Linear(2 * dim, dim, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


def seq_input(batch: int | None = 2) -> jax.Array:
    shape = (5, 16) if batch is None else (batch, 5, 16)
    return jnp.sin(jnp.arange(int(jnp.prod(jnp.array(shape))), dtype=jnp.float32)).reshape(shape)


__all__ = ["EqxAttentionBlock", "seq_input", "nnx", "eqx"]
