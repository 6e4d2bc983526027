"""What the traced object is: a plain JAX callable, a flax.nnx module or an equinox module.

A `Description` splits the model into its array leaves (parameters and buffers, each with
a dotted address such as `"fc1.kernel"` or `"layers.0.weight"`) and a `rebuild` function
that turns a list of (traced) leaves back into a callable model. The capture passes the
leaves to `jax.make_jaxpr` as explicit arguments, so every parameter read is a jaxpr input
variable with a known address instead of an anonymous closure constant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import jax
import numpy as np

from torchlens.backends.sdk import BufferInfo, ModelInfo, ModuleInfo, ParamInfo


@dataclass
class Description:
    """The traced object, split into addressed array leaves and a rebuild function."""

    kind: str  # "function" | "nnx" | "equinox"
    root_class: str
    info: ModelInfo
    leaves: list[Any] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    is_param: list[bool] = field(default_factory=list)
    rebuild: Callable[[list[Any]], Any] = lambda leaves: None
    modules_of: Callable[[Any], list[tuple[str, Any]]] = lambda model: []
    cache_key: Hashable | None = None


def model_kind(model: Any) -> str | None:
    """"nnx", "equinox", "function", or None when the object is not something we trace.
    Decided on the type's module name first, so no framework is imported to say no."""
    mro_modules = {c.__module__.split(".")[0] for c in type(model).__mro__}
    if "flax" in mro_modules:
        from flax import nnx

        return "nnx" if isinstance(model, nnx.Module) else None
    if "equinox" in mro_modules:
        import equinox as eqx

        return "equinox" if isinstance(model, eqx.Module) else None
    if callable(model) and not isinstance(model, type):
        foreign = {"torch", "tensorflow", "keras", "paddle", "mlx", "tinygrad"}
        return None if mro_modules & foreign else "function"
    return None


def describe(model: Any) -> Description:
    kind = model_kind(model)
    if kind == "nnx":
        return _describe_nnx(model)
    if kind == "equinox":
        return _describe_equinox(model)
    return _describe_function(model)


# plain callables ----------------------------------------------------------------------------

def _describe_function(fn: Any) -> Description:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    info = ModelInfo(name, modules=[ModuleInfo("self", name, getattr(fn, "__qualname__", name))])
    try:
        key: Hashable | None = ("function", fn)
        hash(key)
    except TypeError:
        key = None
    return Description("function", name, info, rebuild=lambda leaves: fn, modules_of=lambda m: [], cache_key=key)


# flax.nnx -----------------------------------------------------------------------------------

def _describe_nnx(model: Any) -> Description:
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    p_leaves, p_def = jax.tree_util.tree_flatten_with_path(params)
    r_leaves, r_def = jax.tree_util.tree_flatten_with_path(rest)
    n_params = len(p_leaves)

    def modules_of(m: Any) -> list[tuple[str, Any]]:
        return [(_join(path), node) for path, node in nnx.iter_graph(m) if isinstance(node, nnx.Module)]

    def rebuild(leaves: list[Any]) -> Any:
        p = jax.tree_util.tree_unflatten(p_def, leaves[:n_params])
        r = jax.tree_util.tree_unflatten(r_def, leaves[n_params:])
        return nnx.merge(graphdef, p, r)

    try:
        mods = _NNX_MODULES.get(graphdef)
    except TypeError:
        mods = None
    if mods is None:
        mods = _preorder(modules_of(model))
        try:
            if len(_NNX_MODULES) >= 64:
                _NNX_MODULES.clear()
            _NNX_MODULES[graphdef] = mods
        except TypeError:
            pass
    desc = Description("nnx", type(model).__name__, _model_info(model, mods), rebuild=rebuild, modules_of=modules_of)
    for i, (path, leaf) in enumerate([*p_leaves, *r_leaves]):
        keys = [_key_text(k) for k in path]
        if keys and keys[-1] == "value":  # the Variable's payload attribute
            keys = keys[:-1]
        _add_leaf(desc, ".".join(keys), leaf, i < n_params, mods)
    desc.cache_key = _leaf_key(("nnx", graphdef, p_def, r_def), desc.leaves)
    return desc


#: nnx graphdef -> its modules in preorder. A graphdef fixes the module tree (paths and
#: types); the objects stored are only read for their types and `training` flags.
_NNX_MODULES: dict[Any, list[tuple[str, Any]]] = {}


# equinox ------------------------------------------------------------------------------------

