"""Evaluate a jaxpr one primitive equation at a time and emit core events.

Call-like equations (`jit`/`pjit`, `closed_call`, `custom_jvp_call`, `custom_vjp_call`,
`checkpoint`) are stepped into, so the primitives inside `relu`, `softmax`, `gelu` or a
layer norm are recorded one op each. Control flow is unrolled with real values: `cond`
follows the branch its index selects, `while` and `scan` run their bodies iteration by
iteration (a scan's per-step slices and final stacking are recorded as `scan_slice` and
`scan_stack` ops), up to `MAX_UNROLL` iterations; past that the capture refuses with
`value_dependent_branch_unsupported` rather than record a partial loop. A module called in a
loop body is one module call per iteration (the traced call table names it once; each
iteration opens it again as a new runtime call). With `rolled=True` (`loops="rolled"`) a
`scan` or `while` is one op of any length, its body neither unrolled nor recorded.

Every recorded value is a concrete `jax.Array` computed by binding the primitive to
concrete inputs, the same path JAX's own eager dispatch takes, so recorded values equal an
eager call of the model. Compiled per-primitive executables are cached (per primitive,
parameters and input types), so a repeated capture only pays dispatch.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

import jax
import numpy as np
from jax.extend.core import Literal

from torchlens.backends.sdk import ArgRef, BackendUnsupportedError, EventLog, ModuleEnter, ModuleExit, OpEvent
from torchlens_jax.scopes import CallTable, call_ids

#: Primitives whose inner jaxpr is evaluated in place (their ops recorded individually).
CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                             "custom_vjp_call_jaxpr", "checkpoint", "remat", "remat2", "custom_lin"})
#: Primitives whose equation parameters hold a jaxpr their bind takes as a sub-function.
_SUBFUN_PRIMITIVES = frozenset({"shard_map"})
#: Collectives: inside a shard_map body they need the mesh's named axes bound.
_COLLECTIVES = frozenset({"psum", "pmax", "pmin", "ppermute", "pbroadcast", "all_gather", "all_to_all", "psum_scatter",
                          "reduce_scatter", "axis_index", "pgather", "psum_invariant", "pvary", "all_gather_invariant"})
#: The most loop iterations (while or scan) one capture unrolls.
MAX_UNROLL = 1024

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
#: Frames of these files are the capture's own wrappers: a site stops there.
_WRAPPER_FILES = frozenset(os.path.join(_PKG_DIR, f) for f in ("scopes.py", "backend.py", "interpret.py"))


class PrimitiveCall:
    """A recorded op's callable: binds the JAX primitive with its equation parameters.
    Replaying it on the recorded inputs re-executes exactly that op."""

    __slots__ = ("primitive", "params")

    def __init__(self, primitive: Any, params: dict[str, Any]) -> None:
        self.primitive = primitive
        self.params = params

    def __call__(self, *args: Any) -> Any:
        if self.primitive.name in _SUBFUN_PRIMITIVES:  # a jaxpr parameter binds as a sub-function (shard_map)
            bound = self.primitive.get_bind_params(self.params)
            if isinstance(bound, tuple):  # older JAX: (subfuns, params)
                return list(self.primitive.bind(*bound[0], *args, **bound[1]))
            return list(self.primitive.bind(*args, **bound))  # its results (newer JAX: a FlatTree)
        return self.primitive.bind(*args, **self.params)

    @property
    def multiple_results(self) -> bool:
        return bool(self.primitive.multiple_results)

    def __repr__(self) -> str:
        return f"<jax primitive {self.primitive.name}>"


class ShardingPassThrough(PrimitiveCall):
    """A loaded `sharding_constraint` op: the constraint only places its input, so its value
    is the input's (the saved record keeps the sharding's description; the devices it named
    need not exist where the trace is loaded)."""

    __slots__ = ()

    def __init__(self, primitive: Any) -> None:
        super().__init__(primitive, {})

    def __call__(self, *args: Any) -> Any:
        return args[0]

    def __repr__(self) -> str:
        return "<jax sharding_constraint (pass-through after load)>"


class ShardedPrimitiveCall(PrimitiveCall):
    """A loaded op that read arrays sharded over several devices: its inputs are placed on a
    mesh of the recorded axes with the recorded partition specs before the primitive binds
    (a sharded computation can differ from a one-device one in the last bit). Re-bound only
    where the process has that many devices."""

    __slots__ = ("shardings",)

    def __init__(self, primitive: Any, params: dict[str, Any], shardings: tuple) -> None:
        super().__init__(primitive, params)
        self.shardings = shardings

    def __call__(self, *args: Any) -> Any:
        placed = [a if s is None or not isinstance(a, (jax.Array, np.ndarray)) else jax.device_put(a, named_sharding(s))
                  for a, s in zip(args, self.shardings)]
        return super().__call__(*placed, *args[len(placed):])

    def __repr__(self) -> str:
        return f"<jax primitive {self.primitive.name} (sharded inputs)>"


def sharding_data(value: Any) -> dict[str, Any] | None:
    """A value's placement as plain data when it is a NamedSharding over more than one device:
    {"axes": ((name, size), ...), "types": (axis type names), "spec": (partition entries)};
    None otherwise (one device, or a sharding with no mesh)."""
    sh = getattr(value, "sharding", None)
    if not isinstance(sh, jax.sharding.NamedSharding) or len(sh.device_set) <= 1:
        return None
    spec = []
    for entry in sh.spec:
        if entry is None or type(entry) is str:
            spec.append(entry)
        elif isinstance(entry, tuple) and all(type(e) is str for e in entry):
            spec.append(tuple(entry))
        else:  # UNCONSTRAINED or an unknown entry: not data this backend can rebuild
            return None
    mesh = sh.mesh
    types = tuple(getattr(t, "name", str(t)) for t in getattr(mesh, "axis_types", ()))
    return {"axes": tuple((str(n), int(k)) for n, k in mesh.shape.items()), "types": types, "spec": tuple(spec)}


def named_sharding(data: dict[str, Any]) -> Any:
    """The NamedSharding `sharding_data` described, on this process's devices."""
    names = tuple(n for n, _ in data["axes"])
    sizes = tuple(k for _, k in data["axes"])
    kwargs = {}
    if data.get("types"):
        kwargs["axis_types"] = tuple(jax.sharding.AxisType[t] for t in data["types"])
    mesh = jax.make_mesh(sizes, names, **kwargs)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*data["spec"]))


