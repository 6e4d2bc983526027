"""What a capture wraps, and how it puts everything back.

Paddle's Python API reaches its kernels through the functions of `paddle._C_ops`, and many
modules bind those functions by name (`from paddle._C_ops import add`), so wrapping the
attribute of `paddle._C_ops` alone would miss calls. `framework_plan()` scans `sys.modules`
for every module attribute that *is* (by identity) a `_C_ops` function and replaces each
bound copy with one shared wrapper; it rescans when new modules were imported since the last
scan. The C-level operators and methods of `paddle.Tensor` (`__add__`, `__matmul__`, `clone`,
...) are wrapped too, and `Tensor.__getitem__` as one `getitem` op. The tensor methods written
in Python (`x.reshape`, `x.T`, `x.sum`) run through `_C_ops` and need no wrapper of their own.

`Patches.install()` replaces every target; `Patches.restore()` puts every original object
back (a test checks identity); the capture installs them in a `try`/`finally`, so a forward
that raises leaves nothing patched. A wrapper records only the outermost call (a kernel a
wrapped call runs internally is part of that call) and only calls that return tensors.
"""

from __future__ import annotations

import sys
import types
import threading
from typing import Any

from torchlens_paddle.plugin import load_paddle

paddle = load_paddle()
from paddle import _C_ops  # noqa: E402

#: The tensor type: `paddle.Tensor` (dygraph's eager tensor).
TENSOR = paddle.Tensor

#: `_C_ops` kernels that draw from paddle's global generator: the recorder stores the
#: generator state before the call (`op.meta["rng_state"]`) and replay restores it.
RANDOM = frozenset({
    "gaussian", "uniform", "randint", "randperm", "dropout", "bernoulli", "multinomial", "poisson", "binomial",
    "truncated_gaussian_random", "rrelu", "fused_dropout_add", "standard_gamma", "exponential_", "uniform_inplace",
    "gaussian_inplace", "class_center_sample", "random_routing", "fused_bias_dropout_residual_layer_norm",
    "top_p_sampling",
})

#: The C-level operators of `paddle.Tensor`, named as the `_C_ops` kernel they run, so
#: `a * b` and `paddle.multiply(a, b)` are one kind of op.
OPERATORS = {
    "__add__": "add", "__radd__": "add", "__sub__": "subtract", "__rsub__": "subtract",
    "__mul__": "multiply", "__rmul__": "multiply", "__div__": "divide", "__truediv__": "divide",
    "__rdiv__": "divide", "__rtruediv__": "divide", "__floordiv__": "floor_divide", "__rfloordiv__": "floor_divide",
    "__pow__": "elementwise_pow", "__rpow__": "elementwise_pow", "__mod__": "remainder", "__rmod__": "remainder",
    "__matmul__": "matmul", "__rmatmul__": "matmul", "__gt__": "greater_than", "__ge__": "greater_equal",
    "__lt__": "less_than", "__le__": "less_equal", "__eq__": "equal", "__ne__": "not_equal",
}

#: Other C-level `paddle.Tensor` methods that compute a new tensor (recorded under their name).
TENSOR_METHODS = ("clone", "contiguous", "detach", "_tensor_use_gpudnn", "_copy_to")
METHOD_NAMES = {"_tensor_use_gpudnn": "use_gpudnn", "_copy_to": "copy_to"}

#: `paddle.Tensor` members that write into their receiver: a call during a capture refuses
#: (`inplace_op_unsupported`), as does every in-place `_C_ops` kernel (a name ending in `_`).
TENSOR_INPLACE = ("__setitem__", "copy_", "detach_", "_inplace_assign")

#: Modules that bind the kernels for static-graph (PIR) programs only: a dygraph forward never
#: calls through them (the no-silent-gap counter wraps them anyway and would see such a call).
STATIC_ONLY = frozenset({"paddle._pir_ops", "paddle.base.libpaddle.pir.ops"})

#: `_C_ops` names that are no kernel call.
SKIP = frozenset({"core"})


class _Active(threading.local):
    recorder: Any = None


ACTIVE = _Active()


