"""The PaddlePaddle implementations of core's intervention hooks: edit ops (also the
backend's `ReplayOps` for core's replay engine) and module-output edits.

Edits of a paddle trace stay `paddle.Tensor`s. A random kernel replays under the generator
state it drew from at capture (`rng_state`), and the current state is put back afterwards.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

from torchlens.backends.sdk import ReplayOpsBase
from torchlens_paddle.patch import TENSOR, paddle


#: Output slots of a kernel whose contents are undefined in the calls the backend records:
#: `batch_norm` in inference mode leaves its saved mean, saved variance and reserve space unset.
#: `rnn` (LSTM, GRU, SimpleRNN) leaves its dropout state (slot 1) unset in inference.
SCRATCH_SLOTS = {"batch_norm": (3, 4, 5), "rnn": (1,)}


def _tensor(x: Any) -> Any:
    return x if isinstance(x, TENSOR) else paddle.to_tensor(np.asarray(x))


def _host(x: Any) -> np.ndarray:
    if isinstance(x, TENSOR):
        if x.dtype == paddle.bfloat16:
            return x.astype("float32").numpy()
        return x.numpy()
    return np.asarray(x)


def rng_snapshot() -> list:
    """paddle's generator states as plain values (a saved trace keeps them): per device, the
    four fields `GeneratorState.__getstate__` gives, the engine's state text as a string."""
    out = []
    for s in paddle.get_rng_state():
        a, b, c, text = s.__getstate__()
        out.append([int(a), int(b), int(c), bytes(text).decode("ascii")])
    return out


def generator_states(plain: Any) -> list:
    """The `GeneratorState`s of an `rng_snapshot` (built from plain values only)."""
    if not isinstance(plain, (list, tuple)) or not plain:
        raise ValueError("no generator state")
    cls = type(paddle.get_rng_state()[0])
    out = []
    for a, b, c, text in plain:
        s = cls.__new__(cls)
        s.__setstate__((int(a), int(b), int(c), list(str(text).encode("ascii"))))
        out.append(s)
    return out


class PaddleEditOps(ReplayOpsBase):
    """The math edits and replay run with, on `paddle.Tensor` values (core's `EditOps` and
    `DifferentiableEditOps`, and the backend's `ReplayOps`)."""

    def zeros_like(self, x: Any) -> Any:
        return paddle.zeros_like(_tensor(x))

    def clone(self, x: Any) -> Any:
        return _tensor(x).clone()

    def clip(self, x: Any, lo: Any, hi: Any) -> Any:
        return paddle.clip(_tensor(x), lo, hi)

    def mean(self, x: Any, dim: Any, keepdim: bool) -> Any:
        x = _tensor(x)
        return paddle.mean(x, axis=dim, keepdim=keepdim).astype(x.dtype)

    def norm(self, x: Any, dim: Any, keepdim: bool, p: float = 2.0) -> Any:
        x = _tensor(x)
        a = paddle.abs(x)
        if np.isinf(p):
            return paddle.max(a, axis=dim, keepdim=keepdim and dim is not None).astype(x.dtype)
        if dim is None:
            return (paddle.sum(a ** p) ** (1.0 / p)).astype(x.dtype)
        return (paddle.sum(a ** p, axis=dim, keepdim=keepdim) ** (1.0 / p)).astype(x.dtype)

    def randn_like(self, x: Any, seed: int) -> Any:
        x = _tensor(x)
        rng = np.random.default_rng(int(seed) & 0xFFFFFFFFFFFFFFFF)
        return paddle.to_tensor(rng.standard_normal(tuple(x.shape)).astype(_host(x).dtype)).astype(x.dtype)

    def permute_flat(self, x: Any, seed: int) -> Any:
        x = _tensor(x)
        perm = np.random.default_rng(int(seed) & 0xFFFFFFFFFFFFFFFF).permutation(int(np.prod(x.shape)))
        return paddle.gather(x.reshape([-1]), paddle.to_tensor(perm)).reshape(list(x.shape))

    def moveaxis(self, x: Any, src: int, dst: int) -> Any:
        return paddle.moveaxis(_tensor(x), src, dst)

    def where(self, mask: Any, a: Any, b: Any) -> Any:
        a = _tensor(a)
        b = b if isinstance(b, TENSOR) else paddle.full_like(a, b) if np.isscalar(b) else _tensor(b)
        return paddle.where(_tensor(mask).astype("bool"), a, b)

    def asarray(self, v: Any, like: Any) -> Any:
        a = v if isinstance(v, TENSOR) else paddle.to_tensor(np.asarray(v))
        return a if like is None else a.astype(like.dtype)

    def param_stamp(self, p: Any) -> Any:
        """A paddle parameter changes in place (an optimizer step, `set_value`): its inplace
        version counter moves with every write."""
        if not isinstance(p, TENSOR):
            return None
        return (tuple(p.shape), str(p.dtype), int(p._inplace_version()))

    @contextlib.contextmanager
    def _rng(self, state: Any) -> Iterator[None]:
        current = paddle.get_rng_state()
        paddle.set_rng_state(generator_states(state))
        try:
            yield
        finally:
            paddle.set_rng_state(current)

    def rng_state(self, state: Any) -> Any:
        """Run a random kernel under the generator state it drew from at capture."""
        if state is None:
            return contextlib.nullcontext()
        return self._rng(state)

    def outputs(self, op: Any, out: Any, args: tuple) -> tuple:
        if op.multi_output:
            if op.meta.get("out_tree") is not None:  # nested: the leaves, as the capture flattened them
                from torchlens_paddle.backend import flat_outputs

                return tuple(flat_outputs(out) or ())
            return tuple(out)
        return (out,)

    def compare(self, trace: Any, op: Any, got: tuple, want: tuple) -> tuple[str | None, str, dict[str, Any]]:
        """Bit-for-bit equality of every defined output slot (a kernel's scratch slots, such as
        the saved statistics of an inference-mode `batch_norm`, hold unset memory)."""
        skip = SCRATCH_SLOTS.get(op.func_name, ())
        if skip and len(got) == len(want):
            skip = {i % len(got) for i in skip}
            keep = [i for i in range(len(got)) if i not in skip]
            got, want = tuple(got[i] for i in keep), tuple(want[i] for i in keep)
        return super().compare(trace, op, got, want)

    def equal(self, a: Any, b: Any) -> bool:
        if a is None or b is None:
            return a is b
        if isinstance(a, TENSOR) and isinstance(b, TENSOR) and a.dtype != b.dtype:
            return False
        return super().equal(_host(a), _host(b))

    def grad_enabled(self) -> Any:
        return paddle.set_grad_enabled(True)


# module-output edits (bound executor, guarded fast rerun) --------------------------------

def _edit_tensor_output(out: Any, fn: Any) -> tuple[Any, int]:
    """Edit a module output that is one tensor; any other output is left as it is."""
    return (fn(out), 1) if isinstance(out, TENSOR) else (out, 0)


def attach_module_edits(model: Any, modules: list[tuple[str, Any]], rules: list, ops: Any, fired: dict) -> Any:
    """Edit each targeted layer call's tensor output as it returns (`rules`: (address, call
    number or None, edit)). The patching is core's `attach_class_edits` on
    `paddle.nn.Layer.__call__` (every layer call goes through it)."""
    from torchlens.backends.sdk import attach_class_edits

    return attach_class_edits(modules, rules, ops, fired, [paddle.nn.Layer], _edit_tensor_output)


__all__ = ["PaddleEditOps", "attach_module_edits"]