@jax.jit
def _slice_at(xs: Any, index: Any) -> Any:
    return jax.lax.dynamic_index_in_dim(xs, index, axis=0, keepdims=False)


class ScanSlice:
    """`xs[i]` along the leading axis: one scan step's slice of a scanned-over array. The
    index is a traced argument, so every step of a scan shares one compiled slice."""

    __slots__ = ("index",)
    multiple_results = False

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, xs: Any) -> Any:
        if not 0 <= self.index < xs.shape[0]:  # dynamic slicing would clamp: an index past the end is an error
            raise IndexError(f"scan slice {self.index} of an axis of length {xs.shape[0]}")
        return _slice_at(xs, np.int32(self.index))

    def __repr__(self) -> str:
        return f"<scan slice {self.index}>"


class ScanStack:
    """Stack per-step scan outputs along a new leading axis (in step order)."""

    __slots__ = ("reverse",)
    multiple_results = False

    def __init__(self, reverse: bool) -> None:
        self.reverse = reverse

    def __call__(self, *ys: Any) -> Any:
        return jax.numpy.stack(ys[::-1] if self.reverse else ys)

    def __repr__(self) -> str:
        return "<scan stack>"


# per-primitive executables ---------------------------------------------------------------

_EXECUTABLES: OrderedDict[Hashable, Any] = OrderedDict()
_EXECUTABLES_MAX = 4096


def _executable(eqn: Any) -> Any:
    """A jitted single-primitive callable for `eqn`, shared by every equation with the
    same primitive, parameters and input types (falls back to plain `bind` when the
    parameters are unhashable)."""
    prim = eqn.primitive
    params = eqn.params
    try:
        key = (prim, tuple(sorted(params.items())), tuple(_aval_key(v) for v in eqn.invars))
        hash(key)
    except TypeError:
        return PrimitiveCall(prim, params)
    fn = _EXECUTABLES.get(key)
    if fn is None:
        call = PrimitiveCall(prim, params)
        fn = jax.jit(call.__call__)
        _EXECUTABLES[key] = fn
        if len(_EXECUTABLES) > _EXECUTABLES_MAX:
            _EXECUTABLES.popitem(last=False)
    return fn


def _aval_key(v: Any) -> Hashable:
    aval = v.aval
    return (tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)), isinstance(v, Literal))


def clear_executable_cache() -> None:
    _EXECUTABLES.clear()


# the capture plan ---------------------------------------------------------------------------

@dataclass
class Traced:
    """One traced model: the closed jaxpr, its output tree, the module-call table and
    per-equation caches (sites, executables). Cached across captures of the same model
    structure and input types."""

    closed: Any
    out_tree: Any
    table: CallTable
    n_leaves: int
    #: leaf indices (into the described leaves) the forward wrote (nnx state: batch-norm
    #: running stats, RNG counters); their new values are the jaxpr's last outputs
    written: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.sites: dict[int, Hashable] = {}
        self.execs: dict[int, Any] = {}


