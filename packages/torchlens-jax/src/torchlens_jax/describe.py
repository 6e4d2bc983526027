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
    #: recorder -> context manager opening a module-call scope per call (flax.linen, whose
    #: bound submodules are clones made inside `apply`, so object identity cannot name them)
    scopes: Callable[[Any], Any] | None = None
    #: rebuilt model after its forward -> its state leaves (same order as `leaves`), or None
    #: when a forward cannot write state (equinox, functions: state is explicit there)
    state_after: Callable[[Any], list[Any] | None] | None = None
    #: flax.linen: (collection, key, ...) path of each variable -> its address (what an updated
    #: collection returned by `apply(..., mutable=...)` names)
    variable_address: dict[tuple[str, ...], str] = field(default_factory=dict)


#: (module, class name) of the jit wrappers whose `__wrapped__` is traced in their place.
_JIT_WRAPPERS = {("flax.nnx.transforms.compilation", "JitWrapped"), ("equinox._jit", "_JitWrapper")}


def unwrap_jit(model: Any) -> Any:
    """The callable under an `nnx.jit` or `eqx.filter_jit` wrapper (nested ones too), so its
    module tree and parameter names are traced; any other object unchanged. The capture
    steps into jitted code equation by equation anyway."""
    for _ in range(8):
        if (type(model).__module__, type(model).__name__) not in _JIT_WRAPPERS:
            return model
        inner = getattr(model, "__wrapped__", None)
        if inner is None or inner is model:
            return model
        model = inner
    return model


def model_kind(model: Any) -> str | None:
    """"nnx", "equinox", "function", or None when the object is not something we trace.
    Decided on the type's module name first, so no framework is imported to say no.
    An `nnx.jit` / `eqx.filter_jit` wrapper is the kind of what it wraps."""
    model = unwrap_jit(model)
    mro_modules = {c.__module__.split(".")[0] for c in type(model).__mro__}
    if _linen_apply_of(model) is not None:
        return "linen"
    if "flax" in mro_modules:
        from flax import nnx

        if isinstance(model, nnx.Module):
            return "nnx"
        import flax.linen as nn

        return "linen" if isinstance(model, nn.Module) else None
    if "equinox" in mro_modules:
        import equinox as eqx

        return "equinox" if isinstance(model, eqx.Module) else None
    if callable(model) and not isinstance(model, type):
        foreign = {"torch", "tensorflow", "keras", "paddle", "mlx", "tinygrad"}
        return None if mro_modules & foreign else "function"
    return None


def describe(model: Any, args: tuple = (), kwargs: dict | None = None) -> Description:
    model = unwrap_jit(model)
    if model_kind(model) == "linen":
        module, variables, args, kwargs = split_linen(model, args, kwargs or {})
        return describe_linen(module, variables, args, kwargs)
    kind = model_kind(model)
    if kind == "nnx":
        return _describe_nnx(model)
    if kind == "equinox":
        return _describe_equinox(model)
    return _describe_function(model)


# flax.linen --------------------------------------------------------------------------------

def _linen_apply_of(model: Any) -> Any:
    """The linen module when `model` is its bound `apply` method (`module.apply`), else None."""
    owner = getattr(model, "__self__", None)
    if owner is None or getattr(model, "__name__", None) != "apply":
        return None
    if "flax" not in {c.__module__.split(".")[0] for c in type(owner).__mro__}:
        return None
    import flax.linen as nn

    return owner if isinstance(owner, nn.Module) else None


def split_linen(model: Any, args: tuple, kwargs: dict) -> tuple[Any, Any, tuple, dict]:
    """(linen module, variables, call args, call kwargs) for `tl.trace(module.apply, variables, x)`
    or `tl.trace(module, x, input_kwargs={"variables": variables})`; refuses typed when the
    variables are missing or not a mapping of collections."""
    from torchlens.backends.sdk import InvalidArgumentError

    module = _linen_apply_of(model)
    if module is not None:
        if not args:
            raise InvalidArgumentError("linen_variables_missing", "module.apply was traced without its variables",
                                       remedy="tl.trace(module.apply, variables, x)")
        variables, args = args[0], tuple(args[1:])
    else:
        module = model
        if "variables" not in kwargs:
            raise InvalidArgumentError("linen_variables_missing",
                                       f"the flax.linen module {type(model).__name__} was traced without its variables",
                                       remedy="tl.trace(module, x, input_kwargs={'variables': variables}) or "
                                              "tl.trace(module.apply, variables, x)")
        kwargs = dict(kwargs)
        variables = kwargs.pop("variables")
    from collections.abc import Mapping

    if not isinstance(variables, Mapping) or not all(isinstance(v, Mapping) for v in variables.values()):
        raise InvalidArgumentError("linen_variables_missing",
                                   f"linen variables must be a mapping of collections, got {type(variables).__name__}",
                                   remedy="pass what module.init returned ({'params': {...}, ...})")
    return module, variables, args, kwargs


