"""The MLX implementations of core's intervention hooks: edit ops (also the backend's
`ReplayOps` for core's replay engine) and module-output edits.

Edits of an MLX trace stay `mx.array`s. Replay copies the receiver of an in-place operator
(`a[i] = v`, `a += b`) so a saved payload is never written, and runs a keyless `mx.random`
draw with the key it consumed at capture passed explicitly (`call`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import mlx.core as mx
import numpy as np

from torchlens.backends.sdk import ReplayOpsBase

_ASTYPE = mx.array.astype  # bound at import: never a wrapped (recorded) call


def _array(x: Any) -> Any:
    return x if isinstance(x, mx.array) else mx.array(np.asarray(x))


class MLXEditOps(ReplayOpsBase):
    """The math edits and replay run with, on `mx.array` values (core's `EditOps`, and the
    backend's `ReplayOps`)."""

    def zeros_like(self, x: Any) -> Any:
        return mx.zeros_like(_array(x))

    def clone(self, x: Any) -> Any:
        return mx.array(_array(x))

    def clip(self, x: Any, lo: Any, hi: Any) -> Any:
        return mx.clip(_array(x), lo, hi)

    def mean(self, x: Any, dim: Any, keepdim: bool) -> Any:
        x = _array(x)
        return mx.mean(x, axis=dim, keepdims=keepdim).astype(x.dtype)

    def norm(self, x: Any, dim: Any, keepdim: bool, p: float = 2.0) -> Any:
        x = _array(x)
        a = mx.abs(x)
        if np.isinf(p):
            return mx.max(a, axis=dim, keepdims=keepdim and dim is not None).astype(x.dtype)
        if dim is None:
            return (mx.sum(a ** p) ** (1.0 / p)).astype(x.dtype)
        return (mx.sum(a ** p, axis=dim, keepdims=keepdim) ** (1.0 / p)).astype(x.dtype)

    def randn_like(self, x: Any, seed: int) -> Any:
        x = _array(x)
        key = mx.random.key(int(seed) & 0xFFFFFFFFFFFFFFFF)
        return mx.random.normal(x.shape, key=key).astype(x.dtype)

    def permute_flat(self, x: Any, seed: int) -> Any:
        x = _array(x)
        flat = x.reshape(-1)
        perm = mx.random.permutation(flat.size, key=mx.random.key(int(seed) & 0xFFFFFFFFFFFFFFFF))
        return flat[perm].reshape(x.shape)

    def moveaxis(self, x: Any, src: int, dst: int) -> Any:
        return mx.moveaxis(_array(x), src, dst)

    def where(self, mask: Any, a: Any, b: Any) -> Any:
        return mx.where(_array(mask), a, b)

    def asarray(self, v: Any, like: Any) -> Any:
        a = v if isinstance(v, mx.array) else mx.array(np.asarray(v))
        return a if like is None else a.astype(like.dtype)

    def param_stamp(self, p: Any) -> Any:
        """An MLX parameter changes by being replaced in its module (replay reads the captured
        array), or by an in-place operator, which the stamp cannot see."""
        if not isinstance(p, mx.array):
            return None
        return (tuple(p.shape), str(p.dtype))

    def replay_args(self, op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """An in-place operator's receiver is copied: replay never writes a saved payload."""
        if op.is_inplace and args:
            args = (self.clone(args[0]),) + tuple(args[1:])
        return args, kwargs

    def rng_state(self, state: Any) -> Any:
        """MLX's global key cannot be set from a saved value: a keyless draw replays with the
        key it consumed passed explicitly (`call`), so there is no state to restore."""
        return contextlib.nullcontext()

    def call(self, op: Any, args: tuple, kwargs: dict) -> Any:
        key = op.meta.get("rng_key")
        if key is not None:
            kwargs = {**kwargs, "key": mx.array(key, dtype=mx.uint32)}
        return op.func(*args, **kwargs)

    def equal(self, a: Any, b: Any) -> bool:
        if a is None or b is None:
            return a is b
        if isinstance(a, mx.array):
            mx.eval(a)
        if isinstance(b, mx.array):
            mx.eval(b)
        if isinstance(a, mx.array) and isinstance(b, mx.array) and mx.bfloat16 in (a.dtype, b.dtype):
            # numpy has no bfloat16: compare in float32, which holds every bfloat16 value exactly
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            return super().equal(np.array(_ASTYPE(a, mx.float32)), np.array(_ASTYPE(b, mx.float32)))
        return super().equal(a, b)

    def grad_enabled(self) -> Any:
        return contextlib.nullcontext()


# module-output edits (bound executor, guarded fast rerun) --------------------------------

def _edit_array_output(out: Any, fn: Any) -> tuple[Any, int]:
    """Edit a module output that is one array; any other output is left as it is."""
    return (fn(out), 1) if isinstance(out, mx.array) else (out, 0)


def attach_module_edits(model: Any, modules: list[tuple[str, Any]], rules: list, ops: Any, fired: dict) -> Any:
    """Edit each targeted module call's array output as it returns (`rules`: (address, call
    number or None, edit)). The patching is core's `attach_class_edits`."""
    from torchlens.backends.sdk import attach_class_edits
    from torchlens_mlx.patch import defining_classes

    classes = defining_classes([m for _a, m in modules])
    return attach_class_edits(modules, rules, ops, fired, classes, _edit_array_output)


__all__ = ["MLXEditOps", "attach_module_edits"]
