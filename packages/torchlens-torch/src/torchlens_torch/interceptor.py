"""The capture machinery: a `TorchFunctionMode` that sees every torch call, global module
forward hooks for module enter/exit, and the `Recorder` that turns both into core's event
stream (`torchlens.build.events`).

Provenance: every tensor an op produces is tagged `id(tensor) -> (event id, slot)`; the
tensors are kept alive for the capture so an id is never reused. A tensor argument is
resolved, in order, to its tag, to a parameter (listed in `OpEvent.params`, not a parent),
to a registered or module-held buffer (a `buffer` source event on first read) or else to a
closure constant (a `constant` source event). Labels, passes and edges are core's job.

Aliasing and writes: a call that returns its input unchanged (`.float()` on a float tensor)
does not take the tensor over, its readers still read the producer. An in-place write through
a view (`buf[:, :4].copy_(h)`) also records the base's new version (`record_view_write`), and
an in-place write to a buffer or a buffer rebound by the forward is that buffer's next version.
A read of a tensor's values into Python (`.item()`, `int(t)`, a branch) is noted on its
producing op (`meta["value_reads"]`), so replay can refuse past a data-dependent shape.

The per-op handler (`CaptureMode.__torch_function__`) is the hot path: a cached per-callable
`FuncInfo`, one call, a type check, and for tensor results a short walk over the arguments
and the Python frames up to the innermost module call (the call site key). Most calls take
the lean path (`FuncInfo.simple` under `CaptureMode.lean`: no write, no random draw, no edit
plan, budget, gradient store or non-finite check) through `Recorder.record_one`, which makes
the same event `Recorder.record` would; Python's cyclic collector is paused while the mode
is active (`concurrency.GcPause`): a capture makes a few small objects per op. When dynamo is
loaded the handler and hooks are kept out of it (`capture_mode`): compiled regions run eagerly
op by op under the capture.
"""

from __future__ import annotations

import inspect
import sys
import threading
from itertools import chain
from time import perf_counter
from typing import Any, Callable

import torch
from torch.nn.modules import module as _nn_module
from torch.overrides import TorchFunctionMode

from torchlens.backends.sdk import ArgRef, EventLog, ModuleEnter, ModuleExit, OpEvent, SaveBudgetExceededError

from torchlens_torch.composites import composite_table
from torchlens_torch.concurrency import GcPause
from torchlens_torch.costs import COST_FUNCS
from torchlens_torch.describe import MODULE_INTERNALS, ModelDescription
from torchlens_torch.values import _DTYPE_NAMES, dtype_name, iter_leaves

Tensor = torch.Tensor
_get_ident = threading.get_ident

#: Callables that never return a tensor: the handler passes them straight through.
_PASSTHROUGH_NAMES = frozenset({
    "shape", "dtype", "device", "ndim", "is_cuda", "is_sparse", "is_quantized", "is_meta", "is_mps", "is_cpu",
    "requires_grad", "is_leaf", "grad_fn", "layout", "names", "_version", "dim", "size", "numel", "item",
    "tolist", "stride", "storage_offset", "is_contiguous", "data_ptr", "element_size", "__len__", "__bool__",
    "__format__", "__repr__", "__hash__", "is_floating_point", "is_complex", "get_device", "nelement",
    "untyped_storage", "is_nested", "_is_view", "__index__", "__int__", "__float__", "is_inference",
    "output_nr", "_base", "is_xpu", "itemsize", "nbytes", "__reduce_ex__", "__deepcopy__",
})

#: Callables that draw random numbers: the RNG state before the call goes into `meta`.
_RANDOM_NAMES = frozenset({
    "dropout", "dropout_", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
    "dropout3d", "native_dropout", "bernoulli", "bernoulli_", "rand", "randn", "randint", "rand_like", "randn_like",
    "randint_like", "randperm", "normal", "normal_", "uniform_", "multinomial", "exponential_", "geometric_",
    "cauchy_", "log_normal_", "random_", "poisson", "rrelu", "rrelu_", "gumbel_softmax",
})

#: Callables that write some tensor arguments without saying so (running statistics).
_HIDDEN_WRITERS = frozenset({"batch_norm", "instance_norm", "native_batch_norm", "_native_batch_norm_legit"})

#: Of those, the flag (keyword name, position, default) under which they update running
#: statistics: a call with the flag literally False writes nothing (batch norm in eval mode)
#: and takes the handler's fast path (`FuncInfo.quiet_flag`).
_WRITE_FLAGS = {"batch_norm": ("training", 5, False), "native_batch_norm": ("training", 5, None),
                "_native_batch_norm_legit": ("training", 5, None), "instance_norm": ("use_input_stats", 5, True)}

#: In-place methods that change only metadata: no parameter copy before them.
_METADATA_INPLACE = frozenset({"requires_grad_", "retain_grad", "share_memory_"})

_INPLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__", "__imatmul__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__",
})


#: Passthrough callables that read a tensor's values into Python: a size, index or branch
#: condition computed from them is data-dependent (recorded per producing op, checked by replay).
_VALUE_READS = frozenset({"item", "tolist", "__int__", "__index__", "__float__", "__bool__", "__complex__"})

#: Callables whose ops replay cannot re-execute from their recorded arguments alone: the
#: reason goes into every such op's `meta["replay_unsupported"]` (replay and validation refuse).
_NOTES: dict[Any, dict[str, str]] = {torch.autograd.grad: {"replay_unsupported": "autograd_grad"}}


def _has_tensor(items: Any) -> bool:
    for b in items:
        if isinstance(b, Tensor):
            return True
    return False


def _hashable(func: Any) -> bool:
    try:
        hash(func)
    except TypeError:
        return False
    return True


class FuncInfo:
    """What the handler needs to know about one callable, computed once per callable."""

    __slots__ = ("name", "passthrough", "inplace", "may_inplace", "inplace_index", "hidden_write", "random", "cost",
                 "composite", "may_write", "data_set", "value_read", "note", "simple", "quiet_flag", "lean_write")

    def __init__(self, func: Any, composites: dict) -> None:
        name = getattr(func, "__name__", None) or type(func).__name__
        # `t.data = other` (a setter on the `data` property): rebinds a parameter's storage
        self.data_set = name == "__set__" and getattr(getattr(func, "__self__", None), "__name__", None) == "data"
        if name == "__get__":  # property read, e.g. Tensor.T.__get__
            owner = getattr(func, "__self__", None)
            name = getattr(owner, "__name__", name)
        self.name = name
        self.passthrough = name in _PASSTHROUGH_NAMES
        self.inplace = name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__")
                                                    and not name.startswith("_"))
        self.may_inplace = False
        self.inplace_index = -1
        if not self.inplace and inspect.isfunction(func):  # Python functional with an inplace= flag
            try:
                names = list(inspect.signature(func).parameters)
            except (TypeError, ValueError):
                names = []
            if "inplace" in names:
                self.may_inplace = True
                self.inplace_index = names.index("inplace")
        self.hidden_write = name in _HIDDEN_WRITERS
        self.may_write = self.inplace or self.may_inplace or self.hidden_write
        self.random = name in _RANDOM_NAMES
        self.cost = COST_FUNCS.get(name)
        # a read of a tensor's values into Python (`.item()`, `int(t)`, `if t:`): replay checks
        # the value it read still holds before it replays past it (a data-dependent shape)
        self.value_read = name in _VALUE_READS
        # facts every op of this callable carries in `meta` (None: none)
        self.note = _NOTES.get(func) if _hashable(func) else None
        self.composite = composites.get(func) if inspect.isfunction(func) else None
        # the handler's fast path: a call that writes nothing it is told of, draws no random
        # numbers (SDPA may: its dropout_p is read per call) and is not expanded
        self.simple = not (self.passthrough or self.composite is not None or self.may_write or self.data_set
                           or self.random or name == "scaled_dot_product_attention")
        # the handler's in-place fast path (`CaptureMode._write_lean`): an in-place method or an
        # `inplace=` functional (`relu_`, `x += y`, `F.relu(x, inplace=True)`) that is otherwise
        # simple: no hidden write, random draw, expansion, metadata-only write or `__setitem__`
        self.lean_write = (self.inplace or self.may_inplace) and not (
            self.passthrough or self.composite is not None or self.hidden_write or self.data_set or self.random
            or name in _METADATA_INPLACE or name == "__setitem__" or name == "scaled_dot_product_attention")
        # a hidden writer that is otherwise simple: (flag name, position, default) of the flag
        # under which it writes; a call with that flag False is simple (see `_writes_nothing`)
        self.quiet_flag = None
        if (self.hidden_write and not (self.passthrough or self.composite is not None or self.inplace
                                       or self.may_inplace or self.data_set or self.random)):
            self.quiet_flag = _WRITE_FLAGS.get(name)


