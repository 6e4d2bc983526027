"""Pure-observer capture: snapshot the model's state before the forward, restore it after.

Restored (spec: carry_state): registered buffers (written back only where the forward
changed them: rebound, or their bytes changed), every module's training flag,
plain module attributes (rebound, added and removed ones; builtin containers changed in
place; module-held tensors), the module's `_parameters` / `_buffers` / `_modules` entries,
parameter values written in place (`ParamWriteGuard`), and the global random streams (torch
CPU and live CUDA devices, Python `random`, NumPy).
Under `carry_state=True` only the random streams are restored.
"""

from __future__ import annotations

import operator
import random
import sys
from itertools import chain
from typing import Any

import torch
from torch import nn

from torchlens_torch.describe import MODULE_INTERNALS, QUICK_KEYS, USER_PLANS, _picker

_MISSING = object()
_BUILTIN_CONTAINERS = (list, dict, set, tuple)
_MAX_DEPTH = 256


class RngSnapshot:
    """The global random streams at one moment.

    NumPy's global stream is read with `np.random.get_state()` and put back with `set_state`
    only when it moved: its Mersenne Twister words and position are compared as raw bytes
    (`_np_raw`, about 1 µs against about 80 µs for `set_state`). The legacy stream's cached
    second normal draw sits outside those bytes, so the comparison is trusted only when no
    draw was cached at the snapshot (then any draw moves the words); otherwise it is always
    put back."""

    def __init__(self) -> None:
        self.torch = torch.get_rng_state()
        self.cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.cuda = torch.cuda.get_rng_state_all()
        self.python = random.getstate()
        np = sys.modules.get("numpy")
        self.numpy = np.random.get_state() if np is not None else None
        # (the legacy tuple: (name, words, pos, has_gauss, gauss); a dict for another bit generator)
        legacy = type(self.numpy) is tuple and len(self.numpy) == 5 and self.numpy[0] == "MT19937"
        self.numpy_raw = _np_raw(np) if legacy and not self.numpy[3] else None

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            np = sys.modules["numpy"]
            if self.numpy_raw is None or _np_raw(np) != self.numpy_raw:
                np.random.set_state(self.numpy)


#: [bit generator, address of its Mersenne Twister state] of NumPy's global RandomState, once
#: checked (None: the raw comparison is not available, always `set_state`)
_NP_STATE: list = []
_MT_BYTES = 624 * 4 + 4  # uint32 key[624]; int pos


def _np_raw(np: Any) -> bytes | None:
    """The raw bytes of NumPy's global Mersenne Twister state (words and position), or None
    where they cannot be read as such. The address is taken once per bit generator and checked
    then against the generator's own `state` (words and position decoded from the bytes)."""
    import ctypes

    try:  # the RandomState that `np.random.get_state` / `set_state` (and `np.random.rand`, ...) are bound to
        bg = np.random.get_state.__self__._bit_generator
    except AttributeError:
        return None
    if not _NP_STATE or _NP_STATE[0] is not bg:
        _NP_STATE[:] = [bg, None]
        try:
            addr = bg.ctypes.state_address
            raw = ctypes.string_at(addr, _MT_BYTES)
            st = bg.state
            key = np.frombuffer(raw[:-4], dtype=np.uint32)
            if (st.get("bit_generator") == "MT19937" and np.array_equal(key, st["state"]["key"])
                    and int.from_bytes(raw[-4:], sys.byteorder, signed=True) == st["state"]["pos"]):
                _NP_STATE[1] = addr
        except Exception:  # noqa: BLE001 - any surprise: no raw comparison
            pass
    addr = _NP_STATE[1]
    return None if addr is None else ctypes.string_at(addr, _MT_BYTES)


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % (2**32))


