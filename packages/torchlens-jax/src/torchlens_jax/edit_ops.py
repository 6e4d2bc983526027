"""The JAX implementations of core's intervention hooks: edit ops and module-output edits.

`JaxEditOps` is what `JAXBackend.edit_ops()` returns: the array math core's edit helpers
(`tl.zero_ablate`, `tl.steer`, `tl.positions`, subspace edits, ...) and the replay engine
run with, written with `jax.numpy`, so an edit of a JAX trace stays a `jax.Array` on the
array's own device and no torch or numpy round trip happens on the value.

JAX arrays are immutable: no edit can write into a payload another trace holds, `clone`
is a cheap copy, replay needs no argument copies (`replay_args` is the identity), and a
parameter can only change by being replaced, which replay never sees (the trace keeps the
captured array). Randomness is explicit: an op's key is one of its recorded inputs, so
`rng_state` has nothing to set, and the seeded helpers (`tl.add_noise`,
`tl.scramble_elements`) draw from a key built from the whole 64-bit seed.

`attach_module_edits` (the bound executor `tl.bind` and the guarded fast rerun) patches
`__call__` of the classes the model's modules use, at class level and only while the
handle is held, and edits each targeted module call's array outputs as it returns.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _key(seed: int) -> Any:
    """A threefry key holding all 64 bits of `seed` (`jax.random.PRNGKey` keeps only 32
    bits when 64-bit mode is off, so two seeds could draw the same stream)."""
    s = int(seed)
    data = np.array([(s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF], dtype=np.uint32)
    return jax.random.wrap_key_data(data, impl="threefry2x32")


def _array(x: Any) -> Any:
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


class JaxEditOps:
    """The math edits and replay run with, on `jax.Array` values (core's `EditOps`, plus
    `grad_enabled` for `DifferentiableEditOps`)."""

    def zeros_like(self, x: Any) -> Any:
        return jnp.zeros_like(x)

    def clone(self, x: Any) -> Any:
        return jnp.array(x, copy=True)

    def clip(self, x: Any, lo: Any, hi: Any) -> Any:
        return jnp.clip(_array(x), lo, hi)

    def mean(self, x: Any, dim: Any, keepdim: bool) -> Any:
        x = _array(x)
        return jnp.mean(x, axis=dim, keepdims=keepdim).astype(x.dtype)

    def norm(self, x: Any, dim: Any, keepdim: bool, p: float = 2.0) -> Any:
        x = _array(x)
        a = jnp.abs(x)
        if np.isinf(p):  # the max norm
            return jnp.max(a, axis=dim, keepdims=keepdim and dim is not None).astype(x.dtype)
        if dim is None:
            return (jnp.sum(a ** p) ** (1.0 / p)).astype(x.dtype)
        return (jnp.sum(a ** p, axis=dim, keepdims=keepdim) ** (1.0 / p)).astype(x.dtype)

    def randn_like(self, x: Any, seed: int) -> Any:
        x = _array(x)
        dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
        return jax.random.normal(_key(seed), x.shape, dtype).astype(x.dtype)

    def permute_flat(self, x: Any, seed: int) -> Any:
        x = _array(x)
        flat = x.reshape(-1)
        return flat[jax.random.permutation(_key(seed), flat.size)].reshape(x.shape)

    def moveaxis(self, x: Any, src: int, dst: int) -> Any:
        return jnp.moveaxis(x, src, dst)

    def where(self, mask: Any, a: Any, b: Any) -> Any:
        return jnp.where(jnp.asarray(mask), a, b)

    def asarray(self, v: Any, like: Any) -> Any:
        if like is None:
            return jnp.asarray(v)
        return jnp.asarray(v, dtype=like.dtype)

    def param_stamp(self, p: Any) -> Any:
        """A JAX array never changes in place: a stamp sees only a deleted (donated) buffer,
        which replay could no longer read."""
        if not isinstance(p, jax.Array):
            return None
        return (tuple(p.shape), str(p.dtype), bool(p.is_deleted()))

    def replay_args(self, op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """JAX primitives never write into their arguments: replay runs on them as they are."""
        return args, kwargs

    def rng_state(self, state: Any) -> Any:
        """Keys are explicit inputs of the random primitives: there is no hidden state to set."""
        return contextlib.nullcontext()

    def grad_enabled(self) -> Any:
        """JAX values carry no graph: a replay is differentiable as it is (differentiate a
        function of the values with `jax.grad`); nothing to switch on."""
        return contextlib.nullcontext()

    def keep_replay_for_backward(self, trace: Any, edits: dict[str, list[Any]]) -> None:
        """A differentiable replay's fork: its `trace.backward` re-evaluates the capture with
        these edits (core's `ReplayGradientOps`; `grads.keep_replay_for_backward`)."""
        from torchlens_jax.grads import keep_replay_for_backward

        keep_replay_for_backward(trace, edits, self)


# module-output edits (bound executor, guarded fast rerun) --------------------------------

def _edit_leaves(out: Any, fn: Any) -> tuple[Any, int]:
    """Apply `fn` to every array leaf of a module's output pytree; (output, leaves edited)."""
    count = [0]

    def one(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array):
            count[0] += 1
            return fn(leaf)
        return leaf

    new = jax.tree_util.tree_map(one, out)
    return new, count[0]


def _defining_class(cls: type) -> type | None:
    for c in cls.__mro__:
        if "__call__" in c.__dict__:
            return None if c is object else c
    return None


def attach_module_edits(model: Any, modules: list[tuple[str, Any]], rules: list, ops: Any, fired: dict) -> Any:
    """Edit each targeted module call's array outputs as it returns. `modules` is the
    model's (address, module object) list ("" or "self" for the root); `rules` are
    (address, call number or None, edit). The patching is core's `attach_class_edits`."""
    from torchlens.backends.sdk import attach_class_edits

    classes: list[type] = []
    for _a, m in modules:
        cls = _defining_class(type(m))
        if cls is not None and cls not in classes:
            classes.append(cls)
    return attach_class_edits([(a or "self", m) for a, m in modules], rules, ops, fired, classes, _edit_leaves)


__all__ = ["JaxEditOps", "attach_module_edits"]