def describe_linen(module: Any, variables: Any, args: tuple, kwargs: dict) -> Description:
    """A linen module with its variables: parameters named by their pytree path in the
    `params` collection (`params['Dense_0']['kernel']` -> `Dense_0.kernel`), other
    collections (`batch_stats`, ...) buffers; module records are the submodules whose
    `__call__` runs (found by one abstract evaluation), addressed by their linen path."""
    import flax.linen as nn

    flat, treedef = jax.tree_util.tree_flatten_with_path(variables)
    found: list[tuple[str, Any]] = [("", module)]

    def note(next_fun: Any, a: Any, k: Any, context: Any) -> Any:
        if context.method_name == "__call__" and context.module.path:
            found.append((".".join(str(p) for p in context.module.path), context.module))
        return next_fun(*a, **k)

    with nn.intercept_methods(note):
        call_leaves, call_def = jax.tree_util.tree_flatten((args, kwargs))
        pos = [i for i, leaf in enumerate(call_leaves) if isinstance(leaf, (jax.Array, np.ndarray))]

        def run(v: Any, arrays: list[Any]) -> Any:
            full = list(call_leaves)
            for i, a in zip(pos, arrays):
                full[i] = a
            a, k = jax.tree_util.tree_unflatten(call_def, full)
            return module.apply(v, *a, **k)

        jax.eval_shape(run, variables, [call_leaves[i] for i in pos])
    mods = _preorder(found)
    info = _model_info(module, mods)

    def rebuild(leaves: list[Any]) -> Any:
        v = jax.tree_util.tree_unflatten(treedef, leaves)
        return lambda *a, **k: module.apply(v, *a, **k)

    desc = Description("linen", type(module).__name__, info, rebuild=rebuild, scopes=lambda rec: _linen_scopes(rec))
    names = [[_key_text(k) for k in path] for path, _ in flat]
    short = [".".join(n[1:]) for n in names]
    for (path, leaf), n, s in zip(flat, names, short):
        address = s if short.count(s) == 1 and s else ".".join(n)
        _add_leaf(desc, address, leaf, n[0] == "params", mods)
        desc.variable_address[tuple(n)] = address
    try:
        hash(module)
        desc.cache_key = _leaf_key(("linen", module, treedef), desc.leaves)  # the module itself: its config is in its hash
    except TypeError:
        desc.cache_key = None
    return desc


def _own_train_mode(m: Any) -> bool | None:
    """A module's own train mode where it states one: `training` (equinox/torch style),
    `deterministic=False` (dropout), `use_running_average=False` (batch norm); None when it
    states none."""
    v = getattr(m, "training", None)
    if isinstance(v, bool):
        return v
    for attr in ("deterministic", "use_running_average"):
        v = getattr(m, attr, None)
        if isinstance(v, bool):
            return not v
    return None


def _linen_scopes(recorder: Any) -> Any:
    import flax.linen as nn

    def open_scope(next_fun: Any, a: Any, k: Any, context: Any) -> Any:
        if context.method_name != "__call__":
            return next_fun(*a, **k)
        address = ".".join(str(p) for p in context.module.path) or "self"
        top = recorder.table.calls[recorder.stack[-1][0]][0] if recorder.stack else None
        if top == address:  # the root (opened by the capture) or a nested __call__ of one module
            return next_fun(*a, **k)
        with recorder.call(address, address):
            return next_fun(*a, **k)

    return nn.intercept_methods(open_scope)


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


