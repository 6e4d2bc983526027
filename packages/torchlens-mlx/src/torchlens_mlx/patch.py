"""What a capture wraps: the public functions of `mlx.core` (and its `random`, `fast`,
`linalg`, `fft` namespaces), the operators, methods and array-valued properties of
`mx.array`, and `__call__` of the `mlx.nn` classes a model uses.

`Patches.install()` replaces each with a thin wrapper that hands the call to the active
recorder and `Patches.restore()` puts every original object back (a test checks identity);
the capture installs them in a `try`/`finally`, so a forward that raises leaves nothing
patched. Each wrapper calls the original first: a call the recorder does not want (no
capture running, or a call made by the recorder itself) costs one attribute check.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import mlx.core as mx

#: Namespaces whose public functions are wrapped, by the module path replay and saved files name.
NAMESPACES = ("mlx.core", "mlx.core.random", "mlx.core.fast", "mlx.core.linalg", "mlx.core.fft")

#: Public `mlx.core` callables that are no array operation: transforms, evaluation, devices,
#: streams, memory, files. Calls inside a transform (`mx.grad`, `mx.vjp`, `mx.vmap`) run on
#: the transform's own tracer values; the docs list it as a gap.
SKIP = frozenset({
    "eval", "async_eval", "compile", "disable_compile", "enable_compile", "grad", "value_and_grad", "vjp", "jvp",
    "vmap", "checkpoint", "custom_function", "stream", "default_device", "set_default_device", "default_stream",
    "set_default_stream", "new_stream", "synchronize", "save", "savez", "savez_compressed", "save_safetensors",
    "save_gguf", "load", "export_function", "export_to_dot", "import_function", "exporter", "clear_cache",
    "seed", "cuda_kernel", "metal_kernel", "precompiled_cuda_kernel", "array", "is_available", "device_info",
    "from_fp8", "to_fp8", "Device", "Stream", "Dtype", "DtypeCategory", "ArrayAt", "ArrayIterator",
    "finfo", "iinfo", "issubdtype", "set_cache_limit", "set_memory_limit", "set_wired_limit",
    "get_active_memory", "get_cache_memory", "get_peak_memory", "reset_peak_memory", "broadcast_shapes",
})

#: `mx.array` members that return something other than an array (`at` and `__iter__` are
#: replaced separately: `_AtProxy`, `_iterate`).
ARRAY_SKIP = frozenset({
    "item", "tolist", "at", "dtype", "shape", "ndim", "size", "itemsize", "nbytes",
    "__array__", "__array_namespace__", "__bool__", "__bytes__", "__class__", "__complex__", "__copy__",
    "__deepcopy__", "__delattr__", "__dir__", "__dlpack__", "__dlpack_device__", "__doc__", "__float__",
    "__format__", "__getattribute__", "__getstate__", "__hash__", "__index__", "__init__", "__init_subclass__",
    "__int__", "__iter__", "__len__", "__module__", "__new__", "__reduce__", "__reduce_ex__", "__repr__",
    "__setattr__", "__setstate__", "__sizeof__", "__str__", "__subclasshook__",
})

#: In-place operators: they write into their receiver (the saved payload is a snapshot).
INPLACE = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                     "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})


class _Active(threading.local):
    recorder: Any = None


ACTIVE = _Active()


def _namespace(path: str) -> Any:
    obj = mx
    for part in path.split(".")[2:]:
        obj = getattr(obj, part)
    return obj


def _is_function(obj: Any) -> bool:
    kinds = ("nb_func", "_gc_func", "builtin_function_or_method")
    return callable(obj) and not isinstance(obj, type) and type(obj).__name__ in kinds


def function_table() -> dict[str, Any]:
    """Qualified name (`mlx.core.add`, `mlx.core.random.normal`) -> the original callable, for
    every wrapped namespace function (read from the unpatched namespaces)."""
    table = {}
    for path in NAMESPACES:
        ns = _namespace(path)
        for name in dir(ns):
            if name.startswith("_") or name in SKIP:
                continue
            obj = getattr(ns, name)
            if getattr(obj, "__torchlens_original__", None) is not None:
                obj = obj.__torchlens_original__
            if _is_function(obj):
                table[f"{path}.{name}"] = obj
    return table


def array_table() -> dict[str, Any]:
    """Member name -> the original `mx.array` method or property object."""
    out = {}
    for name, obj in vars(mx.array).items():
        if name in ARRAY_SKIP:
            continue
        if getattr(obj, "__torchlens_original__", None) is not None:
            obj = obj.__torchlens_original__
        if isinstance(obj, property) or type(obj).__name__ == "nb_method":
            out[name] = obj
    return out


def property_getter(name: str) -> Callable[[Any], Any]:
    """The replayable callable of an array-valued property (`x.T`): a module-level function so
    a saved trace names it (`torchlens_mlx.patch.prop_T`)."""
    return globals()[f"prop_{name}"]


def _prop(name: str) -> Callable[[Any], Any]:
    def get(x: Any) -> Any:
        return _ORIGINAL_PROPS[name].fget(x)

    get.__name__ = get.__qualname__ = f"prop_{name}"
    return get


_ORIGINAL_PROPS = {n: o for n, o in vars(mx.array).items() if isinstance(o, property) and n not in ARRAY_SKIP}
for _n in _ORIGINAL_PROPS:
    globals()[f"prop_{_n}"] = _prop(_n)


#: Operators named as the `mlx.core` function they compute (`a * b` and `mx.multiply(a, b)`
#: are one kind of op).
_OPERATOR_NAMES = {"mul": "multiply", "sub": "subtract", "truediv": "divide", "div": "divide",
                   "floordiv": "floor_divide", "mod": "remainder", "pow": "power", "neg": "negative",
                   "eq": "equal", "ne": "not_equal", "lt": "less", "le": "less_equal", "gt": "greater",
                   "ge": "greater_equal", "and": "logical_and", "or": "logical_or", "invert": "bitwise_invert",
                   "lshift": "left_shift", "rshift": "right_shift", "xor": "bitwise_xor", "abs": "abs"}


def op_name(name: str) -> str:
    """`__mul__` -> `multiply`, `__radd__` -> `add`, `__iadd__` -> `add`, `__setitem__` stays
    itself (replay reads it), `T` -> `transpose`."""
    if name == "__setitem__":
        return name
    if name in ("T", "mT"):
        return "transpose"
    if name.startswith("__") and name.endswith("__"):
        base = name[2:-2]
        if base not in _OPERATOR_NAMES and base[:1] in ("r", "i") and base[1:] in _OPERATOR_NAMES | {"add": 0, "matmul": 0}:
            base = base[1:]
        return _OPERATOR_NAMES.get(base, base)
    return name


def _wrap_function(original: Any, name: str, qualname: str) -> Any:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = ACTIVE.recorder
        if rec is None or rec.busy:
            return original(*args, **kwargs)
        pre = rec.before(qualname, args, kwargs)
        out = original(*args, **kwargs)
        return rec.record(op_name(name), original, qualname, args, kwargs, out, pre)

    wrapper.__torchlens_original__ = original  # type: ignore[attr-defined]
    return wrapper


def _wrap_method(original: Any, name: str) -> Any:
    qualname = f"mlx.core.array.{name}"
    inplace = name in INPLACE

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = ACTIVE.recorder
        if rec is None or rec.busy:
            return original(*args, **kwargs)
        pre = rec.before(qualname, args, kwargs)
        out = original(*args, **kwargs)
        return rec.record(op_name(name), original, qualname, args, kwargs, out, pre, inplace=inplace)

    wrapper.__name__ = name
    wrapper.__torchlens_original__ = original  # type: ignore[attr-defined]
    return wrapper


def _wrap_property(original: property, name: str) -> property:
    getter = property_getter(name)
    qualname = f"torchlens_mlx.patch.prop_{name}"

    def fget(x: Any) -> Any:
        rec = ACTIVE.recorder
        out = original.fget(x)
        if rec is None or rec.busy:
            return out
        return rec.record(op_name(name), getter, qualname, (x,), {}, out, None)

    prop = property(fget, original.fset, original.fdel, original.__doc__)
    fget.__torchlens_original__ = original  # type: ignore[attr-defined]
    return prop


# `a.at[idx].add(v)` and iteration ---------------------------------------------------------

AT_METHODS = ("add", "subtract", "multiply", "divide", "maximum", "minimum")


def _at_function(method: str) -> Callable[..., Any]:
    def at(a: Any, idx: Any, v: Any) -> Any:
        return getattr(_ORIGINAL_AT.fget(a)[idx], method)(v)

    at.__name__ = at.__qualname__ = f"at_{method}"
    return at


_ORIGINAL_AT = vars(mx.array)["at"]
_ORIGINAL_ITER = vars(mx.array)["__iter__"]
for _m in AT_METHODS:
    globals()[f"at_{_m}"] = _at_function(_m)


class _AtIndexed:
    def __init__(self, a: Any, idx: Any) -> None:
        self._a, self._idx = a, idx

    def _apply(self, method: str, v: Any) -> Any:
        func = globals()[f"at_{method}"]
        out = func(self._a, self._idx, v)
        rec = ACTIVE.recorder
        if rec is None or rec.busy:
            return out
        return rec.record(f"at_{method}", func, f"torchlens_mlx.patch.at_{method}", (self._a, self._idx, v), {}, out, None)


for _m in AT_METHODS:
    setattr(_AtIndexed, _m, (lambda m: lambda self, v: self._apply(m, v))(_m))


class _AtProxy:
    """What `a.at` gives during a capture: `a.at[idx].add(v)` is one op `at_add(a, idx, v)`."""

    def __init__(self, a: Any) -> None:
        self._a = a

    def __getitem__(self, idx: Any) -> _AtIndexed:
        return _AtIndexed(self._a, idx)


def _at_property() -> property:
    def fget(a: Any) -> Any:
        rec = ACTIVE.recorder
        if rec is None or rec.busy:
            return _ORIGINAL_AT.fget(a)
        return _AtProxy(a)

    return property(fget, doc=_ORIGINAL_AT.__doc__)


def _iterate(a: Any) -> Any:
    """Iteration during a capture: each row is `a[i]` through the wrapped `__getitem__`."""
    rec = ACTIVE.recorder
    if rec is None or rec.busy:
        yield from _ORIGINAL_ITER(a)
        return
    if a.ndim == 0:
        raise TypeError("iteration over a 0-d array")
    for i in range(a.shape[0]):
        yield a[i]


_PLAN: list[tuple[Any, str, Any, Any]] = []


def framework_plan() -> list[tuple[Any, str, Any, Any]]:
    """(owner, name, original, wrapper) for every framework object a capture replaces, built
    once per process (the wrappers hold no per-capture state: they read `ACTIVE`)."""
    if not _PLAN:
        plan = []
        for qualname, original in function_table().items():
            path, _, name = qualname.rpartition(".")
            plan.append((_namespace(path), name, original, _wrap_function(original, name, qualname)))
        for name, original in array_table().items():
            wrapped = _wrap_property(original, name) if isinstance(original, property) else _wrap_method(original, name)
            plan.append((mx.array, name, original, wrapped))
        plan.append((mx.array, "at", _ORIGINAL_AT, _at_property()))
        plan.append((mx.array, "__iter__", _ORIGINAL_ITER, _iterate))
        _PLAN.extend(plan)
    return _PLAN


class Patches:
    """The wrapped framework for one capture. `install()` / `restore()`; `originals` lists
    every (owner, name, original object) replaced, so a test can check identity."""

    def __init__(self, module_classes: list[type], module_call: Callable[[Any], Any]) -> None:
        self.originals: list[tuple[Any, str, Any]] = []
        self.module_classes = module_classes
        self.module_call = module_call

    def install(self) -> None:
        try:
            for owner, name, original, replacement in framework_plan():
                self.originals.append((owner, name, original))
                setattr(owner, name, replacement)
            for cls in self.module_classes:
                original = cls.__dict__["__call__"]
                self.originals.append((cls, "__call__", original))
                setattr(cls, "__call__", self.module_call(original))
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        while self.originals:
            owner, name, original = self.originals.pop()
            setattr(owner, name, original)


def defining_classes(modules: list[Any]) -> list[type]:
    """The classes whose `__call__` runs for `modules` (each class defining `__call__` in
    their MROs below `mlx.nn.Module`), each once."""
    import mlx.nn as nn

    seen: list[type] = []
    for m in modules:
        if not isinstance(m, nn.Module):
            continue
        for c in type(m).__mro__:
            if c is nn.Module or c is dict or c is object:
                break
            if "__call__" in c.__dict__ and c not in seen:
                seen.append(c)
    return seen