@dataclass(frozen=True)
class _Ctx:
    scope: tuple[int, ...] = ()
    site: Hashable = None
    composites: tuple[str, ...] = ()
    region: Any = None


#: JAX's tracing machinery: frames here say how a primitive was bound, not where in the model.
_MACHINERY = frozenset({"core.py", "source_info_util.py", "traceback_util.py", "pjit.py", "linear_util.py", "api_util.py",
                        "dispatch.py", "profiler.py", "custom_derivatives.py", "api.py", "util.py", "config.py"})


def _frames_site(eqn: Any, index: int) -> Hashable:
    """The code location that emitted the equation: its Python frames (innermost first,
    JAX library code included, JAX's tracing machinery skipped) up to the module-call
    wrapper. The same code run again gives the same site; two places give two sites."""
    try:
        codes, lastis = eqn.source_info.traceback.raw_frames()
        frames = []
        for code, lasti in zip(codes, lastis):
            name = code.co_filename
            if name in _WRAPPER_FILES:
                break
            if ("jax/_src" in name or "jax\\_src" in name) and (os.path.basename(name) in _MACHINERY or "interpreters" in name):
                continue
            frames.append((code, lasti))  # one bytecode instruction: two calls on one line differ
            if len(frames) >= 32:
                break
        if frames:
            return tuple(frames)
    except Exception:  # noqa: BLE001 - source info is best effort; fall back to position
        pass
    return ("eqn", index)


def _has_markers(jaxpr: Any, depth: int = 0) -> bool:
    """True when an equation of `jaxpr` (or of a jaxpr nested in its parameters) ran inside a
    module-call marker scope."""
    for e in jaxpr.eqns:
        if call_ids(e.source_info.name_stack):
            return True
        if depth < 16:
            for v in e.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns") and _has_markers(inner, depth + 1):
                        return True
    return False


def _composite_name(primitive: str, inner: Any) -> str | None:
    """The `meta["composite"]` of ops inside an unnamed call-like equation: `"checkpoint"` for
    `jax.checkpoint` / `nnx.remat`, the decorated function's name for a `custom_vjp` /
    `custom_jvp` helper (`"custom_vjp"` for a lambda), None for other calls."""
    if primitive in ("checkpoint", "remat", "remat2"):
        return "checkpoint"
    if primitive.startswith("custom_jvp") or primitive.startswith("custom_vjp"):
        fn = getattr(getattr(inner, "debug_info", None), "func_name", None)
        return fn if isinstance(fn, str) and fn and not fn.startswith("<") else primitive[:10]
    return None


def _one_device_body(eqn: Any) -> Any:
    """A shard_map's body jaxpr when its mesh has one device and the body holds no collective
    (each shard is then the whole array, so the body runs on the inputs as they are and its
    primitives are recorded one op each); None otherwise (the shard_map is one op)."""
    mesh, body = eqn.params.get("mesh"), eqn.params.get("jaxpr")
    try:
        if int(np.prod(tuple(mesh.shape.values()))) != 1 or not hasattr(body, "eqns"):
            return None
    except Exception:  # noqa: BLE001 - an abstract or unknown mesh: keep the whole call as one op
        return None
    stack = [body]
    while stack:
        j = stack.pop()
        for e in j.eqns:
            if e.primitive.name in _COLLECTIVES:
                return None
            for v in e.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        stack.append(inner)
    return body