class _TensorSnap:
    __slots__ = ("tensor", "clone", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.clone, self.version = t, t.detach().clone(), t._version


_ATOMS = (int, float, str, bool, type(None))
_ATOM_TYPES = frozenset(_ATOMS)
_MUTABLE = frozenset((list, dict, set))
#: Buffer copies up to this many bytes in all are kept for the next capture of the same model
_KEEP_COPIES_BYTES = 8 << 20
#: The container snapshots of a module holding none (shared, read only)
_EMPTY: dict = {}
#: Attribute types that hold no tensor (`reach_plan` leaves them out)
_NO_TENSOR_TYPES = frozenset((bytes, torch.dtype, torch.device, torch.Size, type))
#: `__dict__` keys the snapshot skips: torch's bookkeeping (the training flag is user state)
_SNAPSHOT_SKIP = MODULE_INTERNALS - {"training"}
#: a module `__dict__`'s keys -> those the snapshot keeps (all but `_SNAPSHOT_SKIP`; the same
#: filter as the description's quick test, whose reading the snapshot takes over: `describe.Facts`)
_PLANS = USER_PLANS


def _snap_container(value: Any, depth: int = 0) -> Any:
    """A deep copy of builtin containers, tensors inside cloned; other objects by identity."""
    if isinstance(value, torch.Tensor):
        return _TensorSnap(value)
    if depth >= _MAX_DEPTH or type(value) not in (list, dict, set, tuple):
        return value
    if type(value) is dict:
        return {k: _snap_container(v, depth + 1) for k, v in value.items()}
    if type(value) is set:
        return set(value)
    return type(value)(_snap_container(v, depth + 1) for v in value)


def _rebuild(snap: Any) -> Any:
    if type(snap) is _TensorSnap:
        t, clone = snap.tensor, snap.clone
        _write_back(t, clone)
        return t
    if type(snap) is dict:
        return {k: _rebuild(v) for k, v in snap.items()}
    if type(snap) is list:
        return [_rebuild(v) for v in snap]
    if type(snap) is tuple:
        return tuple(_rebuild(v) for v in snap)
    return snap


def _restore_in_place(current: Any, snap: Any) -> Any:
    """Put a builtin container back to its snapshot without rebinding it."""
    rebuilt = _rebuild(snap)
    if type(current) is list:
        current[:] = rebuilt
    elif type(current) is dict:
        current.clear()
        current.update(rebuilt)
    elif type(current) is set:
        current.clear()
        current.update(rebuilt)
    return current


_DICT = operator.attrgetter("__dict__")
#: `operator.call` (Python 3.11+), for `map(_call, functions, arguments)`
_call = getattr(operator, "call", None) or (lambda f, x: f(x))
#: a module `__dict__` -> its registries (the order of `ModelStateSnapshot.regs`, three per module)
_REGISTRIES = operator.itemgetter("_parameters", "_buffers", "_modules")
_META = operator.attrgetter("shape", "dtype", "device")


class _Getters(dict):
    """A module `__dict__`'s keys (in order) -> (the snapshot's keys: all but `_SNAPSHOT_SKIP`,
    a function reading their values from the `__dict__` as one tuple); at most 4,096 key sets."""

    MAX = 4096

    def __missing__(self, keys: tuple) -> tuple:
        if len(self) >= self.MAX:
            self.clear()
        plan = _PLANS[keys]
        if not plan:
            get = _no_values
        elif len(plan) == 1:
            get = (lambda d, _g=operator.itemgetter(plan[0]): (_g(d),))
        else:
            get = operator.itemgetter(*plan)
        got = self[keys] = (plan, get)
        return got


def _no_values(_d: dict) -> tuple:
    return ()


_GETTERS = _Getters()


def _classify(row: tuple) -> tuple[tuple, tuple]:
    """Positions in one module's attribute values of (the values snapshotted as containers:
    builtin containers, tensors, tuples holding more than scalars; the values that can hold a
    tensor: those, and other objects but `_NO_TENSOR_TYPES`). Most attributes are scalars."""
    atoms = _ATOM_TYPES
    containers: list[int] = []
    reach: list[int] = []
    for i, v in enumerate(row):
        t = type(v)
        if t in atoms:
            continue
        if t is tuple:
            if atoms.issuperset(map(type, v)):  # a Conv2d's `kernel_size`: cannot change in place
                continue
        elif t not in _MUTABLE and not isinstance(v, torch.Tensor):
            if t not in _NO_TENSOR_TYPES:
                reach.append(i)
            continue  # other objects: tracked by identity only
        reach.append(i)
        containers.append(i)
    return tuple(containers), tuple(reach)


_AFTER_QUICK_KEYS = operator.itemgetter(slice(len(QUICK_KEYS), None))


class _Classes:
    """`_classify` of every module of one model, kept in the description's scratch: it holds
    for a later capture whose attribute keys, value types and tuples (by identity: `hold`, tuples
    of scalars only, which keep nothing alive) are the ones it was taken from."""

    __slots__ = ("keys", "types", "tuples", "hold", "per_module", "any", "quick")

    def __init__(self, keys: list, rows: list, flat: list) -> None:
        self.keys = keys
        self.quick = None  # the description's quick test under which these still hold
        self.types = list(map(type, flat))
        self.per_module = [_classify(r) for r in rows]
        self.any = any(c or r for c, r in self.per_module)
        pos = [i for i, v in enumerate(flat) if type(v) is tuple]
        self.tuples = _picker(pos)
        self.hold = self.tuples(flat)

    def cacheable(self) -> bool:
        atoms = _ATOM_TYPES
        return all(atoms.issuperset(map(type, t)) for t in self.hold)

    def holds(self, keys: list, flat: list) -> bool:
        return (keys == self.keys and list(map(type, flat)) == self.types
                and all(map(operator.is_, self.tuples(flat), self.hold)))


class ModelStateSnapshot:
    """Everything a default (pure-observer) capture puts back after the forward.

    Per module: its `__dict__` keys (in order), the values of its own attributes (all keys but
    torch's bookkeeping, `_SNAPSHOT_SKIP`) as one tuple read in C, snapshots of the values that
    can change in place (builtin containers, tensors) and its registries' entries. The model-wide
    questions after the forward ("did it add, remove or rebind any attribute?", "any registry
    entry?", "any buffer's bytes?") are each answered in one pass over the whole model; only a
    module the forward touched is handled on its own."""

    def __init__(self, modules: list[tuple[str, nn.Module]], scratch: dict | None = None) -> None:
        mods = self.mods = [m for _, m in modules]
        # what the description's quick test read of the model at this capture (a description
        # rebuilt from the cache): the same values, not read again
        facts = getattr(modules, "facts", None) if scratch is not None else None
        if facts is not None:
            modules.facts = None
            keys = self.keys = facts.keys
            self.getters, self.plans = facts.getters, facts.user_plans
            self.rows_full, self.flat = facts.rows, facts.flat  # (`QUICK_KEYS`' values first)
            rows = self.rows = list(map(_AFTER_QUICK_KEYS, facts.rows))
        else:
            dicts = list(map(_DICT, mods))
            keys = self.keys = list(map(tuple, dicts))
            plans_getters = list(map(_GETTERS.__getitem__, keys))
            self.plans = [pg[0] for pg in plans_getters]
            self.getters = [pg[1] for pg in plans_getters]
            rows = self.rows = self.rows_full = list(map(_call, self.getters, dicts))
            self.flat = list(chain.from_iterable(rows))
        # which values are containers / can hold a tensor: the last capture's answer while the keys,
        # the value types and the tuples are the same (a model described from the cache; under the
        # same quick test, which checked exactly that)
        classes = scratch.get("snapshot_classes") if scratch is not None else None
        if classes is None or facts is None or classes.quick is not facts.quick:
            flat = self.flat if facts is None else list(chain.from_iterable(rows))
            if classes is None or not classes.holds(keys, flat):
                classes = _Classes(keys, rows, flat)
                if scratch is not None and classes.cacheable():
                    scratch["snapshot_classes"] = classes
            classes.quick = facts.quick if facts is not None else None
        per_module = classes.per_module
        self.containers: list[dict] = [_EMPTY] * len(mods)  # per module: attribute -> snapshot
        self.reach: list[tuple] = [()] * len(mods)  # per module: the values that can hold a tensor (`reach_plan`)
        if classes.any:
            for i, (row, plan, (cidx, ridx)) in enumerate(zip(rows, self.plans, per_module)):
                if cidx:
                    self.containers[i] = {plan[j]: _snap_container(row[j]) for j in cidx}
                if ridx:
                    self.reach[i] = tuple(row[j] for j in ridx)
        self._flags: list[bool] | None = None  # `_untouched` per module, once the forward is over
        # registrations: each module's `_parameters`, `_buffers`, `_modules` (the objects and copies)
        if facts is not None:
            regs = self.regs = facts.regs
            self.reg_lens, self.reg_keys, self.reg_values = facts.reg_lens, facts.reg_keys, facts.reg_values
        else:
            regs = self.regs = list(chain.from_iterable(map(_REGISTRIES, dicts)))
            self.reg_lens = list(map(len, regs))
            self.reg_keys = list(chain.from_iterable(regs))
            self.reg_values = list(chain.from_iterable(map(dict.values, regs)))
        # (the registries' entries at the snapshot are `reg_keys` / `reg_values` cut by `reg_lens`:
        # `reg_copies` rebuilds the dicts only when a registration was changed)
        self.quick_keys = facts is not None  # (the untouched test then covers the registries' identity)
        # every registered buffer (once per registration), a copy and its version counter now.
        # One clone per buffer: measured cheaper than one `torch.cat` (or `torch._foreach_*`) per
        # dtype, whose per-tensor detach/reshape views cost more than the clones they replace.
        # A repeated capture of an unchanged model (`scratch`: the cached description's, whose
        # fingerprint has just checked every buffer's identity, shape, dtype and device) copies
        # into the previous capture's copies instead, with one `torch._foreach_copy_` (see `restore`).
        bufs = [b for b in chain.from_iterable(map(dict.values, regs[1::3])) if b is not None]
        self._scratch = scratch
        copies = scratch.pop("buffer_copies", None) if scratch is not None else None
        reused = False
        with torch.no_grad():  # (a copy made here records no graph: the same as detach().clone())
            if copies is not None and len(copies) == len(bufs):
                try:
                    torch._foreach_copy_(copies, bufs)
                    reused = True
                except Exception:  # noqa: BLE001 - an unusual tensor: one clone each instead
                    copies = None
            else:
                copies = None
            if copies is None:
                copies = [b.clone() for b in bufs]
        self.buffers, self.copies = bufs, copies
        # the copies' shape, dtype and device (unchanged while they serve later captures)
        self.copies_meta = scratch.get("buffer_copies_meta") if reused else None
        self.versions = [b._version for b in bufs]

    @property
    def entries(self) -> list[tuple[nn.Module, dict, dict, dict, dict, dict]]:
        """Per module (module, attributes, container snapshots, `_parameters`, `_buffers`,
        `_modules` copies): the snapshot one module at a time."""
        c = self.reg_copies()
        return [(m, dict(zip(plan, row)), cont, c[3 * i], c[3 * i + 1], c[3 * i + 2])
                for i, (m, plan, row, cont) in enumerate(zip(self.mods, self.plans, self.rows, self.containers))]

    @property
    def buffer_list(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        return list(zip(self.buffers, self.copies, self.versions))

    def untouched_flags(self) -> list[bool]:
        """Per module, whether its `__dict__` has the snapshot's keys (in order: a key removed
        and added again counts as touched) and each attribute is the same object (builtin
        containers may still have changed in place). Computed once after the forward (the
        end-of-forward copy, `writes` and `restore` read the same answer; `restore` forgets it
        when it put attributes back): first for the whole model at once, module by module only
        when something was touched."""
        flags = self._flags
        if flags is None:
            dicts = list(map(_DICT, self.mods))
            keys = list(map(tuple, dicts))
            if keys == self.keys and all(map(operator.is_, chain.from_iterable(map(_call, self.getters, dicts)),
                                             self.flat)):
                flags = [True] * len(dicts)
            else:
                flags = [k == k0 and all(map(operator.is_, get(d), row))
                         for d, k, k0, get, row in zip(dicts, keys, self.keys, self.getters, self.rows_full)]
            self._flags = flags
        return flags

    def reach_plan(self) -> list[tuple[nn.Module, Any]]:
        """Per module, for the end-of-forward copy of payloads that module state aliases
        (`Recorder.flush_modules`): the attribute values that can hold a tensor, or None when
        the forward added, removed or rebound attributes (then every attribute is walked)."""
        flags = self.untouched_flags()
        if False not in flags:
            return list(zip(self.mods, self.reach))
        return [(m, reach if ok else None) for m, reach, ok in zip(self.mods, self.reach, flags)]

    def writes(self) -> dict[int, dict[str, Any]]:
        """id(module) -> {attribute: AttributeWrite} for what the forward wrote (read before
        `restore`): added, rebound or removed attributes and builtin containers or tensors
        changed in place. Custom objects are tracked by identity only."""
        from torchlens.backends.sdk import AttributeWrite

        flags = self.untouched_flags()
        out: dict[int, dict[str, Any]] = {}
        for i, (m, ok, containers) in enumerate(zip(self.mods, flags, self.containers)):
            if ok and not containers:
                out[id(m)] = {}
                continue
            attrs = dict(zip(self.plans[i], self.rows[i]))
            w: dict[str, Any] = {}
            if ok:  # only builtin containers and tensors can have changed
                for k, snap in containers.items():
                    v = attrs[k]
                    if _changed(v, snap):
                        w[k] = AttributeWrite("replaced", _copy(v))
                out[id(m)] = w
                continue
            d = m.__dict__
            for k, v in d.items():
                if k not in attrs and k not in MODULE_INTERNALS:
                    w[k] = AttributeWrite("added", v)
            for k, v in attrs.items():
                cur = d.get(k, _MISSING)
                if cur is _MISSING:
                    w[k] = AttributeWrite("removed", None)
                elif cur is not v:
                    w[k] = AttributeWrite("replaced", cur)
                elif k in containers and _changed(v, containers[k]):
                    w[k] = AttributeWrite("replaced", _copy(v))
            out[id(m)] = w
        return out

    def reg_copies(self) -> list[dict]:
        """Each registry (three per module: `_parameters`, `_buffers`, `_modules`) as it was at the snapshot."""
        out, keys, values, i = [], self.reg_keys, self.reg_values, 0
        for n in self.reg_lens:
            out.append(dict(zip(keys[i:i + n], values[i:i + n])) if n else {})
            i += n
        return out

    def _registries_unchanged(self) -> bool:
        """Every module's registries are the same dicts with the same entries (keys in order,
        values by identity) as at the snapshot. (Read after `untouched_flags` found every module
        untouched: with `quick_keys` that test has compared the registries' identity already.)"""
        if self.quick_keys:
            regs = self.regs
        else:
            regs = list(chain.from_iterable(map(_REGISTRIES, map(_DICT, self.mods))))
            if not all(map(operator.is_, regs, self.regs)):
                return False
        return (list(map(len, regs)) == self.reg_lens
                and list(chain.from_iterable(regs)) == self.reg_keys
                and all(map(operator.is_, chain.from_iterable(map(dict.values, regs)), self.reg_values)))

    def restore(self) -> None:
        flags, self._flags = self.untouched_flags(), None
        if False not in flags and self._registries_unchanged():
            # nothing added, removed or rebound, no registration changed: put containers back
            # (in place: every module stays untouched, so the flags still hold afterwards)
            for m, containers, plan, row in zip(self.mods, self.containers, self.plans, self.rows):
                if containers:
                    _restore_containers(dict(zip(plan, row)), containers)
            self._flags = flags
        else:
            copies = self.reg_copies()
            for i, (m, ok, containers) in enumerate(zip(self.mods, flags, self.containers)):
                d = m.__dict__
                attrs = dict(zip(self.plans[i], self.rows[i]))
                if ok:  # nothing added, removed or rebound: put containers back
                    _restore_containers(attrs, containers)
                else:
                    _restore_attrs(d, attrs, containers)
                # registrations (buffers' before their bytes); empty on both sides is the common case
                params, buffers, submods = copies[3 * i], copies[3 * i + 1], copies[3 * i + 2]
                cur = m._parameters
                if cur or params:
                    _restore_dict(cur, params)
                cur = m._modules
                if cur or submods:
                    _restore_dict(cur, submods)
                cur = m._buffers
                if cur or buffers:
                    _restore_dict(cur, buffers)
        rebound = False
        bufs, copies = self.buffers, self.copies
        # the common case in two C-level passes: same shape, dtype and device, same bytes
        meta = self.copies_meta
        if meta is None:
            meta = self.copies_meta = list(map(_META, copies))
        if not (list(map(_META, bufs)) == meta and all(map(torch.equal, bufs, copies))):
            for b, clone, version in zip(bufs, copies, self.versions):
                rebound |= _write_back(b, clone, version)
        scratch = self._scratch
        if scratch is not None and not rebound and bufs:
            # the copies serve the next capture (they no longer back any buffer: none was rebound
            # to its copy); only while they are small, since they outlive the capture
            ok = scratch.get("buffer_copies_ok")
            if ok is None:
                ok = scratch["buffer_copies_ok"] = sum(c.nbytes for c in copies) <= _KEEP_COPIES_BYTES
            if ok:
                scratch["buffer_copies"] = list(copies)
                scratch["buffer_copies_meta"] = meta


def _restore_containers(attrs: dict, containers: dict) -> None:
    """Put the snapshotted containers of an untouched module back (in place, or their tensors' bytes)."""
    for k, snap in containers.items():
        v = attrs[k]
        if type(v) in (list, dict, set):
            _restore_in_place(v, snap)
        else:
            _rebuild(snap)  # a tensor, or a tuple: restore tensors inside it


def _restore_attrs(d: dict, attrs: dict, containers: dict) -> None:
    """Undo the attributes the forward added, removed or rebound, and changed containers."""
    for k in [k for k in d if k not in attrs and k not in MODULE_INTERNALS]:
        del d[k]  # added by the forward
    for k, v in attrs.items():
        cur = d.get(k, _MISSING)
        if cur is not v:
            d[k] = v if k not in containers or type(v) not in (list, dict, set) else _restore_in_place(v, containers[k])
            if isinstance(v, torch.Tensor):
                _rebuild(containers[k])
        elif k in containers:
            snap = containers[k]
            if isinstance(v, torch.Tensor):
                _rebuild(snap)
            elif type(v) in (list, dict, set):
                _restore_in_place(v, snap)
            else:
                _rebuild(snap)  # a tuple: restore tensors inside it


def _changed(current: Any, snap: Any, depth: int = 0) -> bool:
    """Whether a value differs from its snapshot (tensors by bytes, containers recursively,
    other objects by identity)."""
    if type(snap) is _TensorSnap:
        c = snap.clone
        return not (current.shape == c.shape and current.dtype == c.dtype and torch.equal(current.detach(), c))
    if depth >= _MAX_DEPTH:
        return current is not snap
    if type(snap) is dict:
        return (type(current) is not dict or current.keys() != snap.keys()
                or any(_changed(current[k], snap[k], depth + 1) for k in snap))
    if type(snap) in (list, tuple):
        return (type(current) is not type(snap) or len(current) != len(snap)
                or any(_changed(a, b, depth + 1) for a, b in zip(current, snap)))
    if type(snap) is set:
        return current != snap
    return current is not snap


def _copy(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if depth >= _MAX_DEPTH:
        return value
    if type(value) is dict:
        return {k: _copy(v, depth + 1) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_copy(v, depth + 1) for v in value)
    if type(value) is set:
        return set(value)
    return value


def _restore_dict(current: dict, saved: dict) -> None:
    if current.keys() == saved.keys() and all(map(operator.is_, current.values(), saved.values())):
        return  # (the common case, checked in C)
    if current.keys() == saved.keys() and all(current[k] is v for k, v in saved.items()):
        return
    current.clear()
    current.update(saved)


def _write_back(t: torch.Tensor, clone: torch.Tensor, version: int | None = None) -> bool:
    """Copy the snapshot back where the bytes changed. Version counters are not enough:
    kernels such as batch_norm update running statistics without bumping them.

    When `version` (the counter at snapshot time) still matches, the change was invisible to
    autograd (batch_norm's running statistics), so the bytes go back through `.data` without a
    bump: a graph kept for `trace.backward` that saved the buffer stays usable. A change autograd
    saw (an explicit in-place write) is restored with a bump, so a graph that saved the written
    value refuses loudly instead of differentiating through restored bytes.

    Returns True when `t` was rebound to `clone` itself (which then backs `t`)."""
    same_kind = t.shape == clone.shape and t.dtype == clone.dtype and t.device == clone.device
    if same_kind and torch.equal(t, clone):
        return False  # (a NaN makes equal() False: such a buffer is simply written back)
    with torch.no_grad():
        if not same_kind:  # `.data` was rebound to another shape, dtype or device
            t.data = clone
            return True
        elif version is not None and t._version == version:
            t.data.copy_(clone)
        else:
            t.copy_(clone)
    return False


def _storage_key(t: torch.Tensor) -> int:
    """The address of a tensor's storage (0 when it has none: meta, sparse, empty)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


class ParamWriteGuard:
    """Undo in-place writes to parameters made by the forward, without cloning every
    parameter per capture (on a GPT-2-sized model that would double memory and time).

    Copy-on-write: the capture's handler calls `before_write(t)` before every call that
    writes a tensor in place (an `_`-method, `__setitem__`, `out=`, a functional's
    `inplace=True`, or `t.data = ...`); when `t`'s storage is a parameter's (the parameter
    itself, a view of it, or its `.data` alias), the parameter is cloned once, and `restore`
    writes the clone back. Writes the handler cannot see (made on another thread, inside a
    `DisableTorchFunction` region, by a C++ extension) still move the parameter's version
    counter; `unseen_writes` names those parameters so the capture can warn
    (`capture_state_restore_incomplete`), since no copy exists to restore them from. A write
    through `.data` the handler does not see moves no version counter and goes unnoticed.

    With `copy=False` (`carry_state=True`: nothing is restored) it only notes which
    parameters were written, so the recorder can read them as forward-time values.
    """

    def __init__(self, modules: list[tuple[str, nn.Module]], param_address: dict[int, str], copy: bool = True,
                 params: Any = None) -> None:
        """`params`: optionally the (address, parameter) pairs of `modules`, each parameter once in
        `modules` order (a `ModelDescription`'s `info.params`), read instead of the registries."""
        self.copy = copy
        self.params: dict[int, tuple[str, nn.Parameter, int]] = {}
        self.by_storage: dict[int, list[nn.Parameter]] = {}
        if params is None:
            params = []
            seen: set[int] = set()
            for addr, m in modules:
                for k, p in m._parameters.items():
                    if p is None or id(p) in seen:
                        continue
                    seen.add(id(p))
                    params.append((param_address.get(id(p)) or (f"{addr}.{k}" if addr != "self" else k), p))
        for address, p in params:
            self.params[id(p)] = (address, p, p._version)
            key = _storage_key(p)
            if key:
                self.by_storage.setdefault(key, []).append(p)
        # id(param) -> (its copy, an alias of its original storage), or None with copy=False
        self.written: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def before_write(self, t: torch.Tensor) -> list[nn.Parameter]:
        """Copy (once) every parameter whose storage `t` writes; returns those parameters."""
        if not self.by_storage:
            return []
        params = self.by_storage.get(_storage_key(t))
        if not params:
            return []
        for p in params:
            if id(p) not in self.written:
                self.written[id(p)] = (p.detach().clone(), p.data) if self.copy else None
        return params

    def restored(self) -> list[str]:
        """Addresses of the parameters that were copied (written by the forward)."""
        return [self.params[k][0] for k, c in self.written.items() if c is not None]

    def unseen_writes(self) -> list[str]:
        """Parameters whose version counter moved with no write seen (read before `restore`)."""
        return [addr for k, (addr, p, version) in self.params.items() if k not in self.written and p._version != version]

    def restore(self) -> None:
        for k, saved in self.written.items():
            if saved is None:
                continue
            clone, original = saved
            p = self.params[k][1]
            if _storage_key(p) != _storage_key(original):  # `p.data = t` rebound it: give the storage back
                with torch.no_grad():
                    p.data = original
            _write_back(p, clone)