def _writes_nothing(flag: tuple, args: tuple, kwargs: dict) -> bool:
    """Whether a hidden writer's call leaves its running statistics alone: its `training`
    (`use_input_stats`) flag, given by keyword, position or default, is literally False."""
    key, pos, default = flag
    value = kwargs.get(key, default) if kwargs else default
    if len(args) > pos:
        value = args[pos]
    return value is False


def _sdpa_draws(args: tuple, kwargs: dict) -> bool:
    """`scaled_dot_product_attention` draws random numbers when `dropout_p` > 0."""
    p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    return isinstance(p, (int, float)) and p > 0


def _inplace_flag(info: FuncInfo, args: tuple, kwargs: dict) -> bool:
    """The value of a functional's `inplace=` argument, given by keyword or position."""
    flag = kwargs.get("inplace")
    if flag is None and 0 <= info.inplace_index < len(args):
        flag = args[info.inplace_index]
    return bool(flag)


def _run_root(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Calls the traced root; its frame bounds the call-site walk like a module call."""
    return fn(*args, **kwargs)


#: ids of the code objects that bound the call-site walk (module calls, the traced root);
#: the objects live as long as the process, so their ids are stable
_STOP_CODES = frozenset(id(c) for c in (
    _nn_module.Module._call_impl.__code__,
    _nn_module.Module._wrapped_call_impl.__code__,
    _run_root.__code__,
    *(c for c in _nn_module.Module._call_impl.__code__.co_consts if inspect.iscode(c)),
))
_MAX_SITE_FRAMES = 24


def _call_site(f: Any) -> tuple:
    """The call-site key of a call made from frame `f`: (code id, instruction offset) of each
    frame between it and the innermost module call (or the traced root). A code object met
    again (recursion) keeps only its innermost frame, so the same place reached at another
    recursion depth is another pass, not another layer. Code objects by id: one that dynamo
    builds can hold an unhashable constant."""
    stop = _STOP_CODES
    cid = id(f.f_code)
    if cid in stop:
        return ()
    g = f.f_back
    if g is None:
        return (cid, f.f_lasti)
    gid = id(g.f_code)
    if gid in stop:  # the common case: called from a module's forward
        return (cid, f.f_lasti)
    h = g.f_back
    if h is None or id(h.f_code) in stop:  # two frames (a functional called from a forward)
        return (cid, f.f_lasti) if gid == cid else (cid, f.f_lasti, gid, g.f_lasti)
    hid = id(h.f_code)
    k = h.f_back
    if (k is None or id(k.f_code) in stop) and cid != gid and gid != hid and cid != hid:
        # three distinct frames (torch's `handle_torch_function` under a functional called
        # from a forward: batch norm, an in-place ReLU)
        return (cid, f.f_lasti, gid, g.f_lasti, hid, h.f_lasti)
    site: list = []
    codes: list = []
    for _ in range(_MAX_SITE_FRAMES):
        if f is None:
            break
        cid = id(f.f_code)
        if cid in stop:
            break
        if cid not in codes:
            codes.append(cid)
            site.append(cid)
            site.append(f.f_lasti)
        f = f.f_back
    return tuple(site)


#: Values that hold no tensor (`Recorder.flush_reachable` skips them at once).
_LEAF_TYPES = frozenset({str, bytes, int, float, bool, type(None), torch.dtype, torch.device, torch.Size})

#: The handler's `kwargs` when torch passes none (read only, never stored or changed).
_NO_KWARGS: dict = {}

#: `ArgRef(i)` for small i: argument templates share these (ArgRef is frozen, equal by value).
_REFS: tuple[ArgRef, ...] = tuple(ArgRef(i) for i in range(64))


def _ref(i: int) -> ArgRef:
    return _REFS[i] if i < 64 else ArgRef(i)


#: `ArgRef(-1, address)` of each parameter address met so far, shared by every capture of the
#: process (ArgRef is frozen and equal by value; a new one costs a dataclass construction).
#: Cleared when it passes `_PARAM_REFS_MAX` entries.
_PARAM_REFS: dict[str, ArgRef] = {}
_PARAM_REFS_MAX = 200_000


#: An event's `outputs` when nothing of its one output is saved (tuples are immutable: one
#: object for every such event, as `()` is)
_UNSAVED = (None,)
#: torch.Size -> `(tuple(size),)`, an event's `shapes` for one output, and dtype -> `(its name,)`,
#: its `dtypes`: one tuple per distinct value for every event, instead of two or one new
#: objects kept per op (what a capture keeps per op is a measurable part of its cost, see
#: docs/backends/torch.md). Emptied past `_SHAPES_MAX` entries.
_SHAPE1: dict[Any, tuple] = {}
_DTYPE1: dict[Any, tuple] = {}
_SHAPES_MAX = 1 << 12


def _shape1(size: Any) -> tuple:
    try:
        got = _SHAPE1.get(size)
    except TypeError:  # a size that cannot be hashed (symbolic dimensions): not cached
        return (tuple(size),)
    if got is None:
        if len(_SHAPE1) >= _SHAPES_MAX:
            _SHAPE1.clear()
        got = _SHAPE1[size] = (tuple(size),)
    return got


def _dtype1(dtype: Any) -> tuple:
    got = _DTYPE1.get(dtype)
    if got is None:
        got = _DTYPE1[dtype] = (_DTYPE_NAMES.get(dtype) or dtype_name(dtype),)
    return got


#: Per-callable facts, shared by every capture of the process (they never change).
_FUNC_INFOS: dict[Any, "FuncInfo"] = {}
_COMPOSITES: dict | None = None


def _composites() -> dict:
    global _COMPOSITES
    if _COMPOSITES is None:
        _COMPOSITES = composite_table()
    return _COMPOSITES


class Recorder:
    """Holds the event log and the provenance tags of one capture."""

    def __init__(self, desc: ModelDescription, *, save_payloads: bool, save_fn: Callable[[Tensor], Any],
                 grad_store: dict | None, check_nonfinite: str | None,
                 cow_ref: Callable[[Tensor], Any] | None = None, budget: int | None = None,
                 param_guard: Any = None) -> None:
        self.desc = desc
        self.log = EventLog()
        self.events = self.log.events
        self.next_id = 0
        #: id(tensor) -> (event id, output slot); None for a freed tensor's id (`WeakKeep`):
        #: read with `.get(...)` and a test for None, never with `in`
        self.tags: dict[int, tuple[int, int] | None] = {}
        self.keep: list[Any] = []
        #: the freed tensors' weak references a `WeakKeep` keep has not purged yet (its `dead`
        #: list; () with the plain list): every entry point that reads tags purges them first
        self.dead: Any = ()
        self.param_address = desc.param_address
        # a copy: a buffer rebound during the forward (`self.state = ...`) is added to it
        self.buffer_address = dict(desc.buffer_address)
        self.module_address = desc.module_address
        self.stack: tuple[tuple[str, int], ...] = ()
        self.call_counts: dict[str, int] = {}
        self.save_payloads = save_payloads
        self.save_fn = save_fn
        self.grad_store = grad_store
        self.check_nonfinite = check_nonfinite
        self.infos = _FUNC_INFOS
        self.composites = _composites()
        self.composite: str | None = None
        self.composite_seq = 0
        self.nonfinite_ops: list[int] = []
        self.thread = threading.get_ident()  # global module hooks fire in every thread
        # copy-on-write saving (save_mode="copy"): an op's payload is a reference until a
        # write is about to change its storage, then it is copied (see `flush`).
        self.cow_ref = cow_ref if save_payloads else None
        self.pending: dict[int, list] = {}  # storage data_ptr -> [(event, slot, tensor, version)]
        self.op_events: dict[int, OpEvent] = {}
        self.edit_plan: Any = None  # core's EditPlan for live interventions (event id -> edits)
        self.enter_events: dict[tuple[str, int], ModuleEnter] = {}
        # save_budget: payload bytes kept so far, charged before a payload is kept
        self.budget = budget if save_payloads else None
        self.kept_bytes = 0
        self.budget_error: SaveBudgetExceededError | None = None
        # parameters are copied on the first write the handler sees (state.ParamWriteGuard);
        # a parameter written in place is read afterwards as a constant holding its
        # forward-time value (its Param record holds the restored value)
        self.param_guard = param_guard
        self.params_written: dict = param_guard.written if param_guard is not None else {}
        # the global random stream as this capture's last random op left it (see rng_check)
        self.rng_next: Tensor | None = None
        self.rng_unaccounted = 0
        # threads other than the capture's that ran the traced model's modules
        self.foreign_threads: set[str] = set()
        # event id -> {(slot, read name)}: values the forward read back into Python
        self.value_reads: dict[int, set] = {}
        # event id -> buffer addresses the forward rebound to that op's output
        self.buffer_rebinds: dict[int, list[str]] = {}
        if len(_PARAM_REFS) > _PARAM_REFS_MAX:
            _PARAM_REFS.clear()
        # output_names.install: called by `post_hook` for a call that returned a container
        self.name_outputs: Callable[[Any, str, int, Any], None] | None = None
        self.param_refs: dict[str, ArgRef] = _PARAM_REFS  # address -> its ArgRef (shared by the templates)

    # sources ---------------------------------------------------------------------------
    def _new_id(self) -> int:
        i = self.next_id
        self.next_id = i + 1
        return i

    def add_source(self, kind: str, t: Tensor, path: str | None, stack: tuple = ()) -> tuple[int, int]:
        if self.budget is not None:
            self.charge((t,), kind)
        eid = self.next_id
        self.next_id = eid + 1
        saved = self.save_payloads
        self.events.append(OpEvent(eid, kind, kind, (), (self.save_fn(t),) if saved else _UNSAVED, _shape1(t.shape),
                                   _dtype1(t.dtype), stack, None, (), path, saved))
        tag = (eid, 0)
        self.tags[id(t)] = tag
        self.keep.append(t)
        return tag

    def add_inputs(self, leaves: list[tuple[str, Tensor]]) -> None:
        for path, t in leaves:
            if self.budget is not None:
                self.charge((t,), "input", path)
            first = self.tags.get(id(t)) is None  # (a freed tensor's tag reads None: `WeakKeep`)
            eid = self._new_id()
            saved = self.save_payloads
            self.events.append(OpEvent(eid, "input", "input", (), (self.save_fn(t),) if saved else _UNSAVED,
                                       _shape1(t.shape), _dtype1(t.dtype), (), None, (), path, saved))
            if first:
                self.tags[id(t)] = (eid, 0)
                self.keep.append(t)

    def add_outputs(self, leaves: list[tuple[str, Tensor]]) -> None:
        for path, t in leaves:
            parents: list = []
            params: list = []
            self._resolve(t, parents, params)
            eid = self._new_id()
            saved = self.save_payloads
            payload = None
            if saved:
                self.flush(t)  # the caller owns the returned tensor now: isolate the op's payload
                producer = self.op_events.get(parents[0][0]) if parents else None
                if producer is not None and producer.outputs[parents[0][1]] is not None and not producer.meta.get("payload_mutated"):
                    payload = producer.outputs[parents[0][1]]  # already a private copy
                    if payload is t:
                        payload = self.save_fn(t)
                else:
                    payload = self.save_fn(t)
            self.events.append(OpEvent(eid, "output", "output", tuple(parents), (payload,),
                                       _shape1(t.shape), _dtype1(t.dtype), (), None, tuple(params), path, saved))

    def _resolve(self, t: Tensor, parents: list, params: list) -> None:
        key = id(t)
        tag = self.tags.get(key)
        if tag is not None:
            parents.append(tag)
            return
        addr = self.param_address.get(key)
        if addr is not None and key not in self.params_written:
            params.append(addr)
            return
        addr = self.buffer_address.get(key)
        if addr is not None:
            parents.append(self.add_source("buffer", t, addr, self.stack))
        else:
            parents.append(self.add_source("constant", t, None, self.stack))

    def _arg(self, a: Tensor, parents: list, params: list) -> ArgRef:
        """Resolve one tensor argument and return the template slot standing for it
        (`_resolve`'s order, inline: an op's output, a parameter, a buffer, a constant)."""
        key = id(a)
        tag = self.tags.get(key)
        if tag is None:
            addr = self.param_address.get(key)
            if addr is not None and key not in self.params_written:
                params.append(addr)
                ref = self.param_refs.get(addr)
                if ref is None:
                    ref = self.param_refs[addr] = ArgRef(-1, addr)
                return ref
            addr = self.buffer_address.get(key)
            if addr is not None:
                tag = self.add_source("buffer", a, addr, self.stack)
            else:
                tag = self.add_source("constant", a, None, self.stack)
        parents.append(tag)
        n = len(parents)
        return _REFS[n - 1] if n <= 64 else ArgRef(n - 1)

    def _resolve_args(self, args: tuple, kwargs: dict) -> tuple[list, list, tuple, dict]:
        """Parents, parameters read, and the argument templates replay fills back in."""
        if self.dead:
            self.keep.purge()
        parents: list = []
        params: list = []
        targs: list = []
        tags = self.tags
        arg = self._arg
        for a in args:
            if isinstance(a, Tensor):
                tag = tags.get(id(a))
                if tag is not None:  # the common case, inline: an op's output
                    parents.append(tag)
                    n = len(parents)
                    targs.append(_REFS[n - 1] if n <= 64 else ArgRef(n - 1))
                else:
                    targs.append(arg(a, parents, params))
            elif (type(a) is list or type(a) is tuple) and a and _has_tensor(a):
                targs.append(type(a)(arg(b, parents, params) if isinstance(b, Tensor) else b for b in a))
            else:
                targs.append(a)
        tkwargs: dict = {}
        if kwargs:
            for k, a in kwargs.items():
                if isinstance(a, Tensor):
                    tkwargs[k] = arg(a, parents, params)
                elif (type(a) is list or type(a) is tuple) and a and _has_tensor(a):
                    tkwargs[k] = type(a)(arg(b, parents, params) if isinstance(b, Tensor) else b for b in a)
                else:
                    tkwargs[k] = a
        return parents, params, tuple(targs), tkwargs

    def func_info(self, func: Any) -> FuncInfo:
        info = FuncInfo(func, self.composites)
        try:
            self.infos[func] = info
        except TypeError:  # an unhashable callable: rebuild the info on each call
            pass
        return info

    # ops -------------------------------------------------------------------------------
    def record(self, func: Any, info: FuncInfo, args: tuple, kwargs: dict, out: Any, outs: tuple, multi: bool,
               inplace: bool, pre: tuple | None, duration: float, rng: Any, site: tuple) -> Any:
        parents, params, targs, tkwargs = pre if pre is not None else self._resolve_args(args, kwargs)
        eid = self.next_id
        plan = self.edit_plan
        if plan is not None and eid in plan and info.name != "__setitem__":
            outs = plan.apply(eid, outs)
            if multi:
                try:
                    out = type(out)(outs)
                except TypeError:
                    out = type(out)(*outs)
            else:
                out = outs[0]
        if self.budget is not None:
            self.charge(outs, info.name)  # before anything of this op is kept
        self.next_id = eid + 1
        tags = self.tags
        keep = self.keep
        cow = self.cow_ref
        if multi:
            shapes = tuple(tuple(o.shape) if isinstance(o, Tensor) else None for o in outs)
            dtypes = tuple(dtype_name(o.dtype) if isinstance(o, Tensor) else None for o in outs)
            if cow is not None:
                saved_outs = tuple(cow(o) if isinstance(o, Tensor) else None for o in outs)
            elif self.save_payloads:
                save = self.save_fn
                saved_outs = tuple(save(o) if isinstance(o, Tensor) else None for o in outs)
            else:
                saved_outs = (None,) * len(outs)
        else:
            o = outs[0]  # a tensor (the call's result, or the tensor `__setitem__` wrote)
            shapes = _shape1(o.shape)
            dtypes = _dtype1(o.dtype)
            if cow is not None:
                saved_outs = (cow(o),)
            else:
                saved_outs = (self.save_fn(o),) if self.save_payloads else _UNSAVED
        meta: dict[str, Any] = {"duration_s": duration}
        if not multi:
            if outs[0].requires_grad:
                meta["requires_grad"] = (True,)
        elif any(isinstance(o, Tensor) and o.requires_grad for o in outs):
            meta["requires_grad"] = tuple(isinstance(o, Tensor) and o.requires_grad for o in outs)
        if info.cost is not None:
            try:
                cost = info.cost(args, kwargs, outs)
            except (AttributeError, IndexError, TypeError, ValueError):
                cost = None
            if cost is not None:
                meta["flops"], meta["macs"] = cost
        if rng is not None:
            meta["rng_state"] = rng
        if self.composite is not None:
            meta["composite"] = self.composite
        if info.note is not None:
            meta.update(info.note)
        param_address = self.param_address
        buffer_address = self.buffer_address
        if inplace and buffer_address:
            addr = buffer_address.get(id(outs[0]))
            if addr is not None:  # an in-place write to a buffer: a new version of it
                meta["buffer_write"] = (addr,)
        a0 = args[0] if args else None
        for i, o in enumerate(outs):
            if isinstance(o, Tensor):
                k = id(o)
                if not inplace and (k in param_address or k in buffer_address or o is a0):
                    # a parameter or buffer passed through unchanged keeps its identity, and so
                    # does a tensor a no-op call returned as itself (`.float()` on a float
                    # tensor): its later readers still read its producer
                    continue
                tags[k] = (eid, i)
                keep.append(o)
        ev = OpEvent(eid, "op", info.name, tuple(parents), saved_outs, shapes, dtypes, self.stack, site,
                     tuple(params), None, self.save_payloads, multi, func, targs, tkwargs, inplace, meta)
        self.events.append(ev)
        if cow is not None:
            self.op_events[eid] = ev
            pending = self.pending
            for i, o in enumerate(outs):
                if isinstance(o, Tensor):
                    try:
                        ptr = o.untyped_storage().data_ptr()
                    except (RuntimeError, NotImplementedError, TypeError):  # no plain storage: copy now
                        self._materialize(ev, i, o, o._version)
                        continue
                    entry = (ev, i, o, o._version)
                    lst = pending.get(ptr)
                    if lst is None:
                        pending[ptr] = [entry]
                    else:
                        lst.append(entry)
        if plan is not None and eid in plan.grad_by_event:  # an armed gradient edit: edit what flows back
            for o in outs:
                if isinstance(o, Tensor) and o.requires_grad:
                    o.register_hook(lambda g, eid=eid: plan.apply_grad(eid, g))
        if self.grad_store is not None:
            self._register_grad_hooks(eid, outs)
        if self.check_nonfinite is not None:
            self._check_nonfinite(eid, info.name, outs, meta)
        return out

    def record_one(self, func: Any, info: FuncInfo, args: tuple, kwargs: dict, out: Tensor, duration: float,
                   site: tuple, pre: tuple | None = None, inplace: bool = False) -> Tensor:
        """`record` for the common case, kept short (it runs once per op): one tensor output
        of a call that writes nothing it is told of and draws no random numbers, under a
        capture without an edit plan, save budget, gradient store or non-finite check
        (`CaptureMode.lean`). Makes the same event `record` makes. `CaptureMode._write_lean`
        passes the arguments it resolved before the write (`pre`) and `inplace=True` for a
        write that returned its target (`record`'s single-output in-place case)."""
        if pre is not None:
            parents, params, targs, tkwargs = pre
        elif kwargs:
            parents, params, targs, tkwargs = self._resolve_args(args, kwargs)
        else:  # `_resolve_args` for positional arguments, inline
            parents = []
            params = []
            targs = []
            tags = self.tags
            for a in args:
                if isinstance(a, Tensor):
                    tag = tags.get(id(a))
                    if tag is not None:
                        parents.append(tag)
                        n = len(parents)
                        targs.append(_REFS[n - 1] if n <= 64 else ArgRef(n - 1))
                    else:
                        targs.append(self._arg(a, parents, params))
                elif (type(a) is list or type(a) is tuple) and a and _has_tensor(a):
                    arg = self._arg
                    targs.append(type(a)(arg(b, parents, params) if isinstance(b, Tensor) else b for b in a))
                else:
                    targs.append(a)
            targs = tuple(targs)
            tkwargs = {}
        eid = self.next_id
        self.next_id = eid + 1
        cow = self.cow_ref
        saved = self.save_payloads
        if cow is not None:
            payload = cow(out)
        elif saved:
            payload = self.save_fn(out)
        else:
            payload = None
        meta: dict[str, Any] = {"duration_s": duration}
        if out.requires_grad:
            meta["requires_grad"] = (True,)
        cost_fn = info.cost
        if cost_fn is not None:
            try:
                cost = cost_fn(args, kwargs, (out,))
            except (AttributeError, IndexError, TypeError, ValueError):
                cost = None
            if cost is not None:
                meta["flops"], meta["macs"] = cost
        if self.composite is not None:
            meta["composite"] = self.composite
        if info.note is not None:
            meta.update(info.note)
        k = id(out)
        if inplace:
            if self.buffer_address:
                addr = self.buffer_address.get(k)
                if addr is not None:  # an in-place write to a buffer: a new version of it
                    meta["buffer_write"] = (addr,)
            self.tags[k] = (eid, 0)  # the written tensor now reads as this op's output
            self.keep.append(out)
        # a parameter or buffer passed through unchanged keeps its identity, and so does a
        # tensor a no-op call returned as itself: its later readers still read its producer
        elif not (k in self.param_address or k in self.buffer_address or (args and out is args[0])):
            self.tags[k] = (eid, 0)
            self.keep.append(out)
        try:  # `_shape1` / `_dtype1`, their hit inline (no call on the lean path); a miss calls them
            shapes = _SHAPE1[out.shape]
        except (KeyError, TypeError):
            shapes = _shape1(out.shape)
        dtypes = _DTYPE1.get(out.dtype)
        ev = OpEvent(eid, "op", info.name, tuple(parents), _UNSAVED if payload is None else (payload,), shapes,
                     dtypes if dtypes is not None else _dtype1(out.dtype), self.stack, site, tuple(params), None, saved,
                     False, func, targs, tkwargs, inplace, meta)
        self.events.append(ev)
        if cow is not None:
            self.op_events[eid] = ev
            try:
                ptr = out.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError, TypeError):  # no plain storage: copy now
                self._materialize(ev, 0, out, out._version)
                return out
            entry = (ev, 0, out, out._version)
            lst = self.pending.get(ptr)
            if lst is None:
                self.pending[ptr] = [entry]
            else:
                lst.append(entry)
        return out

    def _register_grad_hooks(self, eid: int, outs: tuple) -> None:
        store = self.grad_store
        for i, o in enumerate(outs):
            if isinstance(o, Tensor) and o.requires_grad:
                def hook(grad: Tensor, eid: int = eid, i: int = i, n: int = len(outs)) -> None:
                    slots = store.get(eid)
                    if slots is None:
                        slots = store[eid] = [None] * n
                    slots[i] = grad.detach().clone()
                o.register_hook(hook)

    def _check_nonfinite(self, eid: int, name: str, outs: tuple, meta: dict) -> None:
        bad = any(isinstance(o, Tensor) and (o.is_floating_point() or o.is_complex()) and not bool(torch.isfinite(o).all())
                  for o in outs)
        meta["has_nonfinite"] = bad
        if not bad:
            return
        self.nonfinite_ops.append(eid)  # on_nonfinite="warn": the capture warns once, after the forward
        if self.check_nonfinite == "raise":
            from torchlens.backends.sdk import TraceCaptureError

            raise TraceCaptureError("nonfinite_value", f"{name} produced NaN or Inf under on_nonfinite='raise'",
                                    remedy="inspect exc.partial_trace, or capture with on_nonfinite='track'",
                                    func_name=name)

    # save budget ------------------------------------------------------------------------
    def charge(self, tensors: tuple, what: str, path: str | None = None) -> None:
        """Count the payload bytes about to be kept; refuse before keeping them when the
        total would pass `save_budget`. A refusal the forward swallows is raised again at the
        next payload and by the capture after the forward."""
        if self.budget_error is not None:
            raise self.budget_error
        n = 0
        for o in tensors:
            if isinstance(o, Tensor):
                n += o.nbytes
        total = self.kept_bytes + n
        if total > self.budget:
            where = f"{what} {path}" if path else what
            self.budget_error = SaveBudgetExceededError(
                "save_budget_exceeded",
                f"keeping the payload of {where} ({n} bytes) would bring the capture to {total} payload bytes; "
                f"the budget is {self.budget}",
                remedy=("raise save_budget=, or keep less with save='none'; a save= selector is resolved after the "
                        "forward, so the capture holds every payload until then and the budget bounds that peak"),
                kept_bytes=total, budget=self.budget, func_name=what, path=path, event_index=self.next_id)
            raise self.budget_error
        self.kept_bytes = total

    # parameter writes and the random stream ---------------------------------------------
    def guard_params(self, info: FuncInfo, args: tuple, kwargs: dict) -> None:
        """Before a call that may write a parameter's storage: let the guard copy it, and
        forget the parameter's tag so its next read records the value after this write."""
        targets: list = []
        if args and isinstance(args[0], Tensor) and info.name not in _METADATA_INPLACE and (
                info.inplace or info.data_set or (info.may_inplace and _inplace_flag(info, args, kwargs))):
            targets.append(args[0])
        out = kwargs.get("out")
        if isinstance(out, Tensor):
            targets.append(out)
        elif type(out) is tuple or type(out) is list:
            targets.extend(o for o in out if isinstance(o, Tensor))
        tags = self.tags
        for t in targets:
            for p in self.param_guard.before_write(t):
                tags.pop(id(p), None)

    def rng_check(self, state: Tensor) -> None:
        """Before a random op: the global stream must be where this capture left it (its last
        random op, or the forward's start). If not, something drew in between: another
        thread, or an op TorchLens does not know draws; recorded RNG states may not replay."""
        expected = self.rng_next
        if expected is not None and not torch.equal(state, expected):
            self.rng_unaccounted += 1

    # copy-on-write -----------------------------------------------------------------------
    def _materialize(self, ev: OpEvent, slot: int, t: Tensor, version: int) -> None:
        outs = list(ev.outputs)
        try:
            outs[slot] = self.save_fn(t)
        except RuntimeError:  # a no_grad view whose base was later written in place: no valid graph
            with torch.no_grad():
                outs[slot] = self.save_fn(t)
        ev.outputs = tuple(outs)
        if t._version != version:  # written by something the capture did not see as a write
            ev.meta["payload_mutated"] = True

    def flush(self, t: Any) -> None:
        """Copy every pending payload that shares `t`'s storage (called before a write)."""
        if not self.pending:
            return
        if isinstance(t, Tensor):
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError, TypeError):
                return
            lst = self.pending.pop(ptr, None)
            if lst:
                for ev, slot, ref, version in lst:
                    self._materialize(ev, slot, ref, version)
        elif type(t) is list or type(t) is tuple:
            for item in t:
                self.flush(item)

    def flush_writes(self, info: FuncInfo, args: tuple, kwargs: dict) -> None:
        """Before a call that may write: copy the pending payloads of what it writes."""
        if info.inplace:
            if args:
                self.flush(args[0])
        elif info.may_inplace:
            if args and _inplace_flag(info, args, kwargs):
                self.flush(args[0])
        elif info.hidden_write:
            self.flush(list(args) + list(kwargs.values()))
        out = kwargs.get("out")
        if out is not None:
            self.flush(out)

    def flush_reachable(self, obj: Any, depth: int = 0, seen: set | None = None) -> None:
        """Copy the pending payloads of every tensor reachable from `obj` (containers and
        plain objects' attributes, a few levels deep): what outlives the forward."""
        t = type(obj)
        if t in _LEAF_TYPES or not self.pending:
            return  # most module attributes: a number, a flag, a name
        if t is tuple and _LEAF_TYPES.issuperset(map(type, obj)):
            return  # a tuple of them (a Conv2d's kernel_size)
        if seen is None:
            seen = set()
        if isinstance(obj, Tensor):
            self.flush(obj)
            return
        if depth > 6 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), type)):
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj:
                self.flush_reachable(item, depth + 1, seen)
        elif isinstance(obj, dict):
            for item in obj.values():
                self.flush_reachable(item, depth + 1, seen)
        elif isinstance(obj, torch.nn.Module):
            return
        else:
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict):
                for item in d.values():
                    self.flush_reachable(item, depth + 1, seen)

    def defer_reachable(self, obj: Any, seen: set) -> list:
        """`flush_reachable` for a `save=<selection>` capture: the pending payloads reachable
        from `obj` (the returned output) are taken out of `pending` and returned as
        (event, slot, tensor, version) instead of copied, so that only those of ops the
        selection keeps are copied, after the build (`materialize_deferred`). Call it after
        `flush_modules`: a payload that module state also reaches is copied there, before the
        state restore can write it."""
        found: list = []
        self._materialize = lambda ev, slot, t, version: found.append((ev, slot, t, version))  # type: ignore
        try:
            self.flush_reachable(obj, 0, seen)
        finally:
            del self._materialize
        return found

    def materialize_deferred(self, trace: Any, deferred: list) -> None:
        """Copy the deferred payloads of the ops `apply_save` kept (and of kept output ops
        that share them); the others were released unread."""
        if not deferred:
            return
        ops = trace._ops.values()
        by_event = {op.event_id: op for op in ops}
        copies: dict[int, Any] = {}  # id(the alias an event held) -> its private copy
        for ev, slot, t, version in deferred:
            alias = ev.outputs[slot]
            op = by_event.get(ev.id)
            if op is None or not op.saved:
                continue
            self._materialize(ev, slot, t, version)
            outs = list(op._outputs)
            outs[slot] = copies[id(alias)] = ev.outputs[slot]
            op._outputs = tuple(outs)
        aliases = {id(ev.outputs[slot]): t for ev, slot, t, _ in deferred}
        for op in ops:
            if op.kind == "output" and op.saved and op._outputs and op._outputs[0] is not None:
                k = id(op._outputs[0])
                if k in copies:
                    op._outputs = (copies[k],) + tuple(op._outputs[1:])
                elif k in aliases:  # its producer was not kept: the output op's own copy
                    op._outputs = (self.save_fn(aliases[k]),) + tuple(op._outputs[1:])

    def flush_modules(self, modules: Any, seen: set, plan: Any = None) -> None:
        """`flush_reachable` over each module's own attributes (not torch's bookkeeping) and
        its `_parameters` / `_buffers` entries: the module state that outlives the forward.
        The common cases run inline (a scalar attribute is skipped without a call; a
        parameter or buffer goes straight to `flush`). `plan` (the state snapshot's
        `reach_plan`, same modules in the same order) lists, per module whose attributes the
        forward left as they were, the attribute values that can hold a tensor: only those
        are walked (None: every attribute, as without a plan)."""
        leaf, flush, reach = _LEAF_TYPES, self.flush, self.flush_reachable
        pending = self.pending
        if plan is not None:
            for m, values in plan:
                if not pending:
                    return
                if values is None:
                    self.flush_modules((("", m),), seen)
                    continue
                # `flush` for each parameter and buffer, its storage looked up inline (most
                # share no storage with a pending payload)
                for t in chain(m._parameters.values(), m._buffers.values()):
                    if t is not None:
                        try:
                            ptr = t.untyped_storage().data_ptr()
                        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
                            flush(t)  # (no plain storage: flush decides)
                            continue
                        if ptr in pending:
                            flush(t)
                for v in values:
                    reach(v, 0, seen)
            return
        for _, m in modules:
            if not self.pending:
                return
            for k, v in m.__dict__.items():
                if k in MODULE_INTERNALS:
                    if k == "_parameters" or k == "_buffers":
                        for t in v.values():
                            if isinstance(t, Tensor):
                                flush(t)
                elif type(v) not in leaf:
                    reach(v, 0, seen)

    # values read into Python, writes through views, rebound buffers ---------------------
    def note_value_read(self, t: Tensor, name: str) -> None:
        """The forward read `t`'s values into Python (`.item()`, `int(t)`, `if t:`): a shape,
        index or branch may depend on them. Noted on the op that produced `t`; replay checks
        the read still gives the same value before it replays past that op."""
        tag = self.tags.get(id(t))
        if tag is None:
            return
        reads = self.value_reads.get(tag[0])
        if reads is None:
            reads = self.value_reads[tag[0]] = set()
        reads.add((tag[1], name))

    def base_before_write(self, w: Tensor) -> tuple[Tensor, tuple[int, int]] | None:
        """Before an in-place write through the view `w`: the view's base and the tag of its
        value before the write (a base no op produced is resolved now, as a buffer or a
        constant holding its pre-write value). None for a parameter's base, whose writes
        `guard_params` handles."""
        base = w._base
        if base is None or id(base) in self.param_address:
            return None
        tag = self.tags.get(id(base))
        if tag is None:
            parents: list = []
            self._resolve(base, parents, [])
            tag = parents[0]
        return base, tag

    def record_view_write(self, w: Tensor, before: tuple[Tensor, tuple[int, int]], site: tuple) -> None:
        """After an in-place write through the view `w` (`buf[:, :4].copy_(h)`,
        `m.diagonal().zero_()`): record the base's new version as its own op, so its later
        readers link to the write and a replay edit upstream of the write reaches them.

        The op is `torch.as_strided_scatter(base_before, view_after, size, stride, offset)`,
        which recomputes the base exactly from the two values (offset relative to the
        base's, which must be contiguous so a replayed copy has the same layout); a base
        with another layout is recorded with `meta["replay_unsupported"]` instead, so
        replay and validation refuse it rather than guess."""
        base, base_tag = before
        w_tag = self.tags.get(id(w))
        if w_tag is None:
            return
        func = torch.as_strided_scatter
        info = self.infos.get(func) or self.func_info(func)
        size, stride = tuple(w.shape), tuple(w.stride())
        offset = w.storage_offset() - base.storage_offset()
        targs = (ArgRef(0), ArgRef(1), size, stride, offset)
        eid = self.next_id
        plan = self.edit_plan
        edited = plan is not None and eid in plan
        out = self.record(func, info, (base, w, size, stride, offset), {}, base, (base,), False, False,
                          ([base_tag, w_tag], [], targs, {}), 0.0, None, site + ("view_write",))
        ev = self.events[-1]
        ev.meta["view_write"] = True
        if not base.is_contiguous():
            ev.meta["replay_unsupported"] = "view_write_base_layout"
        addr = self.buffer_address.get(id(base))
        if addr is not None:
            ev.meta["buffer_write"] = (addr,)
        if edited and out is not base:  # a live edit of the base's new version: write it into the base
            with torch._C.DisableTorchFunction(), torch.no_grad():
                base.copy_(out)
        self.tags[id(base)] = (eid, 0)

    def buffer_hook(self, module: Any, name: str, tensor: Any) -> None:
        """Global buffer-registration hook: `module.name = tensor` rebinds a buffer during the
        forward. The op that produced `tensor` becomes that buffer's next version, and later
        in-place writes to `tensor` are versions too."""
        if not isinstance(tensor, Tensor) or _get_ident() != self.thread:
            return None
        maddr = self.module_address.get(id(module))
        if maddr is None:
            return None
        if self.dead:
            self.keep.purge()
        addr = name if maddr == "self" else f"{maddr}.{name}"
        self.buffer_address[id(tensor)] = addr
        keep = self.keep
        (keep.append if type(keep) is list else keep.hold)(tensor)  # its id stays unique for the capture
        tag = self.tags.get(id(tensor))
        if tag is not None:
            self.buffer_rebinds.setdefault(tag[0], []).append(addr)
        return None

    def finish(self) -> None:
        """After the forward: put the value reads and buffer rebinds on their ops' meta."""
        if not self.value_reads and not self.buffer_rebinds:
            return
        for ev in self.events:
            if type(ev) is not OpEvent:
                continue
            reads = self.value_reads.get(ev.id)
            if reads:
                ev.meta["value_reads"] = tuple(sorted(reads))
            addrs = self.buffer_rebinds.get(ev.id)
            if addrs and ev.kind == "op":
                ev.meta["buffer_write"] = tuple(dict.fromkeys(tuple(ev.meta.get("buffer_write", ())) + tuple(addrs)))

    # module hooks ------------------------------------------------------------------------
    def pre_hook(self, module: Any, args: tuple) -> None:
        addr = self.module_address.get(id(module))
        if addr is None:
            return None
        if _get_ident() != self.thread:  # global hooks fire in every thread
            self.foreign_threads.add(threading.current_thread().name)
            return None
        if self.dead:  # (in the capture's thread only: the purge changes the tags)
            self.keep.purge()
        n = self.call_counts.get(addr, 0) + 1
        self.call_counts[addr] = n
        self.stack = self.stack + ((addr, n),)
        tags = self.tags
        if len(args) == 1 and isinstance(args[0], Tensor):  # the common call: one tensor in
            tag = tags.get(id(args[0]))
            ids = (tag,) if tag is not None else ()
        else:
            ids = tuple(tag for tag in (tags.get(id(t)) for _, t in iter_leaves(args, "")) if tag is not None)
        ev = ModuleEnter(addr, n, ids)
        self.events.append(ev)
        self.enter_events[(addr, n)] = ev
        return None

    def post_hook(self, module: Any, args: tuple, *rest: Any) -> None:
        # (kwargs, output) normally; (output,) when torch runs always_call hooks after the
        # forward raised
        kwargs, output = rest if len(rest) == 2 else ({}, rest[0] if rest else None)
        addr = self.module_address.get(id(module))
        if addr is None or _get_ident() != self.thread:
            return None
        if self.dead:
            self.keep.purge()
        stack = self.stack
        # pop this module's frame (the innermost one with its address; the last one, as a rule)
        j = len(stack) - 1
        if j >= 0 and stack[j][0] == addr:
            call = stack[j][1]
            self.stack = stack[:j]
        else:
            for j in range(len(stack) - 1, -1, -1):
                if stack[j][0] == addr:
                    call = stack[j][1]
                    self.stack = stack[:j]
                    break
            else:
                return None
        tags = self.tags
        enter = self.enter_events.pop((addr, call), None)
        if kwargs and enter is not None:  # the global pre-hook sees positional inputs only
            extra = [tag for tag in (tags.get(id(t)) for _, t in iter_leaves(kwargs, "")) if tag is not None]
            if extra:
                enter.input_ids = tuple(dict.fromkeys(enter.input_ids + tuple(extra)))
        ids: list = []
        if type(output) is Tensor:
            tag = tags.get(id(output))
            if tag is not None:  # the common call: one tensor out, an op's output
                self.events.append(ModuleExit(addr, call, (tag,)))
                return None
            self._exit_source(output, stack[: j + 1], ids)
        elif output is not None:
            for _, t in iter_leaves(output, ""):
                tag = tags.get(id(t))
                if tag is not None:
                    ids.append(tag)
                else:
                    self._exit_source(t, stack[: j + 1], ids)
        self.events.append(ModuleExit(addr, call, tuple(ids)))
        if output is not None and type(output) is not Tensor and len(rest) == 2 and self.name_outputs is not None:
            self.name_outputs(module, addr, call, output)  # structural output names (output_names.py)
        return None

    def _exit_source(self, t: Tensor, stack: tuple, ids: list) -> None:
        """A module returned a tensor no op produced: a buffer or a constant (not a parameter)."""
        if id(t) in self.param_address:
            return
        saved_stack = self.stack
        self.stack = stack
        parents: list = []
        try:
            with torch._C.DisableTorchFunction():  # the payload copy must not be recorded as an op
                self._resolve(t, parents, [])
        finally:
            self.stack = saved_stack
        ids.append(parents[0])


