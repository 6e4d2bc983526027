"""What a capture wraps: the public methods, operators, creation class-methods and the `T`
property of `tinygrad.Tensor`, and `__call__` of the classes of the model's callable objects.

Granularity: every tinygrad `Tensor` method ends in `Tensor._apply_uop` (one per UOp-level
primitive), but one public method calls many others (`linear` calls `matmul`, `add`, ...,
and each of those several `_apply_uop`s). A trace records the *outermost* public call: the
wrapper counts its depth (`ACTIVE.depth`), and a call made while another wrapped call (or the
recorder itself) runs passes straight through. So `x.linear(w, b)` is one op `linear`, with
`x`, `w`, `b` as its inputs, and replays by calling `Tensor.linear` again; this is the
granularity tinygrad's own `TRACEMETA` metadata uses. Methods that are no array computation
(`realize`, `numpy`, `backward`, ...) are wrapped *silent*: they raise the depth so nothing
they do inside is recorded, and record nothing themselves. `sequential` (which calls the
model's own layers) is not wrapped, so the layers' calls are recorded.

`Patches.install()` replaces each attribute on `Tensor` itself (shadowing what `Tensor`
inherits from its mixins) and `Patches.restore()` puts every original object back, deleting
the shadows, so `Tensor.__dict__` is what it was (a test checks identity); the capture
installs them in a `try`/`finally`, so a forward that raises leaves nothing patched.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from tinygrad import Tensor

QUALPREFIX = "tinygrad.Tensor."

#: Not wrapped at all: Python object plumbing, and `sequential` (its body is the model's own
#: layers, whose calls must be recorded).
PLUMBING = frozenset({
    "__init__", "__new__", "__del__", "__repr__", "__hash__", "__bool__", "__len__", "__getattribute__",
    "__setattr__", "__delattr__", "__class__", "__dir__", "__format__", "__reduce__", "__reduce_ex__",
    "__sizeof__", "__str__", "__subclasshook__", "__init_subclass__", "__getstate__", "__setstate__",
    "sequential", "manual_seed",
})

#: Wrapped silent: no array computation of the model (evaluation, host copies, autodiff,
#: device moves in place, tensors made from outside memory: those are `constant`s where the
#: forward uses them). Nothing inside them is recorded. (`custom_kernel`, `call`, `callify`
#: are recorded, each as one opaque op that replays by calling it again.)
SILENT = frozenset({
    "realize", "numpy", "tolist", "item", "data", "backward", "gradient", "schedule_linear", "linear_with_vars",
    "to_", "shard_", "is_param_", "size", "numel", "element_size", "nbytes", "is_floating_point", "allclose",
    "max_numel", "as_param", "from_blob", "from_url",
})

#: In-place: they write into their receiver (`args[0]`); the recorded output is the receiver.
INPLACE = frozenset({"assign", "replace", "__setitem__", "__delitem__", "__iadd__", "__isub__", "__imul__",
                     "__itruediv__", "__ifloordiv__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                     "__irshift__", "__imatmul__"})

#: Random draws: the recorder reads tinygrad's RNG state before the call (replayed under it).
RANDOM = frozenset({"rand", "randn", "randint", "normal", "uniform", "scaled_uniform", "glorot_uniform",
                    "kaiming_uniform", "kaiming_normal", "randperm", "rand_like", "randn_like", "dropout",
                    "multinomial"})


class _Active(threading.local):
    recorder: Any = None
    depth: int = 0


ACTIVE = _Active()
_MISSING = object()


def _lookup(name: str) -> tuple[Any, Any]:
    """(the raw attribute as its defining class holds it, that class) for `Tensor.<name>`."""
    for cls in Tensor.__mro__:
        if name in cls.__dict__:
            return cls.__dict__[name], cls
    raise AttributeError(name)


def _raw(obj: Any) -> Any:
    return getattr(obj, "__torchlens_original__", obj)


def surface() -> dict[str, tuple[str, Any]]:
    """Public name -> (kind, raw original attribute) of every member of `Tensor` a capture
    handles: kind is "method", "classmethod", "staticmethod", "property" or "silent"
    (read through the MRO, unwrapped if a capture is running)."""
    out: dict[str, tuple[str, Any]] = {}
    names = {n for c in Tensor.__mro__ if c is not object for n in vars(c)}
    for name in sorted(names):
        if name in PLUMBING or (name.startswith("_") and not (name.startswith("__") and name.endswith("__"))):
            continue
        raw, _cls = _lookup(name)
        raw = _raw(raw)
        if isinstance(raw, property):
            if name == "T":
                out[name] = ("property", raw)
            continue
        if isinstance(raw, classmethod):
            kind = "classmethod"
        elif isinstance(raw, staticmethod):
            kind = "staticmethod"
        elif callable(raw) and not isinstance(raw, type):
            kind = "method"
        else:
            continue
        if name.startswith("__") and kind != "method":
            continue
        out[name] = ("silent" if name in SILENT else kind, raw)
    return out


def replay_table() -> dict[str, Any]:
    """Qualified name (`tinygrad.Tensor.linear`) -> the callable replay runs: the function
    for a method (the receiver is the first argument), the bound class-method for a
    creation method, `prop_T` for the `T` property. The closed table saved traces resolve
    their callables through."""
    if _TABLE:
        return _TABLE
    table: dict[str, Any] = {}
    for name, (kind, raw) in surface().items():
        if kind == "method":
            func = raw
        elif kind == "classmethod":
            func = raw.__get__(None, Tensor)
        elif kind == "staticmethod":
            func = raw.__func__
        elif kind == "property":
            func = prop_T
        else:
            continue
        table[QUALPREFIX + name] = func
        # the name a saved trace carries is the callable's own (`tinygrad.mixin.op.OpMixin.linear`)
        own = getattr(func, "__func__", func)
        table.setdefault(f"{own.__module__}.{own.__qualname__}", func)
    _TABLE.update(table)
    return _TABLE


_TABLE: dict[str, Any] = {}


def prop_T(x: Any) -> Any:
    """The replayable callable of the `T` property (a module-level function a saved trace names)."""
    return _ORIGINAL_T.fget(x)


_ORIGINAL_T = _lookup("T")[0]

#: Operators named as the method they compute (`a * b` and `a.mul(b)` are one kind of op).
_OPERATOR_NAMES = {"add": "add", "sub": "sub", "mul": "mul", "truediv": "div", "floordiv": "floordiv",
                   "mod": "mod", "pow": "pow", "matmul": "matmul", "neg": "neg", "eq": "eq", "ne": "ne",
                   "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "and": "bitwise_and", "or": "bitwise_or",
                   "xor": "bitwise_xor", "invert": "bitwise_not", "lshift": "lshift", "rshift": "rshift",
                   "abs": "abs", "getitem": "getitem"}


def op_name(name: str) -> str:
    """`__mul__` -> `mul`, `__radd__` -> `add`, `__iadd__` -> `add`, `__setitem__` stays
    itself (replay reads it), `T` -> `transpose`, `__getitem__` -> `getitem`."""
    if name in ("__setitem__", "__delitem__"):
        return name
    if name == "T":
        return "transpose"
    if name.startswith("__") and name.endswith("__"):
        base = name[2:-2]
        if base not in _OPERATOR_NAMES and base[:1] in ("r", "i") and base[1:] in _OPERATOR_NAMES:
            base = base[1:]
        return _OPERATOR_NAMES.get(base, base)
    return name


def _wrap(name: str, kind: str, raw: Any) -> Any:
    """The replacement attribute for `Tensor.<name>` (module docstring)."""
    qualname = QUALPREFIX + name
    display = op_name(name)
    inplace = name in INPLACE
    random = name in RANDOM
    if kind == "property":
        getter = raw.fget

        def fget(x: Any) -> Any:
            if ACTIVE.recorder is None or ACTIVE.depth:
                return getter(x)
            ACTIVE.depth += 1
            try:
                out = getter(x)
            finally:
                ACTIVE.depth -= 1
            return ACTIVE.recorder.record(display, prop_T, qualname, (x,), {}, out, None)

        prop = property(fget, raw.fset, raw.fdel, raw.__doc__)
        return prop
    func = raw.__func__ if kind in ("classmethod", "staticmethod") else raw

    if kind == "silent":
        @functools.wraps(func)
        def silent(*args: Any, **kwargs: Any) -> Any:
            if ACTIVE.recorder is None:
                return func(*args, **kwargs)
            ACTIVE.depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                ACTIVE.depth -= 1

        return silent

    if kind == "classmethod":
        bound_original = raw.__get__(None, Tensor)

        @functools.wraps(func)
        def cwrapper(cls: Any, *args: Any, **kwargs: Any) -> Any:
            rec = ACTIVE.recorder
            if rec is None or ACTIVE.depth or cls is not Tensor:
                return func(cls, *args, **kwargs)
            pre = rec.before(name, args, kwargs, random)
            ACTIVE.depth += 1
            try:
                out = func(cls, *args, **kwargs)
            finally:
                ACTIVE.depth -= 1
            return rec.record(display, bound_original, qualname, args, kwargs, out, pre)

        return classmethod(cwrapper)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = ACTIVE.recorder
        if rec is None or ACTIVE.depth:
            return func(*args, **kwargs)
        pre = rec.before(name, args, kwargs, random, inplace)
        ACTIVE.depth += 1
        try:
            out = func(*args, **kwargs)
        finally:
            ACTIVE.depth -= 1
        return rec.record(display, func, qualname, args, kwargs, out, pre, inplace=inplace)

    return staticmethod(wrapper) if kind == "staticmethod" else wrapper


_PLAN: list[tuple[str, Any, Any]] = []


def framework_plan() -> list[tuple[str, Any, Any]]:
    """(name, the attribute `Tensor.__dict__` held or _MISSING, replacement) for every member a
    capture replaces, built once per process (the wrappers hold no per-capture state)."""
    if not _PLAN:
        for name, (kind, raw) in surface().items():
            held = Tensor.__dict__.get(name, _MISSING)
            _PLAN.append((name, held, _wrap(name, kind, raw)))
    return _PLAN


class Patches:
    """The wrapped framework for one capture. `install()` / `restore()`; `originals` lists
    every (owner, name, original object or _MISSING) replaced, so a test can check identity."""

    def __init__(self, module_classes: list[type], module_call: Callable[[Any], Any], jit_guard: Any = None) -> None:
        self.originals: list[tuple[Any, str, Any]] = []
        self.module_classes = module_classes
        self.module_call = module_call
        self.jit_guard = jit_guard

    def install(self) -> None:
        try:
            for name, held, replacement in framework_plan():
                self.originals.append((Tensor, name, held))
                setattr(Tensor, name, replacement)
            for cls in self.module_classes:
                original = cls.__dict__["__call__"]
                self.originals.append((cls, "__call__", original))
                setattr(cls, "__call__", self.module_call(original))
            if self.jit_guard is not None:
                from tinygrad.engine.jit import _TinyJit as TinyJit

                self.originals.append((TinyJit, "__call__", TinyJit.__dict__["__call__"]))
                setattr(TinyJit, "__call__", self.jit_guard)
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        while self.originals:
            owner, name, original = self.originals.pop()
            if original is _MISSING:
                if name in owner.__dict__:
                    delattr(owner, name)
            else:
                setattr(owner, name, original)


def defining_classes(objs: list[Any]) -> list[type]:
    """The classes whose `__call__` runs for `objs` (each class in their MROs that defines
    `__call__`, below `object`), each once."""
    seen: list[type] = []
    for m in objs:
        for c in type(m).__mro__:
            if c is object:
                break
            if "__call__" in c.__dict__ and c not in seen:
                seen.append(c)
    return seen
