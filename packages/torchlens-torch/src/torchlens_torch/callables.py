"""The torch backend's closed callable table: the only way a loaded artifact gets code back.

An artifact never stores code, only a callable's name. Loading re-binds that name through
this table and nothing else: the table is built once, when this module is imported, from
the callables the capture's `TorchFunctionMode` can record, registered by identity:

- the ATen bindings under `torch._C` (`torch.relu`, `torch.nn.functional.linear`, the
  factory functions such as `torch.zeros`, ...), which the mode sees as they are called;
- the Python-level functions and Tensor methods that `torch.overrides` lists as
  overridable (the functions that reach the mode), including `torch.nn.functional`'s
  `boolean_dispatch` wrappers (`max_pool2d`) and the composites in `composites.py`, plus
  the public Tensor methods and `torch.nn.functional` functions it lists as ignored but
  which still reach the mode (`Tensor.unflatten`, `Tensor.new_zeros`, `F.hardswish`);
- the Tensor property getters that return tensors (`Tensor.T`, `.real`, `.mT`, ...);
- `torch.ops` operator packets and overloads of the computational namespaces
  (`_OPS_NAMESPACES`: `aten`, `prims`, the quantized and oneDNN kernels such as
  `quantized::linear_dynamic`, `torchvision`'s `nms`/`roi_align`), by their registered
  operator name: a name re-binds only while the operator registry holds it (a namespace a
  library registers, `torchvision`, binds once that library is imported), and only to the
  packet or overload object torch itself returns for it. Distributed, profiler, debugging
  and test namespaces (`c10d`, `symm_mem`, `debugprims::load_tensor`, ...) are not in it.

Callables that touch files, processes or global state, run a callable argument, or build a
tensor without checking its invariants are left out (`_DENIED`), even though the mode can
see them: a saved name for them loads as an opaque op. A name is never imported or looked
up as a dotted path, so `torch.fx.graph_module._exec_with_source`, `torch.load`,
`torch.hub.load` or `os.system` resolve to nothing.

Saving writes the name this table gives a callable (`callable_name`), and loading resolves
exactly those names (`resolve_callable`), plus the names older saves wrote where they are
unambiguous.
"""

from __future__ import annotations

import re
import types
from typing import Any

import torch
import torch.nn.functional as F

#: Names (the attribute name in its namespace) left out of the table.
_DENIED = frozenset({
    # files, processes, shared memory, devices, printing
    "from_file", "_pin_memory", "pin_memory", "share_memory_", "is_shared", "record_stream", "_print",
    "_cufft_set_plan_cache_max_size", "storage", "untyped_storage", "_typed_storage", "storage_type",
    # serialization and interop hooks
    "__reduce_ex__", "__reduce__", "__setstate__", "__getstate__", "__deepcopy__", "__array__", "__array_wrap__",
    "__dlpack__", "__dlpack_device__", "__format__", "__repr__", "_clear_non_serializable_cached_data",
    "module_load", "numpy", "tolist",
    # run a callable argument, or drive autograd
    "register_hook", "register_post_accumulate_grad_hook", "backward", "apply_", "map_", "map2_", "lobpcg",
    # re-point a tensor at other memory, or build one without checking it
    "set_", "set", "set_data", "as_subclass", "new", "_coalesced_", "sparse_resize_", "sparse_resize_and_clear_",
    "sparse_coo_tensor", "sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor",
    "sparse_compressed_tensor", "_sparse_coo_tensor_with_dims_and_tensors",
})
#: `unsafe_*` ops that only skip autograd's version checks (values are computed as usual).
_UNSAFE_OK = frozenset({"unsafe_chunk", "unsafe_split", "unsafe_split_with_sizes"})
#: Tensor properties whose getter returns a tensor (the interceptor records their reads).
_PROPERTIES = ("T", "H", "mT", "mH", "real", "imag", "data")
#: Public namespaces, in the order a callable found in several is named by.
_PUBLIC = (("torch", torch), ("torch.nn.functional", F), ("torch.linalg", torch.linalg), ("torch.fft", torch.fft),
           ("torch.special", torch.special), ("torch.functional", torch.functional), ("torch.Tensor", torch.Tensor))