class CaptureMode(TorchFunctionMode):
    """Sees every torch function, `torch.nn.functional` call, Tensor method and operator."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.rec = recorder
        # the recorder's options are fixed by now: whether `Recorder.record_one` may record
        self.lean = (recorder.edit_plan is None and recorder.budget is None and recorder.grad_store is None
                     and recorder.check_nonfinite is None)
        self.gc_pause = GcPause()  # no collector passes over the capture's many small objects

    def __enter__(self) -> "CaptureMode":
        self.gc_pause.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self.gc_pause.__exit__()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self.gc_pause.__exit__()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: C901 - the hot path, kept flat
        rec = self.rec
        if rec.dead:  # tags of tensors freed since the last entry (`WeakKeep`), before any lookup
            rec.keep.purge()
        info = _FUNC_INFOS.get(func)
        if info is None:
            info = rec.func_info(func)
        if kwargs is None:
            kwargs = _NO_KWARGS
        if (info.simple or (info.quiet_flag is not None and _writes_nothing(info.quiet_flag, args, kwargs))) and (
                self.lean and "out" not in kwargs):
            # the fast path: most calls of a forward (see `Recorder.record_one`), batch norm
            # in eval mode included
            t0 = perf_counter()
            out = func(*args, **kwargs)
            duration = perf_counter() - t0
            if isinstance(out, Tensor):
                f = sys._getframe(1)
                cid = id(f.f_code)
                g = f.f_back
                if cid not in _STOP_CODES and (g is None or id(g.f_code) in _STOP_CODES):
                    site = (cid, f.f_lasti)  # `_call_site`'s common case, inline
                else:
                    site = _call_site(f)
                return rec.record_one(func, info, args, kwargs, out, duration, site)
            return self._finish(func, info, args, kwargs, out, duration, None, None, None)
        if info.lean_write and self.lean and args and "out" not in kwargs:
            a0 = args[0]
            if isinstance(a0, Tensor):
                if info.inplace or _inplace_flag(info, args, kwargs):
                    if a0._base is None:  # not a write through a view (that also records its base)
                        return self._write_lean(func, info, args, kwargs, a0)
                elif info.may_inplace:  # `inplace=False`: a simple call
                    t0 = perf_counter()
                    out = func(*args, **kwargs)
                    duration = perf_counter() - t0
                    if isinstance(out, Tensor):
                        return rec.record_one(func, info, args, kwargs, out, duration, _call_site(sys._getframe(1)))
                    return self._finish(func, info, args, kwargs, out, duration, None, None, None)
        if info.passthrough:
            if info.value_read and args:
                rec.note_value_read(args[0], info.name)
            return func(*args, **kwargs)
        if info.composite is not None:
            return self._run_composite(info, args, kwargs)
        pre = None
        view_base = None
        if info.may_write or "out" in kwargs:
            pre = rec._resolve_args(args, kwargs)  # read sources before the write changes them
            if args and isinstance(args[0], Tensor) and args[0]._base is not None and (
                    info.inplace or (info.may_inplace and _inplace_flag(info, args, kwargs))):
                view_base = rec.base_before_write(args[0])  # a write through a view: its base's value before
            if rec.pending:
                rec.flush_writes(info, args, kwargs)
            if rec.param_guard is not None:
                rec.guard_params(info, args, kwargs)
        elif info.data_set and rec.param_guard is not None:
            rec.guard_params(info, args, kwargs)
        if info.random or (info.name == "scaled_dot_product_attention" and _sdpa_draws(args, kwargs)):
            rng = torch.get_rng_state()
            rec.rng_check(rng)
            t0 = perf_counter()
            out = func(*args, **kwargs)
            duration = perf_counter() - t0
            rec.rng_next = torch.get_rng_state()
        else:
            rng = None
            t0 = perf_counter()
            out = func(*args, **kwargs)
            duration = perf_counter() - t0
        return self._finish(func, info, args, kwargs, out, duration, pre, view_base, rng)

    def _write_lean(self, func: Any, info: FuncInfo, args: tuple, kwargs: dict, a0: Tensor) -> Any:
        """The general path's steps for an in-place write to `a0` (not a view) under a lean
        capture, without its dispatch on the kind of write: the sources are read, the payloads
        sharing `a0`'s storage copied and a parameter it writes guarded, before the call."""
        rec = self.rec
        pre = rec._resolve_args(args, kwargs)  # read sources before the write changes them
        if rec.pending:
            rec.flush(a0)
        guard = rec.param_guard
        if guard is not None and guard.by_storage:
            tags = rec.tags
            for p in guard.before_write(a0):
                tags.pop(id(p), None)
        t0 = perf_counter()
        out = func(*args, **kwargs)
        duration = perf_counter() - t0
        if not isinstance(out, Tensor):
            return self._finish(func, info, args, kwargs, out, duration, pre, None, None)
        # `_finish`'s `inplace` for one tensor result: a method always, a functional when it
        # returned its argument (then `record_one` makes `record`'s event)
        if info.inplace or out is a0:
            return rec.record_one(func, info, args, kwargs, out, duration, _call_site(sys._getframe(2)), pre, True)
        return rec.record(func, info, args, kwargs, out, (out,), False, False, pre, duration, None,
                          _call_site(sys._getframe(2)))

    def _finish(self, func: Any, info: FuncInfo, args: tuple, kwargs: dict, out: Any, duration: float, pre: Any,
                view_base: Any, rng: Any) -> Any:
        """After the call: record its tensor outputs (and a write through a view)."""
        rec = self.rec
        if isinstance(out, Tensor):
            outs = (out,)
            multi = False
        elif info.name == "__setitem__" and args and isinstance(args[0], Tensor):
            outs = (args[0],)
            multi = False
        elif (type(out) is tuple or type(out) is list or isinstance(out, tuple)) and out and _has_tensor(out):
            outs = tuple(out)
            multi = True
        else:
            return out
        inplace = info.inplace
        if not inplace:
            if "out" in kwargs and kwargs["out"] is not None:
                inplace = True
            elif info.may_inplace:
                inplace = _inplace_flag(info, args, kwargs) and bool(args) and outs[0] is args[0]
        site = _call_site(sys._getframe(2))
        if view_base is None:
            return rec.record(func, info, args, kwargs, out, outs, multi, inplace, pre, duration, rng, site)
        result = rec.record(func, info, args, kwargs, out, outs, multi, inplace, pre, duration, rng, site)
        if inplace:
            rec.record_view_write(args[0], view_base, site)
        return result

    def _run_composite(self, info: FuncInfo, args: tuple, kwargs: dict) -> Any:
        rec = self.rec
        name, clone = info.composite
        rec.composite_seq += 1
        prev = rec.composite
        rec.composite = prev or f"{name}#{rec.composite_seq}"  # ops carry their outermost composite
        try:
            with self:
                return clone(*args, **kwargs)
        finally:
            rec.composite = prev


