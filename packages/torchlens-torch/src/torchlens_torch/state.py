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
from typing import Any

import torch
from torch import nn

from torchlens_torch.describe import MODULE_INTERNALS, KeyPlans

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
#: The snapshot of an empty registry (read only: `_restore_dict` never writes its `saved`)
_EMPTY: dict = {}
#: Attribute types that hold no tensor (`reach_plan` leaves them out)
_NO_TENSOR_TYPES = frozenset((bytes, torch.dtype, torch.device, torch.Size, type))
#: `__dict__` keys the snapshot skips: torch's bookkeeping (the training flag is user state)
_SNAPSHOT_SKIP = MODULE_INTERNALS - {"training"}
#: a module `__dict__`'s keys -> those the snapshot keeps (all but `_SNAPSHOT_SKIP`)
_PLANS = KeyPlans(_SNAPSHOT_SKIP)


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


class ModelStateSnapshot:
    """Everything a default (pure-observer) capture puts back after the forward."""

    def __init__(self, modules: list[tuple[str, nn.Module]], scratch: dict | None = None) -> None:
        self.entries: list[tuple[nn.Module, dict, dict, dict, dict, dict]] = []
        # per entry: the module's attribute keys, and its plain attributes' keys and values, for
        # `_untouched` (a C-level check that the forward added, removed and rebound nothing)
        self.shapes: list[tuple[Any, tuple, tuple]] = []
        # per entry: the attribute values that are neither scalars nor tuples of scalars (what
        # can hold a tensor: see `reach_plan`)
        self.reach: list[list] = []
        self._flags: list[bool] | None = None  # `_untouched` per entry, once the forward is over
        atoms, plans = _ATOM_TYPES, _PLANS
        for _, m in modules:
            d = m.__dict__
            keys = tuple(d)
            plan = plans[keys]
            attrs: dict[str, Any] = {k: d[k] for k in plan}
            containers: dict[str, Any] = {}
            reach: list = []
            for k in [k for k, v in attrs.items() if type(v) not in atoms]:  # (most attributes are scalars)
                v = attrs[k]
                t = type(v)
                if t is tuple:
                    if atoms.issuperset(map(type, v)):  # a Conv2d's `kernel_size`: cannot change in place
                        continue
                elif t not in _MUTABLE and not isinstance(v, torch.Tensor):
                    if t not in _NO_TENSOR_TYPES:
                        reach.append(v)
                    continue  # other objects: tracked by identity only
                reach.append(v)
                containers[k] = _snap_container(v)
            ps, bs, ms = m._parameters, m._buffers, m._modules
            # (an empty registry is the common case: one shared empty dict, never written)
            self.entries.append((m, attrs, containers, dict(ps) if ps else _EMPTY, dict(bs) if bs else _EMPTY,
                                 dict(ms) if ms else _EMPTY))
            self.shapes.append((keys, plan, tuple(attrs.values())))
            self.reach.append(reach)
        # every registered buffer (once per registration), a copy and its version counter now.
        # One clone per buffer: measured cheaper than one `torch.cat` (or `torch._foreach_*`) per
        # dtype, whose per-tensor detach/reshape views cost more than the clones they replace.
        # A repeated capture of an unchanged model (`scratch`: the cached description's, whose
        # fingerprint has just checked every buffer's identity, shape, dtype and device) copies
        # into the previous capture's copies instead, with one `torch._foreach_copy_` (see `restore`).
        bufs = [b for e in self.entries for b in e[4].values() if b is not None]
        self._scratch = scratch
        copies = scratch.pop("buffer_copies", None) if scratch is not None else None
        with torch.no_grad():  # (a copy made here records no graph: the same as detach().clone())
            if copies is not None and len(copies) == len(bufs):
                try:
                    torch._foreach_copy_(copies, bufs)
                except Exception:  # noqa: BLE001 - an unusual tensor: one clone each instead
                    copies = None
            else:
                copies = None
            if copies is None:
                copies = [b.clone() for b in bufs]
        self.buffer_list = [(b, c, b._version) for b, c in zip(bufs, copies)]

    @staticmethod
    def _untouched(d: dict, shape: tuple[Any, tuple, tuple]) -> bool:
        """The module's `__dict__` has the snapshot's keys and each plain attribute is the
        same object (builtin containers may still have changed in place)."""
        keys, attr_keys, attr_vals = shape  # (keys in order: a key removed and added again counts as touched)
        return tuple(d) == keys and all(map(operator.is_, map(d.__getitem__, attr_keys), attr_vals))

    def untouched_flags(self) -> list[bool]:
        """`_untouched` for each module, computed once after the forward (the end-of-forward
        copy, `writes` and `restore` read the same answer; `restore` forgets it)."""
        flags = self._flags
        if flags is None:
            untouched = self._untouched
            flags = self._flags = [untouched(e[0].__dict__, shape) for e, shape in zip(self.entries, self.shapes)]
        return flags

    def reach_plan(self) -> list[tuple[nn.Module, list | None]]:
        """Per module, for the end-of-forward copy of payloads that module state aliases
        (`Recorder.flush_modules`): the attribute values that can hold a tensor, or None when
        the forward added, removed or rebound attributes (then every attribute is walked)."""
        return [(e[0], reach if ok else None) for e, reach, ok in zip(self.entries, self.reach, self.untouched_flags())]

    def writes(self) -> dict[int, dict[str, Any]]:
        """id(module) -> {attribute: AttributeWrite} for what the forward wrote (read before
        `restore`): added, rebound or removed attributes and builtin containers or tensors
        changed in place. Custom objects are tracked by identity only."""
        from torchlens.backends.sdk import AttributeWrite

        out: dict[int, dict[str, Any]] = {}
        for (m, attrs, containers, _params, _buffers, _submods), ok in zip(self.entries, self.untouched_flags()):
            d = m.__dict__
            w: dict[str, Any] = {}
            if ok:  # only builtin containers and tensors can have changed
                for k, snap in containers.items():
                    v = attrs[k]
                    if _changed(v, snap):
                        w[k] = AttributeWrite("replaced", _copy(v))
                out[id(m)] = w
                continue
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

    def restore(self) -> None:
        flags, self._flags = self.untouched_flags(), None
        for (m, attrs, containers, params, buffers, submods), ok in zip(self.entries, flags):
            d = m.__dict__
            if ok:  # nothing added, removed or rebound: put containers back
                for k, snap in containers.items():
                    v = attrs[k]
                    if type(v) in (list, dict, set):
                        _restore_in_place(v, snap)
                    else:
                        _rebuild(snap)  # a tensor, or a tuple: restore tensors inside it
            else:
                _restore_attrs(d, attrs, containers)
            # registrations (buffers' before their bytes); empty on both sides is the common case
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
        for b, clone, version in self.buffer_list:
            rebound |= _write_back(b, clone, version)
        scratch = self._scratch
        if scratch is not None and not rebound and self.buffer_list:
            # the copies serve the next capture (they no longer back any buffer: none was rebound
            # to its copy); only while they are small, since they outlive the capture
            ok = scratch.get("buffer_copies_ok")
            if ok is None:
                ok = scratch["buffer_copies_ok"] = sum(c.nbytes for _, c, _ in self.buffer_list) <= _KEEP_COPIES_BYTES
            if ok:
                scratch["buffer_copies"] = [c for _, c, _ in self.buffer_list]


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
