"""The tinygrad implementations of core's intervention hooks: edit ops (also the backend's
`ReplayOps` for core's replay engine) and module-output edits.

Edits of a tinygrad trace stay `Tensor`s. Replay copies the receiver of an in-place write
(`assign`, `a[i] = v`, `a += b`) so a saved payload is never written, runs a draw under the
RNG state recorded before it (`rng_state`), and realizes every result, so a replayed op runs
the kernel the capture ran on the same realized buffers.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from tinygrad import Tensor, dtypes

from torchlens.backends.sdk import ReplayOpsBase
from torchlens_tinygrad.backend import host, realize, rng_state, snapshot


def _tensor(x: Any, like: Any = None) -> Any:
    if isinstance(x, Tensor):
        return x
    arr = np.asarray(x)
    return Tensor(arr, dtype=like.dtype) if like is not None else Tensor(arr)


def _done(t: Any) -> Any:
    if not TinygradEditOps.lazy_edits:
        realize(t)
    return t


class TinygradEditOps(ReplayOpsBase):
    """The math edits and replay run with, on tinygrad `Tensor` values (core's
    `DifferentiableEditOps`, and the backend's `ReplayOps`)."""

    #: set while a backward replays edits: edit results stay lazy too
    lazy_edits = False

    def zeros_like(self, x: Any) -> Any:
        x = _tensor(x)
        return _done(Tensor.zeros(*x.shape, dtype=x.dtype).contiguous())

    def clone(self, x: Any) -> Any:
        return snapshot(_tensor(x))

    def clip(self, x: Any, lo: Any, hi: Any) -> Any:
        return _done(_tensor(x).clip(lo, hi))

    def mean(self, x: Any, dim: Any, keepdim: bool) -> Any:
        x = _tensor(x)
        return _done(x.mean(axis=dim, keepdim=keepdim).cast(x.dtype))

    def norm(self, x: Any, dim: Any, keepdim: bool, p: float = 2.0) -> Any:
        x = _tensor(x)
        a = x.abs()
        if np.isinf(p):
            return _done(a.max(axis=dim, keepdim=keepdim and dim is not None).cast(x.dtype))
        return _done((a ** p).sum(axis=dim, keepdim=keepdim and dim is not None).pow(1.0 / p).cast(x.dtype))

    def randn_like(self, x: Any, seed: int) -> Any:
        """Seeded noise that consumes none of tinygrad's global stream (drawn with numpy)."""
        x = _tensor(x)
        rng = np.random.default_rng(int(seed) & 0xFFFFFFFFFFFFFFFF)
        return _done(Tensor(rng.standard_normal(tuple(x.shape)).astype(np.float32), dtype=x.dtype))

    def permute_flat(self, x: Any, seed: int) -> Any:
        x = _tensor(x)
        perm = np.random.default_rng(int(seed) & 0xFFFFFFFFFFFFFFFF).permutation(int(np.prod(x.shape)))
        return _done(x.reshape(-1)[Tensor(perm.astype(np.int32))].reshape(x.shape))

    def moveaxis(self, x: Any, src: int, dst: int) -> Any:
        x = _tensor(x)
        order = list(range(x.ndim))
        order.insert(dst % x.ndim, order.pop(src % x.ndim))
        return _done(x.permute(*order))

    def where(self, mask: Any, a: Any, b: Any) -> Any:
        return _done(_tensor(mask).cast(dtypes.bool).where(a, b))

    def asarray(self, v: Any, like: Any) -> Any:
        t = v if isinstance(v, Tensor) else _tensor(v, like)
        if like is not None and t.dtype != like.dtype:
            t = t.cast(like.dtype)
        return _done(t)

    def param_stamp(self, p: Any) -> Any:
        """A model tensor changes by being replaced in its object (replay reads the captured
        tensor) or by an in-place write into its buffer, which the stamp cannot see."""
        if not isinstance(p, Tensor):
            return None
        return (tuple(p.shape), str(p.dtype))

    def replay_args(self, op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """An in-place write's receiver is copied: replay never writes a saved payload."""
        if op.is_inplace and args:
            args = (self.clone(args[0]),) + tuple(args[1:])
        return args, kwargs

    def rng_state(self, state: Any) -> Any:
        return rng_state(state)

    def call(self, op: Any, args: tuple, kwargs: dict) -> Any:
        out = op.func(*args, **kwargs)
        if self.lazy:  # differentiable replay: realizing would cut the autodiff graph
            return out
        if isinstance(out, Tensor):
            realize(out)
        elif isinstance(out, (tuple, list)):
            realize(*[o for o in out if isinstance(o, Tensor)])
        return out

    def equal(self, a: Any, b: Any) -> bool:
        if a is None or b is None:
            return a is b
        return super().equal(host(a) if isinstance(a, Tensor) else a, host(b) if isinstance(b, Tensor) else b)

    lazy = False

    @contextlib.contextmanager
    def grad_enabled(self) -> Any:
        """Differentiable replay: results stay lazy (a realized tensor has no graph to
        differentiate)."""
        before, self.lazy = self.lazy, True
        try:
            yield
        finally:
            self.lazy = before


# module-output edits (bound executor, guarded fast rerun) --------------------------------

def _edit_tensor_output(out: Any, fn: Any) -> tuple[Any, int]:
    """Edit a module output that is one tensor; any other output is left as it is."""
    return (fn(out), 1) if isinstance(out, Tensor) else (out, 0)


def attach_module_edits(model: Any, modules: list[tuple[str, Any]], rules: list, ops: Any, fired: dict) -> Any:
    """Edit each targeted module call's tensor output as it returns (`rules`: (address, call
    number or None, edit)). The patching is core's `attach_class_edits`."""
    from torchlens.backends.sdk import attach_class_edits
    from torchlens_tinygrad.patch import defining_classes

    classes = defining_classes([m for _a, m in modules])
    return attach_class_edits(modules, rules, ops, fired, classes, _edit_tensor_output)


__all__ = ["TinygradEditOps", "attach_module_edits"]
