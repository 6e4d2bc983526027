"""Describe the model before the forward: module tree, parameters, buffers and the
identity maps the per-op handler uses (module, parameter and buffer objects by `id`).

Module-held plain tensors (a tensor attribute, a list/tuple item or a dict value, up to
four container levels, and public tensor attributes of plain objects a module holds) are
buffers too (spec: Parameter / Buffer, "Module-held tensors").

A repeated capture of an unchanged model reuses the walk (`describe_model`'s cache, per root
module, holding only weak references): a fingerprint of every described module's class,
training flag, submodule / parameter / buffer registrations (by identity, with each tensor's
shape, dtype, device and requires_grad) and tensor attributes is compared first; a container
or plain object a module holds (which can change in place: a Hugging Face config, a dict) counts
by the tensors the description's walk finds in it, walked again for every fingerprint. Before
the fingerprint, a cheaper column-wise test (`_Quick`) that it still holds is tried. A model whose
classes override `named_modules` (or whose registries are not plain dicts) is walked afresh at
every capture (remembered as such while it lives).
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from itertools import chain
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
        if entry.fingerprint is None:  # seen before as one that cannot be fingerprinted: walk afresh
            return _describe(root)
        mods = [r() for r in entry.module_refs]
        if None not in mods:
            quick = entry.quick
            facts = quick.unchanged(mods) if quick is not None else None
            if facts is not None:
                desc = entry.rebuild(mods, flags_checked=True)
                desc.modules.facts = facts
                return desc
            fp = _safe_fingerprint(mods)
            if fp is not None and fp == entry.fingerprint:
                entry.quick = _Quick.take(mods)
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
                 "module_address", "param_address", "buffer_address", "live", "scratch", "quick", "__weakref__")

    def rebuild(self, mods: list, flags_checked: bool = False) -> ModelDescription:
        """`flags_checked`: the training flags are known to be the cached walk's (the quick test
        compared them with the ones it took under a fingerprint that held)."""
        order = _ModuleList([(row[0], m) for row, m in zip(self.module_rows, mods)])
        order.facts = None
        # the ModuleInfo records hold plain values only (read only downstream): the cached walk's
        # serve again while each training flag is the one they hold (the fingerprint compared the
        # flags in the modules' `__dict__`; this reads them as the fresh walk does)
        modules = list(self.module_infos)
        if not flags_checked and any(mi.training is not bool(m.training) for mi, m in zip(modules, mods)):
            modules = [ModuleInfo(a, c, q, None, aa, bool(m.training)) for (a, c, q, aa), m in zip(self.module_rows, mods)]
        # (column by column: the records made by one C-level `map` over the cached fields, each
        # weak reference called for its tensor)
        a, o, n, s, d, t, r, dv, al = self.param_rows
        params = list(map(ParamInfo, a, o, n, s, d, t, map(_call, r), dv, al))
        a, o, n, s, d, r, pe, dv = self.buffer_rows
        buffers = list(map(BufferInfo, a, o, n, s, d, map(_call, r), pe, dv))
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
    entry.quick = None
    entry.scratch = {}
    callback = (lambda _r, key=key, e=weakref.ref(entry): _drop(key, e))
    # a class that walks its own way, or registries that are not plain dicts: remembered as
    # such (a fingerprint of `None`), so its later captures walk it afresh without trying
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
        # (as columns: field -> one list over the parameters / buffers)
        entry.param_rows = _columns([(p.address, p.module, p.name, p.shape, p.dtype, p.trainable,
                                      weakref.ref(p.value, callback), p.device, p.aliases) for p in desc.info.params], 9)
        entry.buffer_rows = _columns([(b.address, b.module, b.name, b.shape, b.dtype, weakref.ref(b.value, callback),
                                       b.persistent, b.device) for b in desc.info.buffers], 8)
    except TypeError:  # something not weak-referenceable: no caching
        return
    entry.held_count = len(desc.held)
    entry.quick = _Quick.take(mods)
    _CACHE[key] = entry


def _columns(rows: list[tuple], width: int) -> list[list]:
    """Rows of `width` fields -> `width` lists (one per field)."""
    return [list(col) for col in zip(*rows)] if rows else [[] for _ in range(width)]


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


_DICT = operator.attrgetter("__dict__")
#: `operator.call` (Python 3.11+), for `map(_call, functions, arguments)`
_call = getattr(operator, "call", None) or (lambda f, x: f(x))
_META = operator.attrgetter("shape", "dtype", "device", "requires_grad")
#: what `_Quick` reads from each module's `__dict__` before its own attributes (`USER_PLANS`)
QUICK_KEYS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
#: a module `__dict__`'s keys -> its own attributes: all but torch's bookkeeping, the training flag
#: included (what the state snapshot keeps, and `_Quick` reads after `QUICK_KEYS`)
USER_PLANS = KeyPlans(MODULE_INTERNALS - {"training"})


def _picker(positions: list[int]) -> Any:
    """A function returning the items of a sequence at `positions`, as a tuple (any length)."""
    if not positions:
        return lambda _s: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda s: (s[i],)
    return operator.itemgetter(*positions)


class Facts:
    """What `_Quick.unchanged` read of the model at this capture, handed to the state snapshot
    (`ModelDescription.modules.facts`) so it does not read the same again: each module's
    `__dict__` (`dicts`), its keys (`keys`, as the quick test's), the getters (`QUICK_KEYS`,
    then `USER_PLANS` of the keys) and their values per module (`rows`) and flat (`flat`), the
    registries (three per module: `_parameters`, `_buffers`, `_modules`), their sizes, their keys
    and their values (flat), and the `_Quick` that checked them (`quick`: whatever a state
    snapshot classified under the same `_Quick` still holds)."""

    __slots__ = ("quick", "dicts", "keys", "getters", "user_plans", "rows", "flat", "regs", "reg_lens", "reg_keys",
                 "reg_values")


class _ModuleList(list):
    """`ModelDescription.modules` of a description rebuilt from the cache: a list, with the
    `Facts` the quick test read (for the state snapshot of the same capture; None once used)."""

    __slots__ = ("facts",)


class _Quick:
    """A cheaper test than `_fingerprint` that the fingerprint still holds, taken when it did:
    every module's class, `__dict__` keys (in order) and training flag; the type of every
    attribute `_fingerprint` reads (the registries, the non-persistent buffer names and the
    module's own attributes); the identity of each tensor attribute and of each tuple; the
    registries' sizes, keys and entries (by identity) and the non-persistent buffer names; every
    tensor's shape, dtype, device and requires_grad. Read column by column over the whole model
    (C-level `map`s, no Python loop per module); any difference (a tuple merely rebound too) or
    any error means "take the fingerprint". Ids are safe to compare: modules, parameters,
    buffers and tensor attributes are held by the entry's weak references (one dying drops the
    entry) and the tuples are held here (`hold`: scalars only, since the fingerprint held, so
    they keep nothing alive). A scalar attribute counts by its type alone (all the fingerprint
    reads of it); a value that can change in place (a container, a plain object) by its type and
    the tensors the description's walk finds in it (`_held_signature`, as the fingerprint)."""

    __slots__ = ("types", "keys", "getters", "user_plans", "regs", "full", "sets", "training", "reg_tensors",
                 "attr_tensors", "tuples", "hold", "walked", "walked_keys", "state")

    @classmethod
    def take(cls, mods: list) -> "_Quick | None":
        try:
            q = cls()
            q.types = list(map(type, mods))
            dicts = list(map(_DICT, mods))
            q.keys = list(map(tuple, dicts))
            q.user_plans = [USER_PLANS[k] for k in q.keys]
            q.getters = [operator.itemgetter(*QUICK_KEYS, *plan) for plan in q.user_plans]
            flat = list(chain.from_iterable(map(_call, q.getters, dicts)))
            n, width = 0, len(QUICK_KEYS)
            regs, sets, training, attr_tensors, tuples, walked = [], [], [], [], [], []
            q.walked_keys = []
            for plan in q.user_plans:
                regs.extend((n, n + 1, n + 2))
                sets.append(n + 3)
                training.append(n + width + plan.index("training"))
                for i, k in enumerate(plan, n + width):
                    v = flat[i]
                    if isinstance(v, torch.Tensor):
                        attr_tensors.append(i)
                    elif type(v) is tuple and _LEAF_TYPES.issuperset(map(type, v)):
                        tuples.append(i)
                    elif _walked(v):
                        walked.append(i)
                        q.walked_keys.append(k)
                n += width + len(plan)
            q.regs, q.sets, q.training = _picker(regs), _picker(sets), _picker(training)
            q.attr_tensors, q.tuples, q.walked = _picker(attr_tensors), _picker(tuples), _picker(walked)
            all_regs = q.regs(flat)
            q.full = _picker([i for i, r in enumerate(all_regs) if r])  # the registries not empty
            reg_tensors, n = [], 0
            for r in q.full(all_regs):
                for v in r.values():
                    if isinstance(v, torch.Tensor):
                        reg_tensors.append(n)
                    n += 1
            q.reg_tensors = _picker(reg_tensors)
            q.hold = q.tuples(flat)
            q.state = q._state(flat)[0]
        except Exception:  # noqa: BLE001 - an unusual module: the fingerprint alone
            return None
        return q

    def _state(self, flat: list) -> tuple:
        """(what is compared, and the registries, their sizes, keys and values for `Facts`)"""
        regs = self.regs(flat)
        full = self.full(regs)
        reg_vals = list(chain.from_iterable(map(dict.values, full)))
        lens = list(map(len, regs))
        keys = list(chain.from_iterable(full))
        return ((list(map(type, flat)), self.training(flat), lens, keys, list(map(id, reg_vals)),
                 tuple(map(frozenset, self.sets(flat))), list(map(_META, self.reg_tensors(reg_vals))),
                 list(map(id, self.attr_tensors(flat))), list(map(_META, self.attr_tensors(flat))),
                self._signatures(flat)), regs, lens, keys, reg_vals)

    def _signatures(self, flat: list) -> tuple:
        """`_held_signature` of each value that can change in place (containers, plain objects)."""
        values = self.walked(flat)
        if not values:
            return ()
        no_tensors: set = set()
        return tuple(_held_signature(k, v, no_tensors) for k, v in zip(self.walked_keys, values))

    def unchanged(self, mods: list) -> Facts | None:
        """The `Facts` of this capture when the fingerprint is sure to hold, else None."""
        try:
            if list(map(type, mods)) != self.types:
                return None
            dicts = list(map(_DICT, mods))
            keys = list(map(tuple, dicts))
            if keys != self.keys:
                return None
            rows = list(map(_call, self.getters, dicts))
            flat = list(chain.from_iterable(rows))
            if not all(map(operator.is_, self.tuples(flat), self.hold)):
                return None
            state, regs, lens, reg_keys, reg_vals = self._state(flat)
            if state != self.state:
                return None
        except Exception:  # noqa: BLE001 - take the fingerprint
            return None
        f = Facts()
        f.quick, f.dicts, f.keys, f.getters, f.user_plans, f.rows, f.flat = (
            self, dicts, keys, self.getters, self.user_plans, rows, flat)
        f.regs, f.reg_lens, f.reg_keys, f.reg_values = regs, lens, reg_keys, reg_vals
        return f