def is_inplace(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def op_table() -> dict[str, Any]:
    """Kernel name -> the original `_C_ops` function, read from the unpatched module."""
    out = {}
    for name, obj in vars(_C_ops).items():
        if name.startswith("_") or name in SKIP:
            continue
        obj = getattr(obj, "__torchlens_original__", obj)
        if callable(obj) and type(obj).__name__ == "builtin_function_or_method":
            out[name] = obj
    return out


def tensor_table() -> dict[str, Any]:
    """`paddle.Tensor` member name -> the original object the capture wraps."""
    out = {}
    for name in (*OPERATORS, *TENSOR_METHODS, "__getitem__", *TENSOR_INPLACE):
        obj = vars(TENSOR).get(name)
        if obj is not None:
            out[name] = getattr(obj, "__torchlens_original__", obj)
    return out


def _wrap_kernel(original: Any, name: str, qualname: str) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = ACTIVE.recorder
        if rec is None or rec.depth:
            return original(*args, **kwargs)
        return rec.call(name, original, qualname, args, kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__torchlens_original__ = original  # type: ignore[attr-defined]
    return wrapper


_PLAN: list[tuple[Any, str, Any, Any]] = []
_SCANNED = [0]
_VERSION = [0]
_WRAPPERS: dict[int, Any] = {}


def _scan() -> list[tuple[Any, str, Any, Any]]:
    kernels = op_table()
    by_id = {id(f): name for name, f in kernels.items()}
    for name, f in kernels.items():
        if id(f) not in _WRAPPERS:
            _WRAPPERS[id(f)] = _wrap_kernel(f, name, f"paddle._C_ops.{name}")
    plan = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name.startswith("torchlens_paddle") or mod_name in STATIC_ONLY:
            continue
        try:
            attrs = vars(mod)
        except TypeError:
            continue
        for attr, obj in list(attrs.items()):
            if attr.startswith("__"):
                continue
            # Read the marker without running any __getattr__: a module attribute can be an
            # object whose attribute access has side effects (tensorflow's absl flag wrapper
            # parses sys.argv on first access), and only our own wrapper functions carry it.
            original = obj.__dict__.get("__torchlens_original__") if isinstance(obj, types.FunctionType) else None
            if original is not None and id(original) in by_id:  # a wrapper left by another thread's capture
                obj = original
            if id(obj) in by_id and obj is kernels[by_id[id(obj)]]:
                plan.append((mod, attr, obj, _WRAPPERS[id(obj)]))
    for name, original in tensor_table().items():
        if name in OPERATORS:
            wrapped = _wrap_kernel(original, OPERATORS[name], f"paddle.Tensor.{name}")
        elif name == "__getitem__":
            wrapped = _wrap_kernel(original, "getitem", "paddle.Tensor.__getitem__")
        elif name in TENSOR_METHODS:
            wrapped = _wrap_kernel(original, METHOD_NAMES.get(name, name), f"paddle.Tensor.{name}")
        else:  # the in-place members: their wrapper refuses during a capture
            wrapped = _wrap_kernel(original, name, f"paddle.Tensor.{name}")
        plan.append((TENSOR, name, original, wrapped))
    return plan


def framework_plan() -> list[tuple[Any, str, Any, Any]]:
    """(owner, name, original, wrapper) for every framework object a capture replaces. Built
    once and rebuilt when modules were imported since (a module imported later may bind a
    `_C_ops` function by name); the wrappers hold no per-capture state (they read `ACTIVE`)."""
    if not _PLAN or len(sys.modules) != _SCANNED[0]:
        _PLAN[:] = _scan()
        _SCANNED[0] = len(sys.modules)
        _VERSION[0] += 1
    return _PLAN


def resolve(qualname: str) -> Any:
    """A saved op's callable from its qualified name, through the closed table only."""
    if qualname.startswith("paddle._C_ops."):
        return op_table().get(qualname.rpartition(".")[2])
    if qualname.startswith("paddle.Tensor."):
        name = qualname.rpartition(".")[2]
        return None if name in TENSOR_INPLACE else tensor_table().get(name)
    return None


_NAMES: dict[int, str] = {}


def callable_name(fn: Any) -> str | None:
    """The name a recorded callable is saved under (`paddle._C_ops.linear`,
    `paddle.Tensor.__add__`), the one `resolve` reads back; None for any other callable."""
    if not _NAMES:
        _NAMES.update({id(f): f"paddle._C_ops.{n}" for n, f in op_table().items()})
        _NAMES.update({id(f): f"paddle.Tensor.{n}" for n, f in tensor_table().items() if n not in TENSOR_INPLACE})
    name = _NAMES.get(id(fn))
    return name if name is not None and resolve(name) is fn else None


class Patches:
    """The wrapped framework for one capture. `install()` / `restore()`; `originals` lists
    every (owner, name, original object) replaced, so a test can check identity."""

    def __init__(self) -> None:
        self.originals: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        """Module attributes are replaced one module dict at a time (`dict.update`: there
        are over a thousand), class attributes with `setattr`."""
        try:
            for owner, names, originals, replacements in _grouped():
                self.originals.append((owner, names, originals))
                if isinstance(owner, type):
                    for name, r in zip(names, replacements):
                        setattr(owner, name, r)
                else:
                    vars(owner).update(zip(names, replacements))
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        while self.originals:
            owner, names, originals = self.originals.pop()
            if isinstance(owner, type):
                for name, o in zip(names, originals):
                    setattr(owner, name, o)
            else:
                vars(owner).update(zip(names, originals))

    def replaced(self) -> list[tuple[Any, str, Any]]:
        """(owner, name, original) of every object currently replaced."""
        return [(owner, n, o) for owner, names, originals in self.originals for n, o in zip(names, originals)]


_GROUPED: list = []
_GROUPED_KEY: list = [None]


def _grouped() -> list[tuple[Any, tuple[str, ...], tuple[Any, ...], tuple[Any, ...]]]:
    """`framework_plan()` grouped by owner: (owner, names, originals, replacements), rebuilt
    when the plan is."""
    plan = framework_plan()
    key = (id(plan), _VERSION[0], len(plan))
    if _GROUPED_KEY[0] != key:
        groups: dict[int, tuple[Any, list, list, list]] = {}
        for owner, name, original, replacement in plan:
            g = groups.setdefault(id(owner), (owner, [], [], []))
            g[1].append(name)
            g[2].append(original)
            g[3].append(replacement)
        _GROUPED[:] = [(o, tuple(n), tuple(a), tuple(r)) for o, n, a, r in groups.values()]
        _GROUPED_KEY[0] = key
    return _GROUPED


__all__ = ["ACTIVE", "Patches", "framework_plan", "op_table", "tensor_table", "resolve", "is_inplace", "RANDOM"]
