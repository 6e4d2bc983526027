"""Describe the model before the forward: module tree, parameters, buffers and the
identity maps the per-op handler uses (module, parameter and buffer objects by `id`).

Module-held plain tensors (a tensor attribute, a list/tuple item or a dict value, up to
four container levels, and public tensor attributes of plain objects a module holds) are
buffers too (spec: Parameter / Buffer, "Module-held tensors").

A repeated capture of an unchanged model reuses the walk (`describe_model`'s cache, per root
module, holding only weak references): a fingerprint of every described module's class,
training flag, submodule / parameter / buffer registrations (by identity, with each tensor's
shape, dtype, device and requires_grad) and tensor attributes is compared first. A model
whose modules hold containers or other objects (which can change in place), or whose classes
override `named_modules`, is walked afresh at every capture (remembered as such while it lives).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchlens.backends.sdk import BufferInfo, ModelInfo, ModuleInfo, ParamInfo

from torchlens_torch.values import dtype_name

#: Attributes every nn.Module carries for torch's own bookkeeping; never user state.
MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"_compiled_call_impl"}

_MAX_CONTAINER_DEPTH = 4
_SKIP_TYPES = (str, bytes, int, float, bool, type(None), nn.Module, torch.dtype, torch.device)


@dataclass
class ModelDescription:
    """What the capture knows about the model before the forward starts."""

    info: ModelInfo
    module_address: dict[int, str]  # id(module) -> canonical address
    modules: list[tuple[str, nn.Module]]  # canonical (address, module) pairs, root first
    param_address: dict[int, str]
    buffer_address: dict[int, str]
    held: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # module-held plain tensors
    # per cached walk (see `_Entry.scratch`): what later captures of the same, unchanged model
    # reuse (nothing that keeps the model alive); None for a model described afresh
    scratch: dict | None = None


def _escape_key(key: Any) -> str:
    return repr(key).replace("%", "%25").replace(".", "%2E").replace(":", "%3A")


def describe_model(root: nn.Module) -> ModelDescription:
    """The description of `root` and its identity maps: rebuilt from the cached walk when the
    model's fingerprint (see `_fingerprint`) is what it was, walked afresh otherwise."""
    entry = _CACHE.get(id(root))
    if entry is not None and entry.live and entry.root() is root:
        if entry.fingerprint is None:  # seen before holding what can change in place: walk afresh
            return _describe(root)
        mods = [r() for r in entry.module_refs]
        if None not in mods:
            fp = _safe_fingerprint(mods)
            if fp is not None and fp == entry.fingerprint:
                return entry.rebuild(mods)
    desc = _describe(root)
    _remember(root, desc)
    entry = _CACHE.get(id(root))
    if entry is not None and entry.fingerprint is not None:
        desc.scratch = entry.scratch
    return desc


class _Entry:
    """One root's cached walk: weak references to every described module, parameter, buffer
    and held tensor (any of them dying drops the entry, so the ids it keeps stay unique) and
    the fields of their info records.

    `scratch` is handed to every description rebuilt from this entry (`ModelDescription.scratch`):
    a capture keeps there what the next capture of the same model may reuse while the fingerprint
    holds: the parameter hash's inputs and result (`backend._param_hash_quick`) and the state
    snapshot's buffer copies (`state.ModelStateSnapshot`, small models only). Plain values and
    detached copies only: never the model's own tensors or anything else that keeps it alive."""

    __slots__ = ("root", "module_refs", "fingerprint", "module_rows", "module_infos", "param_rows", "buffer_rows", "held_count",
                 "module_address", "param_address", "buffer_address", "live", "scratch", "__weakref__")

    def rebuild(self, mods: list) -> ModelDescription:
        order = [(row[0], m) for row, m in zip(self.module_rows, mods)]
        # the ModuleInfo records hold plain values only (read only downstream): the cached walk's
        # serve again while each training flag is the one they hold (the fingerprint compared the
        # flags in the modules' `__dict__`; this reads them as the fresh walk does)
        modules = list(self.module_infos)
        if any(mi.training is not bool(m.training) for mi, m in zip(modules, mods)):
            modules = [ModuleInfo(a, c, q, None, aa, bool(m.training)) for (a, c, q, aa), m in zip(self.module_rows, mods)]
        params = [ParamInfo(a, o, n, s, d, t, r(), dv, al) for a, o, n, s, d, t, r, dv, al in self.param_rows]
        buffers = [BufferInfo(a, o, n, s, d, r(), pe, dv) for a, o, n, s, d, r, pe, dv in self.buffer_rows]
        held = [(b.address, b.value) for b in buffers[len(buffers) - self.held_count:]] if self.held_count else []
        return ModelDescription(ModelInfo(type(mods[0]).__name__, modules, params, buffers), self.module_address,
                                order, self.param_address, self.buffer_address, held, self.scratch)


#: id(root module) -> its cached walk (see `describe_model`)
_CACHE: dict[int, _Entry] = {}