def describe_function_params(fn: Any, args: tuple, kwargs: dict, param_args: Any) -> tuple[Description, tuple, dict]:
    """A plain function whose caller says which arguments hold its parameters
    (`param_args=(0,)` or `("params",)`: positional indices or keyword names; never guessed):
    every array leaf of those arguments is a parameter named by its pytree path
    (`params['Dense_0']['kernel']` -> `Dense_0.kernel`); the other arguments stay inputs.
    Returns the description and the remaining call args and kwargs."""
    from torchlens.backends.sdk import InvalidArgumentError

    spec = tuple(param_args) if isinstance(param_args, (tuple, list)) else (param_args,)
    bad = [p for p in spec if not ((type(p) is int and 0 <= p < len(args)) or (type(p) is str and p in kwargs))]
    if not spec or bad or len(set(spec)) != len(spec):
        raise InvalidArgumentError(
            "invalid_argument", f"param_args={param_args!r} does not name positional indices or keyword inputs of this call"
            + (f" ({bad[0]!r})" if bad else ""),
            remedy="param_args=(0,) for tl.trace(fn, params, x), or ('params',) with input_kwargs={'params': ...}",
            option="param_args")
    trees = [(p, args[p] if type(p) is int else kwargs[p]) for p in spec]
    name = getattr(fn, "__name__", None) or type(fn).__name__
    info = ModelInfo(name, modules=[ModuleInfo("self", name, getattr(fn, "__qualname__", name))])
    defs = []
    desc = Description("function", name, info, modules_of=lambda m: [])
    for p, tree in trees:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        defs.append((p, treedef, len(flat)))
        for path, leaf in flat:
            if not isinstance(leaf, (jax.Array, np.ndarray)):
                raise InvalidArgumentError("invalid_argument", f"param_args: the leaf {jax.tree_util.keystr(path)} of "
                                           f"argument {p!r} is a {type(leaf).__name__}, not an array",
                                           remedy="pass parameters as a pytree of arrays", option="param_args")
            address = ".".join(_key_text(k) for k in path) or (f"args{p}" if type(p) is int else str(p))
            if len(trees) > 1:
                address = (f"args{p}" if type(p) is int else str(p)) + ("." + address if path else "")
            _add_leaf(desc, address, leaf if isinstance(leaf, jax.Array) else jax.numpy.asarray(leaf), True, [])
    positions = sorted(p for p in spec if type(p) is int)
    rest_args = tuple(a for i, a in enumerate(args) if i not in positions)
    rest_kwargs = {k: v for k, v in kwargs.items() if k not in spec}

    def rebuild(leaves: list[Any]) -> Any:
        given, at = {}, 0
        for p, treedef, n in defs:
            given[p] = jax.tree_util.tree_unflatten(treedef, leaves[at:at + n])
            at += n

        def call(*a: Any, **k: Any) -> Any:
            full = list(a)
            for i in positions:
                full.insert(i, given[i])
            return fn(*full, **k, **{p: v for p, v in given.items() if type(p) is str})

        return call

    desc.rebuild = rebuild
    try:
        hash((fn, spec))
        desc.cache_key = _leaf_key(("function_params", fn, spec, tuple(d[1] for d in defs)), desc.leaves)
    except TypeError:
        desc.cache_key = None
    return desc, rest_args, rest_kwargs


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
    def state_after(m: Any) -> list[Any] | None:
        _, p_after, r_after = nnx.split(m, nnx.Param, ...)
        pl, pd = jax.tree_util.tree_flatten(p_after)
        rl, rd = jax.tree_util.tree_flatten(r_after)
        if pd != p_def or rd != r_def:
            return None  # the forward added or removed state: no leaf-by-leaf correspondence
        return [*pl, *rl]

    desc = Description("nnx", type(model).__name__, _model_info(model, mods), rebuild=rebuild, modules_of=modules_of,
                       state_after=state_after)
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

    containers: list[tuple[str, Any]] = []
    _eqx_walk(model, "", [], eqx.Module, containers)
    mods = _preorder(modules_of(model) + containers)  # a list/tuple/dict of modules is a record, like a ModuleList
    desc = Description("equinox", type(model).__name__, _model_info(model, mods), rebuild=rebuild, modules_of=modules_of)
    for pos in array_pos:
        path, leaf = flat[pos]
        address = ".".join(_key_text(k) for k in path)
        _add_leaf(desc, address, leaf, bool(np.issubdtype(np.dtype(leaf.dtype), np.inexact)) if _plain_dtype(leaf) else False, mods)
    non_arrays = tuple(statics[i] for i in range(len(statics)) if i not in set(array_pos))
    desc.cache_key = _leaf_key(("equinox", treedef, non_arrays), desc.leaves)
    return desc


def _eqx_walk(obj: Any, address: str, out: list, module_type: type, containers: list | None = None) -> bool:
    """Append (address, module) for every module under `obj`; with `containers`, also
    (address, container) for each list, tuple or dict that holds a module at some depth (its
    items' parent, as torch's `ModuleList`). True when `obj` holds a module."""
    if isinstance(obj, module_type):
        out.append((address, obj))
        for f in dataclasses.fields(obj):
            _eqx_walk(getattr(obj, f.name, None), _child(address, f.name), out, module_type, containers)
        return True
    items: list[tuple[str, Any]] = []
    if isinstance(obj, (list, tuple)):
        items = [(str(i), item) for i, item in enumerate(obj)]
    elif isinstance(obj, dict):
        items = [(str(k), item) for k, item in obj.items()]
    found = False
    for name, item in items:
        found = _eqx_walk(item, _child(address, name), out, module_type, containers) or found
    if found and containers is not None and address:
        containers.append((address, obj))
    return found


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
    """Module records in preorder. `training`: the module's own train mode (`training`,
    `deterministic`, `use_running_average`); a module stating none (a container) is in
    train mode when a module under it is (as after torch's `.train()` or nnx's `.train()`)."""
    info = ModelInfo(type(model).__name__)
    own = {addr: _own_train_mode(m) for addr, m in mods}
    for addr, m in mods:
        a = addr or "self"
        mode = own[addr]
        if mode is None:
            mode = any(own[b] for b in own if b != addr and (not addr or b.startswith(addr + ".")) and own[b])
        info.modules.append(ModuleInfo(a, type(m).__name__, type(m).__qualname__,
                                       parent=None if not addr else (_parent(addr) or "self"), training=bool(mode)))
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