_DYNAMO_SAFE: type | None = None


def capture_mode(rec: Recorder) -> TorchFunctionMode:
    """The capture's mode. When `torch._dynamo` is loaded (a model may call `torch.compile`d
    code), the handler is wrapped in `torch._dynamo.disable`: dynamo must never trace the
    recorder (it recorded wrong ops, then crashed with `unhashable type: 'slice'` after a
    `dynamic=True` recompile). Dynamo then breaks its graph at every torch call of a compiled
    region, so those ops run eagerly and are recorded one by one like any other."""
    global _DYNAMO_SAFE
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return CaptureMode(rec)
    if _DYNAMO_SAFE is None:
        _DYNAMO_SAFE = type("DynamoSafeCaptureMode", (CaptureMode,), {
            "__doc__": "`CaptureMode` with its handler kept out of dynamo (see `capture_mode`).",
            "__torch_function__": dynamo.disable(CaptureMode.__torch_function__, recursive=True),
        })
    return _DYNAMO_SAFE(rec)


def install_module_hooks(rec: Recorder) -> list[Any]:
    """Global forward pre/post hooks and the buffer-registration hook (removed with
    `remove_module_hooks` after the capture); kept out of dynamo like the handler."""
    pre_hook, post_hook, buffer_hook = rec.pre_hook, rec.post_hook, rec.buffer_hook
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        pre_hook, post_hook, buffer_hook = (dynamo.disable(h) for h in (pre_hook, post_hook, buffer_hook))
    pre = _nn_module.register_module_forward_pre_hook(pre_hook)
    post = _nn_module.register_module_forward_hook(post_hook, with_kwargs=True, always_call=True)
    buf = _nn_module.register_module_buffer_registration_hook(buffer_hook)
    return [pre, post, buf]


def remove_module_hooks(handles: list[Any]) -> None:
    """Remove the global hooks, including the `with_kwargs` flag torch's handle forgets
    (`register_module_forward_hook(with_kwargs=True)` leaves one entry per call in
    `_global_forward_hooks_with_kwargs` otherwise)."""
    flags = getattr(_nn_module, "_global_forward_hooks_with_kwargs", None)
    for h in handles:
        h.remove()
        if flags is not None:
            flags.pop(h.id, None)