def _drop(key: int, entry_ref: Any) -> None:
    entry = entry_ref()
    if entry is not None:
        entry.live = False
        if _CACHE.get(key) is entry:
            del _CACHE[key]


def _remember(root: nn.Module, desc: ModelDescription) -> None:
    """Cache `desc` for `root`, or, when no fingerprint can be taken, remember that it cannot."""
    key = id(root)
    _CACHE.pop(key, None)
    mods = [m for _, m in desc.modules]
    entry = _Entry()
    entry.live = True
    entry.scratch = {}
    callback = (lambda _r, key=key, e=weakref.ref(entry): _drop(key, e))
    # a class that walks its own way, or a model holding what can change in place: remembered
    # as such (a fingerprint of `None`), so its later captures walk it afresh without trying
    fp = None if any(type(m).named_modules is not _NAMED_MODULES for m in mods) else _safe_fingerprint(mods)
    entry.fingerprint = fp
    if fp is None:
        try:
            entry.root = weakref.ref(root, callback)
        except TypeError:
            return
        _CACHE[key] = entry
        return
    entry.module_address, entry.param_address, entry.buffer_address = (
        desc.module_address, desc.param_address, desc.buffer_address)
    entry.module_rows = [(mi.address, mi.class_name, mi.class_qualname, mi.all_addresses) for mi in desc.info.modules]
    entry.module_infos = tuple(desc.info.modules)
    try:
        entry.root = weakref.ref(root, callback)
        entry.module_refs = [weakref.ref(m, callback) for m in mods]
        entry.param_rows = [(p.address, p.module, p.name, p.shape, p.dtype, p.trainable, weakref.ref(p.value, callback),
                             p.device, p.aliases) for p in desc.info.params]
        entry.buffer_rows = [(b.address, b.module, b.name, b.shape, b.dtype, weakref.ref(b.value, callback),
                              b.persistent, b.device) for b in desc.info.buffers]
    except TypeError:  # something not weak-referenceable: no caching
        return
    entry.held_count = len(desc.held)
    _CACHE[key] = entry


_NAMED_MODULES = nn.Module.named_modules
_DEVICE_NAMES: dict[torch.device, str] = {}


def _device_name(device: torch.device) -> str:
    """`str(device)`, cached per device."""
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


def _safe_fingerprint(mods: list) -> list | None:
    """`_fingerprint`, None where taking it raises (an unusual module: described afresh)."""
    try:
        return _fingerprint(mods)
    except Exception:  # noqa: BLE001 - the cache is an optimisation: any failure means "walk afresh"
        return None


class KeyPlans(dict):
    """A module `__dict__`'s keys (in order) -> those not in `skip`, in the same order: each key
    set is filtered once (`plans[tuple(d)]`; at most 4,096 key sets are kept)."""

    MAX = 4096

    def __init__(self, skip: Any) -> None:
        super().__init__()
        self.skip = frozenset(skip)

    def __missing__(self, keys: tuple) -> tuple:
        if len(self) >= self.MAX:
            self.clear()
        plan = self[keys] = tuple(k for k in keys if k not in self.skip)
        return plan


#: the keys that are not torch's bookkeeping (`MODULE_INTERNALS`)
_PLANS = KeyPlans(MODULE_INTERNALS)


def _fingerprint(mods: list) -> list | None:
    """What the description depends on, module by module (identities as ids: the entry's weak
    references keep them unique while it lives), or None when a module holds a value that can
    change in place (a container, a plain object): such a model is described afresh."""
    fp: list = []
    app, ext = fp.append, fp.extend
    leaf, tensor, plans = _LEAF_TYPES, torch.Tensor, _PLANS
    for m in mods:
        app(type(m))
        d = m.__dict__
        app(d.get("training"))
        sub, ps, bs = m._modules, m._parameters, m._buffers
        if type(sub) is not dict or type(ps) is not dict or type(bs) is not dict:
            return None  # TorchScript's registries and the like: described afresh
        app(len(sub))
        ext(sub)
        ext(map(id, sub.values()))
        app(len(ps))
        for k, p in ps.items():
            app(k)
            if p is None:
                app(None)
            else:
                ext((id(p), p.shape, p.dtype, p.device, p.requires_grad))
        app(len(bs))
        for k, b in bs.items():
            app(k)
            if b is None:
                app(None)
            else:
                ext((id(b), b.shape, b.dtype, b.device))
        np_set = m._non_persistent_buffers_set
        if np_set:
            app(sorted(np_set))
        for k in plans[tuple(d)]:
            v = d[k]
            if type(v) in leaf:
                continue
            if isinstance(v, tensor):
                ext((k, id(v), v.shape, v.dtype, v.device))
            elif isinstance(v, _SKIP_TYPES) or isinstance(v, type):
                continue  # holds no tensor the description lists
            elif type(v) is tuple and leaf.issuperset(map(type, v)):
                continue  # a Conv2d's `kernel_size`: immutable, no tensor
            else:
                return None
        app(None)
    return fp