def _inner_jaxpr(eqn: Any) -> tuple[Any, list[Any]] | None:
    for key in ("call_jaxpr", "jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        if j is None:
            continue
        if hasattr(j, "consts") and hasattr(j, "jaxpr"):
            return j.jaxpr, list(j.consts)
        if hasattr(j, "eqns"):
            return j, []
    return None


class Interpreter:
    """Runs one capture: evaluates `traced` on concrete leaves and inputs, appending
    events to `log`."""

    def __init__(self, traced: Traced, log: EventLog, leaf_addresses: list[str], leaf_is_param: list[bool],
                 edit_plan: Any = None, rolled: bool = False) -> None:
        self.t = traced
        #: loops="rolled": each `scan` / `while` is one op (no unroll, no step cap)
        self.rolled = rolled
        #: core's EditPlan of a live capture (`intervene=`, the rerun engine): event id -> edits,
        #: applied to an event's outputs before any later equation reads them.
        self.plan = edit_plan
        self.edited: dict[int, tuple] = {}  # event id -> edited outputs (buffers and constants read later)
        self.op_events: dict[int, OpEvent] = {}  # event id -> its OpEvent (value reads are noted on it)
        self.log = log
        self.addresses = leaf_addresses
        self.is_param = leaf_is_param
        self.chains: dict[int, tuple[int, ...]] = {}  # event id -> runtime call chain it ran in
        self.stack: list[int] = []  # open runtime calls
        self.next_call = 0  # the next traced (static) call id to open
        # Runtime module calls: the traced call table names each call once, but a call inside a
        # loop body runs once per iteration; each iteration opens its own runtime call (with the
        # next call number of its address), like a Python loop.
        self.rt_calls: list[tuple[str, int, int]] = []  # runtime id -> (address, call number, parent runtime id)
        self.rt_counts: dict[str, int] = {}
        self.rt_of: dict[int, int] = {}  # traced call id -> its latest runtime call id
        self._loop_ranges: dict[Hashable, tuple[int, int] | None] = {}  # loop eqn / cond branch -> traced calls
        self.multi_device = jax.device_count() > 1  # then an op's sharded inputs are recorded (meta["in_shardings"])
        self.enters: dict[int, ModuleEnter] = {}
        self.exits: dict[int, ModuleExit] = {}
        self.materialized: dict[Any, tuple] = {}
        self._stack_cache: dict[int, tuple[tuple[str, int], ...]] = {}
        self._inner_site: dict[int, int] = {}  # id(inner jaxpr) -> id of the first call equation evaluating it
        self._stale = 0  # > 0 while evaluating a reused inner jaxpr (its markers are not this call's)

    # entry ------------------------------------------------------------------------------
    def run(self, leaves: list[Any], inputs: list[tuple[str, Any]]) -> list[tuple[Any, tuple]]:
        """Evaluate; returns the output (value, source) pairs. Inputs are (path, value)."""
        jaxpr = self.t.closed.jaxpr
        args: list[tuple[Any, tuple]] = []
        for addr, value, is_param in zip(self.addresses, leaves, self.is_param):
            args.append((value, ("param", addr) if is_param else ("buffer", addr, value)))
        for path, value in inputs:
            eid = self.log.new_id()
            value = self.edit(eid, (value,))[0]
            shape, dtype = shape_dtype(value)
            self.log.append(OpEvent(eid, "input", "input", outputs=(value,), shapes=(shape,), dtypes=(dtype,), path=path))
            self.chains[eid] = ()
            args.append((value, ("ev", eid, 0)))
        self._sync(0)
        consts = [(c, ("const", c)) for c in self.t.closed.consts]
        outs = self._eval(jaxpr, consts, args, _Ctx())
        while self.next_call < len(self.t.table.calls):
            self._open(self.next_call)
        self._pop_to(-1)
        return outs

    def _note_read(self, src: tuple, read: str) -> None:
        """Control flow read a recorded value into Python (a cond's branch index, a while
        loop's predicate): note it on the producing op (`meta["value_reads"]`), so a replay
        whose edit changes what the read gives refuses (`replay_value_read_changed`) rather
        than follow the branch the capture took."""
        if src[0] != "ev":
            return
        ev = self.op_events.get(src[1])
        if ev is None:
            return
        reads = set(ev.meta.get("value_reads", ()))
        reads.add((src[2], read))
        ev.meta["value_reads"] = tuple(sorted(reads))

    def edit(self, eid: int, outs: tuple) -> tuple:
        """`outs` with the live edits the plan holds for event `eid` applied (unchanged when
        none): what the event records and what every later equation reads."""
        if self.plan is None or eid not in self.plan:
            return outs
        new = tuple(self.plan.apply(eid, tuple(outs)))
        self.edited[eid] = new
        return new

    # module calls ---------------------------------------------------------------------------
    def _open(self, cid: int) -> None:
        addr, _, sparent = self.t.table.calls[cid]
        parent = self.rt_of.get(sparent, -1) if sparent >= 0 else -1
        self._pop_to(parent)
        n = self.rt_counts.get(addr, 0) + 1
        self.rt_counts[addr] = n
        rt = len(self.rt_calls)
        self.rt_calls.append((addr, n, parent))
        self.rt_of[cid] = rt
        ev = ModuleEnter(addr, n)
        self.enters[rt] = ev
        self.log.append(ev)
        self.stack.append(rt)
        self.next_call = cid + 1

    def _pop_to(self, parent: int) -> None:
        if parent >= 0 and parent not in self.stack:
            return
        while self.stack and self.stack[-1] != parent:
            rt = self.stack.pop()
            addr, n, _ = self.rt_calls[rt]
            ev = ModuleExit(addr, n)
            self.exits[rt] = ev
            self.log.append(ev)

    def _sync(self, cid: int) -> int:
        """Emit the module enter/exit events that lead from the open calls to traced call
        `cid`; returns the runtime call it now is."""
        while self.next_call <= cid:
            self._open(self.next_call)
        rt = self.rt_of[cid]
        if rt in self.stack:
            self._pop_to(rt)
        return rt

    def _chain(self, rt: int) -> tuple[int, ...]:
        """Runtime call ids from the root call to `rt`, inclusive."""
        out = []
        while rt >= 0:
            out.append(rt)
            rt = self.rt_calls[rt][2]
        return tuple(reversed(out))

    def _module_stack(self, rt: int) -> tuple[tuple[str, int], ...]:
        st = self._stack_cache.get(rt)
        if st is None:
            st = tuple((self.rt_calls[c][0], self.rt_calls[c][1]) for c in self._chain(rt))
            self._stack_cache[rt] = st
        return st

    def _loop_range(self, key: Hashable, bodies: list[Any], ctx: _Ctx) -> tuple[int, int] | None:
        """The traced calls a loop's body jaxprs (or a cond branch) open: (first, last) ids,
        contiguous in entry order (the body was traced in one stretch), with trailing calls
        nested in them; None when the body calls no module (or its markers are a reused
        jaxpr's). Cached under `key` (the equation's id, with the branch for a cond)."""
        if key in self._loop_ranges:
            return self._loop_ranges[key]
        ids: set[int] = set()
        stack = list(bodies)
        while stack:
            j = stack.pop()
            for e in j.eqns:
                ids.update(call_ids(e.source_info.name_stack))
                for v in e.params.values():
                    for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                        inner = getattr(sub, "jaxpr", sub)
                        if hasattr(inner, "eqns"):
                            stack.append(inner)
        ids -= set(ctx.scope)
        span = None
        if ids and not self._stale:
            lo, hi = min(ids), max(ids)
            calls = self.t.table.calls
            while hi + 1 < len(calls) and lo <= calls[hi + 1][2] <= hi:  # a call nested in one of the body's
                hi += 1
            span = (lo, hi)
        self._loop_ranges[key] = span
        return span

    def _next_iteration(self, span: tuple[int, int] | None) -> None:
        """Start a loop iteration: the body's module calls open again (new runtime calls)."""
        if span is not None and self.next_call > span[0]:
            self.next_call = span[0]

    def _skip(self, span: tuple[int, int] | None) -> None:
        """A cond branch that did not run: its traced calls are never opened (calls before it
        that have not opened yet open first, in entry order)."""
        if span is None or self.next_call > span[1]:
            return
        while self.next_call < span[0]:
            self._open(self.next_call)
        self.next_call = span[1] + 1

    def _after_loop(self, span: tuple[int, int] | None) -> None:
        """A loop ended: calls of its body the last iteration did not reach (a while loop's
        body after its final predicate, a rolled loop's whole body) are not opened later."""
        if span is not None and self.next_call <= span[1]:
            self.next_call = span[1] + 1

    def _call_of(self, eqn: Any, ctx: _Ctx) -> tuple[int, tuple[int, ...]]:
        if self._stale:  # a reused inner jaxpr: its module markers belong to its first call site
            return (ctx.scope[-1] if ctx.scope else 0), ctx.scope
        scope = ctx.scope + call_ids(eqn.source_info.name_stack)
        return (scope[-1] if scope else 0), scope

    # sources ---------------------------------------------------------------------------------
    def _materialize(self, src: tuple, rt: int) -> tuple:
        """A parent reference `("ev", id, slot)` for a value source, creating the buffer or
        constant event (in runtime call `rt`) on first use."""
        if src[0] == "ev":
            return src
        key = (src[0], src[1]) if src[0] == "buffer" else ("const", id(src[1]))
        done = self.materialized.get(key)
        if done is not None:
            return done
        value = src[2] if src[0] == "buffer" else src[1]
        value = value if isinstance(value, jax.Array) else jax.numpy.asarray(value)
        eid = self.log.new_id()
        value = self.edit(eid, (value,))[0]
        kind = "buffer" if src[0] == "buffer" else "constant"
        shape, dtype = shape_dtype(value)
        self.log.append(OpEvent(eid, kind, kind, outputs=(value,), shapes=(shape,), dtypes=(dtype,),
                                module_stack=self._module_stack(rt), path=src[1] if kind == "buffer" else "constant",
                                meta={"source": "closure"} if kind == "constant" else {}))
        self.chains[eid] = self._chain(rt)
        ref = ("ev", eid, 0)
        self.materialized[key] = ref
        if src[0] == "const":
            self._keep = getattr(self, "_keep", [])
            self._keep.append(src[1])  # keep the id stable for the whole capture
        return ref

    @staticmethod
    def _read(env: dict, v: Any) -> tuple[Any, tuple]:
        if isinstance(v, Literal):
            val = v.val
            if np.ndim(val) == 0:
                return val, ("lit",)
            return val, ("const", val)
        return env[v]

    # evaluation --------------------------------------------------------------------------------
    def _eval(self, jaxpr: Any, consts: list, args: list, ctx: _Ctx) -> list[tuple[Any, tuple]]:
        env: dict[Any, tuple[Any, tuple]] = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c
        for v, a in zip(jaxpr.invars, args):
            env[v] = a
        top = ctx.site is None
        for idx, eqn in enumerate(jaxpr.eqns):
            ins = [self._read(env, v) for v in eqn.invars]
            if top:
                site = self.t.sites.get(id(eqn))
                if site is None:
                    site = self.t.sites[id(eqn)] = _frames_site(eqn, idx)
            else:
                site = (ctx.site, idx)
            name = eqn.primitive.name
            cid, scope = self._call_of(eqn, ctx)
            inner = _inner_jaxpr(eqn) if name in CALL_PRIMITIVES else None
            if inner is not None and len(inner[0].invars) == len(ins):
                label = eqn.params.get("name") or _composite_name(name, inner[0])
                sub = _Ctx(scope, site, ctx.composites + ((str(label),) if label else ()), ctx.region)
                # JAX caches traced functions: a jitted / rematerialized function called on two
                # modules of one structure holds one inner jaxpr whose module markers name the
                # first module. A second call site of that jaxpr is attributed to its caller.
                stale = self._inner_site.setdefault(id(inner[0]), id(eqn)) != id(eqn) and _has_markers(inner[0])
                self._stale += stale
                try:
                    outs = self._eval(inner[0], [(c, ("const", c)) for c in inner[1]], ins, sub)
                finally:
                    self._stale -= stale
            elif name == "cond":
                outs = self._cond(eqn, ins, site, scope, ctx)
            elif name in ("while", "scan") and self.rolled:  # one op; its body's module calls stay unopened
                bodies = [eqn.params["jaxpr"]] if name == "scan" else [eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]]
                span = self._loop_range(id(eqn), [b.jaxpr for b in bodies], ctx)
                outs = self._primitive(eqn, ins, site, cid, ctx)
                self._after_loop(span)
            elif name == "while":
                outs = self._while(eqn, ins, site, scope, ctx)
            elif name == "shard_map" and _one_device_body(eqn) is not None:
                body = _one_device_body(eqn)
                sub = _Ctx(scope, (site, "shard_map"), ctx.composites + ("shard_map",), ctx.region)
                outs = self._eval(body, [], ins, sub)
            elif name == "custom_linear_solve":
                outs = self._linear_solve(eqn, ins, site, scope, ctx)
            elif name == "scan" and 0 < eqn.params["length"]:
                outs = self._scan(eqn, ins, site, scope, ctx, cid)
            else:
                outs = self._primitive(eqn, ins, site, cid, ctx)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [self._read(env, v) for v in jaxpr.outvars]

    def _primitive(self, eqn: Any, ins: list, site: Hashable, cid: int, ctx: _Ctx) -> list:
        run = self.t.execs.get(id(eqn))
        if run is None:
            run = self.t.execs[id(eqn)] = _executable(eqn)
        meta = _costs(eqn)
        if _inner_jaxpr(eqn) is not None or eqn.primitive.name in ("cond", "while", "scan"):
            meta["opaque_region"] = True
        else:  # what re-binds the primitive after a load (artifacts hold no code)
            meta["primitive"] = eqn.primitive.name
            meta["primitive_params"] = dict(eqn.params)
        return self._emit(eqn.primitive.name, PrimitiveCall(eqn.primitive, eqn.params), run, ins, site, cid, ctx, meta,
                          bool(eqn.primitive.multiple_results))

    def _emit(self, name: str, func: Any, run: Any, ins: list, site: Hashable, cid: int, ctx: _Ctx, meta: dict,
              multiple: bool) -> list:
        rt = self._sync(cid)
        parents: list[tuple[int, int]] = []
        template: list[Any] = []
        params: list[str] = []
        vals = []
        for val, src in ins:
            vals.append(val)
            kind = src[0]
            if kind == "lit":
                template.append(val)
            elif kind == "param":
                template.append(ArgRef(address=src[1]))
                params.append(src[1])
            else:
                ref = self._materialize(src, rt)
                template.append(ArgRef(index=len(parents)))
                parents.append((ref[1], ref[2]))
                if kind != "ev" and ref[1] in self.edited:  # an edited buffer or constant: read its edited value
                    vals[-1] = self.edited[ref[1]][ref[2]]
        if self.multi_device:
            placed = tuple(sharding_data(v) for v in vals)
            if any(p is not None for p in placed):
                meta["in_shardings"] = placed
        out = run(*vals)
        outs = list(out) if multiple else [out]
        if ctx.composites:
            meta["composite"] = ctx.composites[-1]
            meta["composites"] = ctx.composites
        if ctx.region is not None:
            meta["region"] = ctx.region
        eid = self.log.new_id()
        outs = list(self.edit(eid, tuple(outs)))
        sd = [shape_dtype(o) for o in outs]
        ev = OpEvent(
            eid, "op", name, parents=tuple(parents), outputs=tuple(outs), shapes=tuple(s for s, _ in sd),
            dtypes=tuple(d for _, d in sd), module_stack=self._module_stack(rt), site=site,
            params=tuple(dict.fromkeys(params)), multi_output=multiple, func=func, args_template=tuple(template), meta=meta)
        self.op_events[eid] = ev
        self.log.append(ev)
        self.chains[eid] = self._chain(rt)
        return [(o, ("ev", eid, i)) for i, o in enumerate(outs)]

    # control flow ------------------------------------------------------------------------------
    def _cond(self, eqn: Any, ins: list, site: Hashable, scope: tuple, ctx: _Ctx) -> list:
        index = int(np.asarray(ins[0][0]))
        self._note_read(ins[0][1], "__int__")
        branches = eqn.params["branches"]
        index = min(max(index, 0), len(branches) - 1)
        branch = branches[index]
        # module calls of the branches not taken are never opened (in a loop, every iteration)
        spans = [self._loop_range((id(eqn), j), [b.jaxpr], ctx) for j, b in enumerate(branches)]
        mine = spans[index]
        later = []
        for j, span in enumerate(spans):
            if j == index or span is None:
                continue
            if mine is None or span[1] < mine[0]:
                self._skip(span)
            else:
                later.append(span)
        sub = _Ctx(scope, (site, "cond", index), ctx.composites, {"kind": "cond", "branch": index})
        outs = self._eval(branch.jaxpr, [(c, ("const", c)) for c in branch.consts], ins[1:], sub)
        for span in later:
            self._skip(span)
        return outs

    def _linear_solve(self, eqn: Any, ins: list, site: Hashable, scope: tuple, ctx: _Ctx) -> list:
        """`lax.custom_linear_solve` evaluates its `solve` jaxpr on its constants and the right-hand
        side (what its impl runs); the solve's primitives are recorded one op each."""
        lengths, jaxprs = eqn.params["const_lengths"], eqn.params["jaxprs"]
        start = lengths.matvec + lengths.vecmat
        consts, b = ins[start:start + lengths.solve], ins[sum(lengths):]
        solve = jaxprs.solve
        sub = _Ctx(scope, (site, "linear_solve"), ctx.composites + ("custom_linear_solve",), ctx.region)
        return self._eval(solve.jaxpr, [(c, ("const", c)) for c in solve.consts], consts + b, sub)

    def _while(self, eqn: Any, ins: list, site: Hashable, scope: tuple, ctx: _Ctx) -> list:
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
        span = self._loop_range(id(eqn), [cj.jaxpr, bj.jaxpr], ctx)
        for it in range(MAX_UNROLL + 1):
            if it:
                self._next_iteration(span)
            if it == MAX_UNROLL:
                raise BackendUnsupportedError(
                    "value_dependent_branch_unsupported",
                    f"a while_loop ran more than {MAX_UNROLL} iterations; the jax backend unrolls loops to record them",
                    remedy="trace with loops=\"rolled\" (each loop one op), trace a shorter loop, or raise "
                       "torchlens_jax.interpret.MAX_UNROLL", primitive="while")
            region = {"kind": "while", "iteration": it}
            pred, pred_src = self._eval(cj.jaxpr, [(c, ("const", c)) for c in cj.consts], cconsts + carry,
                                        _Ctx(scope, (site, "while_cond"), ctx.composites, region))[0]
            self._note_read(pred_src, "__bool__")
            if not bool(np.asarray(pred)):
                break
            carry = self._eval(bj.jaxpr, [(c, ("const", c)) for c in bj.consts], bconsts + carry,
                               _Ctx(scope, (site, "while_body"), ctx.composites, region))
        self._after_loop(span)
        return carry

    def _scan(self, eqn: Any, ins: list, site: Hashable, scope: tuple, ctx: _Ctx, cid: int) -> list:
        p = eqn.params
        nc, ncar, length, reverse = p["num_consts"], p["num_carry"], p["length"], p["reverse"]
        if length > MAX_UNROLL:
            raise BackendUnsupportedError(
                "value_dependent_branch_unsupported",
                f"a scan of length {length} exceeds the {MAX_UNROLL}-step unroll cap of the jax backend",
                remedy="trace with loops=\"rolled\" (each scan one op, any length), trace a shorter scan, or raise "
                       "torchlens_jax.interpret.MAX_UNROLL", primitive="scan")
        body = p["jaxpr"]
        consts, carry, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
        per_step: list[list] = []
        span = self._loop_range(id(eqn), [body.jaxpr], ctx)
        for i in (range(length - 1, -1, -1) if reverse else range(length)):
            if per_step:
                self._next_iteration(span)
            region = {"kind": "scan", "iteration": i}
            step_ctx = _Ctx(scope, (site, "scan_body"), ctx.composites, region)
            x_i = []
            for k, x in enumerate(xs):
                fn = ScanSlice(i)
                x_i += self._emit("scan_slice", fn, fn, [x], (site, "scan_slice", k), cid, step_ctx,
                                  {"scan_op": {"op": "slice", "index": i}}, False)
            outs = self._eval(body.jaxpr, [(c, ("const", c)) for c in body.consts], consts + carry + x_i, step_ctx)
            carry, ys = outs[:ncar], outs[ncar:]
            per_step.append(ys)
        self._after_loop(span)
        stacked = []
        for k in range(len(per_step[0]) if per_step else 0):
            fn = ScanStack(reverse)
            stacked += self._emit("scan_stack", fn, fn, [ys[k] for ys in per_step], (site, "scan_stack", k), cid,
                                  _Ctx(scope, site, ctx.composites, {"kind": "scan"}),
                                  {"scan_op": {"op": "stack", "reverse": bool(reverse)}}, False)
        return list(carry) + stacked

    # module call inputs and outputs ----------------------------------------------------------
    def finish_module_calls(self, events: list[Any]) -> None:
        """Fill each ModuleEnter's inputs and ModuleExit's outputs: values that cross the
        call's boundary (produced outside and read inside, or produced inside and read
        outside, including by the model output)."""
        ins: dict[int, dict] = {}
        outs: dict[int, dict] = {}
        for ev in events:
            if not isinstance(ev, OpEvent) or not ev.parents:
                continue
            mine = set(self.chains.get(ev.id, ()))
            for ref in ev.parents:
                theirs = set(self.chains.get(ref[0], ()))
                for c in theirs - mine:
                    outs.setdefault(c, {})[ref] = None
                for c in mine - theirs:
                    ins.setdefault(c, {})[ref] = None
        for cid, ev in self.enters.items():
            ev.input_ids = tuple(ins.get(cid, {}))
        for cid, ev in self.exits.items():
            ev.output_ids = tuple(outs.get(cid, {}))


def shape_dtype(value: Any) -> tuple[tuple[int, ...], str]:
    """A value's recorded shape and dtype. A typed PRNG key array is recorded with the shape
    of its raw key data (what `host_copy` returns) and its key dtype name."""
    dtype = value.dtype
    if type(dtype) is not np.dtype and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return tuple(jax.random.key_data(value).shape), str(dtype)
    return tuple(value.shape), str(dtype)


def _costs(eqn: Any) -> dict[str, Any]:
    """MACs and FLOPs of the contraction primitives (dot_general, conv), from the avals."""
    name = eqn.primitive.name
    try:
        if name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = int(np.prod([lhs[d] for d in lc])) if lc else 1
            macs = int(np.prod(eqn.outvars[0].aval.shape)) * k
            return {"macs": macs, "flops": 2 * macs}
        if name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape
            dn = eqn.params["dimension_numbers"]
            out_c = rhs[dn.rhs_spec[0]]
            per_out = int(np.prod(rhs)) // max(int(out_c), 1)
            macs = int(np.prod(eqn.outvars[0].aval.shape)) * per_out
            return {"macs": macs, "flops": 2 * macs}
    except Exception:  # noqa: BLE001 - costs are an extra, never a reason to fail
        return {}
    return {}