def _describe_equinox(model: Any) -> Description:
    import equinox as eqx

    flat, treedef = jax.tree_util.tree_flatten_with_path(model)
    array_pos = [i for i, (_, leaf) in enumerate(flat) if eqx.is_array(leaf)]
    statics = [leaf for _, leaf in flat]

    def modules_of(m: Any) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        _eqx_walk(m, "", out, eqx.Module)
        return out

    def rebuild(leaves: list[Any]) -> Any:
        full = list(statics)
        for pos, leaf in zip(array_pos, leaves):
            full[pos] = leaf
        return jax.tree_util.tree_unflatten(treedef, full)

    mods = _preorder(modules_of(model))
    desc = Description("equinox", type(model).__name__, _model_info(model, mods), rebuild=rebuild, modules_of=modules_of)
    for pos in array_pos:
        path, leaf = flat[pos]
        address = ".".join(_key_text(k) for k in path)
        _add_leaf(desc, address, leaf, bool(np.issubdtype(np.dtype(leaf.dtype), np.inexact)) if _plain_dtype(leaf) else False, mods)
    non_arrays = tuple(statics[i] for i in range(len(statics)) if i not in set(array_pos))
    desc.cache_key = _leaf_key(("equinox", treedef, non_arrays), desc.leaves)
    return desc


def _eqx_walk(obj: Any, address: str, out: list, module_type: type) -> None:
    if isinstance(obj, module_type):
        out.append((address, obj))
        for f in dataclasses.fields(obj):
            _eqx_walk(getattr(obj, f.name, None), _child(address, f.name), out, module_type)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            _eqx_walk(item, _child(address, str(i)), out, module_type)
    elif isinstance(obj, dict):
        for k, item in obj.items():
            _eqx_walk(item, _child(address, str(k)), out, module_type)


# shared helpers -----------------------------------------------------------------------------

def _child(address: str, name: str) -> str:
    return f"{address}.{name}" if address else name


def _join(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _key_text(k: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _preorder(mods: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Modules in preorder, root (`""`) first, each address once (first object wins)."""
    seen: dict[str, Any] = {}
    for addr, m in mods:
        seen.setdefault(addr, m)
    children: dict[str, list[str]] = {}
    for addr in seen:
        if addr:
            children.setdefault(_parent(addr), []).append(addr)
    out: list[tuple[str, Any]] = []
    stack = [""] if "" in seen else []
    while stack:
        a = stack.pop()
        out.append((a, seen[a]))
        stack.extend(reversed(children.get(a, [])))
    return out


def _parent(addr: str) -> str:
    return addr.rpartition(".")[0]


def _model_info(model: Any, mods: list[tuple[str, Any]]) -> ModelInfo:
    info = ModelInfo(type(model).__name__)
    for addr, m in mods:
        a = addr or "self"
        info.modules.append(ModuleInfo(a, type(m).__name__, type(m).__qualname__,
                                       parent=None if not addr else (_parent(addr) or "self"),
                                       training=bool(getattr(m, "training", False))))
    return info


def _owner(address: str, mods: list[tuple[str, Any]]) -> tuple[str, str]:
    best = ""
    for addr, _ in mods:
        if addr and (address == addr or address.startswith(addr + ".")) and len(addr) > len(best):
            best = addr
    name = address[len(best) + 1:] if best else address
    return (best or "self"), name


def _plain_dtype(leaf: Any) -> bool:
    try:
        np.dtype(leaf.dtype)
        return True
    except TypeError:  # extended dtypes (typed PRNG keys)
        return False


def _add_leaf(desc: Description, address: str, leaf: Any, is_param: bool, mods: list[tuple[str, Any]]) -> None:
    module, name = _owner(address, mods)
    shape = tuple(int(d) for d in leaf.shape)
    dtype = str(leaf.dtype)
    device = _device(leaf)
    if is_param:
        desc.info.params.append(ParamInfo(address, module, name, shape, dtype, True, leaf, device))
    else:
        desc.info.buffers.append(BufferInfo(address, module, name, shape, dtype, leaf, True, device))
    desc.leaves.append(leaf)
    desc.addresses.append(address)
    desc.is_param.append(is_param)


def _device(leaf: Any) -> str:
    try:
        return str(next(iter(leaf.devices())))
    except Exception:  # noqa: BLE001 - numpy leaves and tracers have no device
        return "cpu"


def _leaf_key(structure: Any, leaves: list[Any]) -> Hashable | None:
    key = (structure, tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves))
    try:
        hash(key)
    except TypeError:
        return None
    return key