def _describe(root: nn.Module) -> ModelDescription:
    """Walk `root` once and build the description and the identity maps."""
    all_addrs: dict[int, list[str]] = {}
    order: list[tuple[str, nn.Module]] = []
    walk = list(root.named_modules(remove_duplicate=False))
    for name, mod in walk:
        addr = name or "self"
        lst = all_addrs.get(id(mod))
        if lst is None:
            all_addrs[id(mod)] = [addr]
            order.append((addr, mod))
        else:
            lst.append(addr)
    module_address = {id(m): a for a, m in order}
    modules = [ModuleInfo(a, type(m).__name__, type(m).__qualname__, None, tuple(all_addrs[id(m)]), bool(m.training))
               for a, m in order]

    # one walk instead of two `named_parameters` walks: every module path of each parameter
    # (a tie has several), then the parameters in `named_parameters()` order (first module
    # occurrence, first path)
    params: list[ParamInfo] = []
    param_address: dict[int, str] = {}
    paths: dict[int, list[str]] = {}
    for name, mod in walk:
        prefix = name + "." if name else ""
        for pname, p in mod._parameters.items():
            if p is not None:
                paths.setdefault(id(p), []).append(prefix + pname)
    for addr, mod in order:
        prefix = "" if addr == "self" else addr + "."
        for pname, p in mod._parameters.items():
            if p is None or id(p) in param_address:
                continue
            name = prefix + pname
            param_address[id(p)] = name
            params.append(ParamInfo(name, addr, pname, tuple(p.shape), dtype_name(p.dtype), bool(p.requires_grad),
                                    p, _device_name(p.device), tuple(a for a in paths[id(p)] if a != name)))

    buffers: list[BufferInfo] = []
    buffer_address: dict[int, str] = {}
    for addr, mod in order:
        prefix = "" if addr == "self" else addr + "."
        nonpersistent = mod._non_persistent_buffers_set
        for bname, b in mod._buffers.items():
            if b is None or id(b) in buffer_address:
                continue
            full = prefix + bname
            buffer_address[id(b)] = full
            buffers.append(BufferInfo(full, addr, bname, tuple(b.shape), dtype_name(b.dtype), b,
                                      bname not in nonpersistent, _device_name(b.device)))

    held: list[tuple[str, torch.Tensor]] = []
    no_tensors: set[int] = set()  # plain objects already seen to hold no tensor
    for addr, mod in order:
        prefix = "" if addr == "self" else addr + "."
        # (most attributes are scalars: filtered here, without a call each)
        for attr, value in [(a, v) for a, v in mod.__dict__.items() if type(v) not in _LEAF_TYPES]:
            if attr in MODULE_INTERNALS:
                continue
            _collect_held(prefix + attr, value, 0, held, param_address, buffer_address, no_tensors)
    for full, t in held:
        owner, _, name = full.rpartition(".")
        buffer_address[id(t)] = full
        buffers.append(BufferInfo(full, owner or "self", name, tuple(t.shape), dtype_name(t.dtype), t, False,
                                  _device_name(t.device)))

    info = ModelInfo(type(root).__name__, modules, params, buffers)
    return ModelDescription(info, module_address, order, param_address, buffer_address, held)


_LEAF_TYPES = frozenset({str, bytes, int, float, bool, type(None), torch.dtype, torch.device})
_SEQUENCES = frozenset({tuple, list})


def _collect_held(address: str, value: Any, depth: int, out: list, params: dict, buffers: dict, no_tensors: set) -> None:
    if type(value) in _LEAF_TYPES:
        return  # most module attributes
    if isinstance(value, torch.Tensor):
        if id(value) not in params and id(value) not in buffers and not any(value is t for _, t in out):
            out.append((address, value))
        return
    if depth >= _MAX_CONTAINER_DEPTH or isinstance(value, _SKIP_TYPES):
        return
    if type(value) in _SEQUENCES and _LEAF_TYPES.issuperset(map(type, value)):
        return  # a Conv2d's `kernel_size`, `_reversed_padding_repeated_twice`: nothing to walk
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            sub = f"{address}.{i}" if depth == 0 else f"{address}[{i}]"
            _collect_held(sub, item, depth + 1, out, params, buffers, no_tensors)
    elif isinstance(value, dict):
        seen: dict[str, int] = {}
        for key, item in value.items():
            text = _escape_key(key)
            n = seen.get(text, 0) + 1
            seen[text] = n
            sub = f"{address}[{text}]" if n == 1 else f"{address}[{text}#{n}]"
            _collect_held(sub, item, depth + 1, out, params, buffers, no_tensors)
    elif depth == 0 and hasattr(value, "__dict__") and not isinstance(value, type) and id(value) not in no_tensors:
        # a plain object held by the module: only its own public tensor attributes
        found = False
        try:
            attrs = vars(value)
        except TypeError:
            return
        for name, item in attrs.items():
            if not name.startswith("_") and isinstance(item, torch.Tensor):
                found = True
                if id(item) not in params and id(item) not in buffers:
                    out.append((f"{address}[{name}]", item))
        if not found:
            no_tensors.add(id(value))