#: The C++ binding namespaces the public functions come from.
_BINDINGS = (("torch._C._VariableFunctions", torch._C._VariableFunctions), ("torch._C._nn", torch._C._nn),
             ("torch._C._linalg", torch._C._linalg), ("torch._C._fft", torch._C._fft),
             ("torch._C._special", torch._C._special))
_OPS_PREFIX = "torch.ops."
#: `torch.ops` namespaces whose operators compute values (no I/O, communication or profiling).
_OPS_NAMESPACES = frozenset({"aten", "prims", "quantized", "_quantized", "quantization", "onednn", "mkldnn", "mkl",
                             "mkldnn_prepacked", "sparse", "torchvision"})
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_OPS_NAME = re.compile(rf"({_IDENT})\.({_IDENT})(?:\.({_IDENT}))?")


def _denied(attr: str) -> bool:
    return (attr in _DENIED or attr.startswith("_test") or ("unsafe" in attr and attr not in _UNSAFE_OK)
            or ("sparse" in attr and attr.endswith("_tensor")))


def _key(fn: Any) -> Any:
    """The dict key of a callable: itself (a property getter's method-wrapper compares
    equal to every other read of the same getter)."""
    try:
        hash(fn)
    except TypeError:
        return None
    return fn


class CallableTable:
    """name <-> callable for every callable a loaded torch trace may get back."""

    def __init__(self) -> None:
        self.by_name: dict[str, Any] = {}
        self.name_of: dict[Any, str] = {}
        self.legacy: dict[str, Any] = {}
        self.ops: frozenset[str] = frozenset()  # "ns.packet" and "ns.packet.overload" of registered operators
        self._ops_seen = -1  # the registry size `ops` was read at

    def add(self, name: str, fn: Any) -> None:
        key = _key(fn)
        if key is None or key in self.name_of or name in self.by_name:
            return
        self.by_name[name] = fn
        self.name_of[key] = name

    def resolve(self, name: str) -> Any:
        fn = self.by_name.get(name)
        if fn is None:
            fn = self.legacy.get(name)
        if fn is None and name.startswith(_OPS_PREFIX):
            fn = self._op(name[len(_OPS_PREFIX):])
        return fn

    def name(self, fn: Any) -> str | None:
        key = _key(fn)
        if key is not None:
            found = self.name_of.get(key)
            if found is not None:
                return found
        if isinstance(fn, torch._ops.OpOverload):
            ns, _, packet = fn._schema.name.partition("::")
            name = f"{ns}.{packet}.{fn._overloadname}"
        elif isinstance(fn, torch._ops.OpOverloadPacket):
            ns, _, packet = fn._qualified_op_name.partition("::")
            name = f"{ns}.{packet}"
        else:
            return None
        return _OPS_PREFIX + name if self.registered(name) else None

    def registered(self, name: str) -> bool:
        """`ns.packet[.overload]` is an operator of an allowed namespace in torch's registry
        (re-read when a library registered operators since the last read)."""
        if name.partition(".")[0] not in _OPS_NAMESPACES or _denied(name.split(".")[1] if "." in name else name):
            return False
        if name not in self.ops:
            self.ops, self._ops_seen = _registered_ops(self._ops_seen, self.ops)
        return name in self.ops

    def _op(self, rest: str) -> Any:
        """A registered operator packet (`aten.relu`, `quantized.linear_dynamic`) or overload
        (`aten.add.Tensor`): torch's own object for that registry name, never an import."""
        m = _OPS_NAME.fullmatch(rest)
        if m is None or not self.registered(rest):
            return None
        try:
            packet = getattr(getattr(torch.ops, m.group(1)), m.group(2))
            fn = packet if m.group(3) is None else getattr(packet, m.group(3))
        except (AttributeError, RuntimeError):
            return None
        if not isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return None
        return fn if self.name(fn) == _OPS_PREFIX + rest else None