def _held_signature(address: str, value: Any, no_tensors: set) -> tuple:
    """The module-held tensors the description finds in one attribute value that can change in
    place (a builtin container, a plain object): `_collect_held`'s own walk of it, as (address,
    identity, shape, dtype, device) of each tensor found (parameters and buffers included)."""
    t = type(value)
    if t is set or t is frozenset or id(value) in no_tensors:
        return ()  # (the walk does not enter sets; a plain object already found holding no tensor)
    out: list = []
    _collect_held(address, value, 0, out, _NO_IDS, _NO_IDS, no_tensors)
    return tuple((a, id(t), t.shape, t.dtype, t.device) for a, t in out)


_NO_IDS: dict = {}  # (read only)


def _walked(v: Any) -> bool:
    """Whether `_fingerprint` reads an attribute value through `_held_signature` (it can change
    in place and hold tensors the description lists): not a scalar, tensor, module, dtype,
    device, class or tuple of scalars."""
    return not (type(v) in _LEAF_TYPES or isinstance(v, torch.Tensor) or isinstance(v, _SKIP_TYPES)
                or isinstance(v, type) or (type(v) is tuple and _LEAF_TYPES.issuperset(map(type, v))))


def _fingerprint(mods: list) -> list | None:
    """What the description depends on, module by module (identities as ids: the entry's weak
    references keep them unique while it lives). A value that can change in place (a builtin
    container, a plain object such as a Hugging Face config) counts by the tensors the
    description's walk finds in it (`_held_signature`), read again at every fingerprint. None
    for a module whose registries are not plain dicts (TorchScript): described afresh."""
    fp: list = []
    app, ext = fp.append, fp.extend
    leaf, tensor, plans = _LEAF_TYPES, torch.Tensor, _PLANS
    no_tensors: set = set()  # plain objects already seen to hold no tensor (one config, many modules)
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
                ext((k, type(v), _held_signature(k, v, no_tensors)))
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