def _registered_ops(seen: int, current: frozenset[str]) -> tuple[frozenset[str], int]:
    """The allowed namespaces' operators in torch's registry, as `ns.packet` and
    `ns.packet.overload` names (unchanged when the registry has not grown)."""
    try:
        registered = list(torch._C._dispatch_get_all_op_names())  # the operator registry, as names
    except (AttributeError, RuntimeError):
        return current, seen  # an older torch: operators then load as opaque ops
    if len(registered) == seen:
        return current, seen
    ops = set()
    for qual in registered:
        ns, _, rest = qual.partition("::")
        packet, _, overload = rest.partition(".")
        if ns in _OPS_NAMESPACES and not _denied(packet):
            ops.add(f"{ns}.{packet}")
            ops.add(f"{ns}.{packet}.{overload or 'default'}")
    return frozenset(ops), len(registered)


def _legacy_name(fn: Any) -> str:
    """The name saves before the table wrote (`module.qualname`)."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__qualname__
    return f"{module}.{name}"


def _is_tensor_method(fn: Any) -> bool:
    """A method of torch's Tensor: a C++ method descriptor or a function of `torch._tensor`."""
    if type(fn).__name__ in ("method_descriptor", "wrapper_descriptor"):
        return True
    return isinstance(fn, types.FunctionType) and fn.__module__ == "torch._tensor"


def _members(ns: Any) -> list[tuple[str, Any]]:
    """(attribute, value) pairs of a namespace, without triggering lazy submodule imports
    (a module's own dict; a class's or binding object's attributes)."""
    if isinstance(ns, types.ModuleType):
        return sorted(vars(ns).items())
    out = []
    for attr in dir(ns):
        try:
            out.append((attr, getattr(ns, attr)))
        except AttributeError:
            continue
    return out


def _build() -> CallableTable:
    from torch.overrides import get_overridable_functions

    from torchlens_torch.composites import COMPOSITE_NAMES

    allowed: list[Any] = []  # the candidates, in a stable order
    for _, ns in _BINDINGS:
        for attr, fn in _members(ns):
            if isinstance(fn, types.BuiltinFunctionType) and not _denied(attr):
                allowed.append(fn)
    for funcs in get_overridable_functions().values():
        for fn in funcs:
            if isinstance(fn, type) or type(fn).__name__ == "method-wrapper":
                continue  # classes; property getters are added by name below
            if not _denied(getattr(fn, "__name__", "") or ""):
                allowed.append(fn)
    for attr, fn in _members(torch.Tensor):  # Tensor methods the overrides list leaves out (unflatten, new_*)
        if not attr.startswith("_") and not _denied(attr) and _is_tensor_method(fn):
            allowed.append(fn)
    for attr, fn in _members(F):  # functionals the overrides list leaves out (hardswish, upsample, ...)
        if not attr.startswith("_") and not _denied(attr) and (
                isinstance(fn, types.BuiltinFunctionType)
                or (isinstance(fn, types.FunctionType) and fn.__module__ == F.__name__)):
            allowed.append(fn)
    for qual in COMPOSITE_NAMES:
        allowed.append(getattr(F, qual.rpartition(".")[2]))
    allowed_keys = {k for k in map(_key, allowed) if k is not None}

    table = CallableTable()
    for prefix, ns in _PUBLIC + _BINDINGS:  # name each by the first namespace holding it
        for attr, fn in _members(ns):
            if _denied(attr):
                continue
            key = _key(fn)
            if key is not None and key in allowed_keys:
                table.add(f"{prefix}.{attr}", fn)
    for attr in _PROPERTIES:
        getter = getattr(torch.Tensor, attr).__get__
        table.add(f"torch.Tensor.{attr}.__get__", getter)
    legacy: dict[str, list[Any]] = {}
    for fn in table.by_name.values():
        legacy.setdefault(_legacy_name(fn), []).append(fn)
    table.legacy = {n: fns[0] for n, fns in legacy.items() if len(fns) == 1 and n not in table.by_name}
    table.ops, table._ops_seen = _registered_ops(-1, frozenset())
    return table


#: The table, built once at import.
TABLE = _build()


def resolve_callable(name: str) -> Any:
    """The callable a saved name stands for, or None (the op then loads as opaque)."""
    if not isinstance(name, str):
        return None
    return TABLE.resolve(name)


def callable_name(fn: Any) -> str | None:
    """The name a save writes for a recorded callable, or None when it is not in the table."""
    return TABLE.name(fn)


__all__ = ["CallableTable", "TABLE", "resolve_callable", "callable_name"]
