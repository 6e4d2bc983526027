"""Evaluate a jaxpr one primitive equation at a time and emit core events.

Call-like equations (`jit`/`pjit`, `closed_call`, `custom_jvp_call`, `custom_vjp_call`,
`checkpoint`) are stepped into, so the primitives inside `relu`, `softmax`, `gelu` or a
layer norm are recorded one op each. Control flow is unrolled with real values: `cond`
follows the branch its index selects, `while` and `scan` run their bodies iteration by
iteration (a scan's per-step slices and final stacking are recorded as `scan_slice` and
`scan_stack` ops), up to `MAX_UNROLL` iterations; past that the capture refuses with
`value_dependent_branch_unsupported` rather than record a partial loop.

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
        return self.primitive.bind(*args, **self.params)

    @property
    def multiple_results(self) -> bool:
        return bool(self.primitive.multiple_results)

    def __repr__(self) -> str:
        return f"<jax primitive {self.primitive.name}>"


class ScanSlice:
    """`xs[i]` along the leading axis: one scan step's slice of a scanned-over array."""

    __slots__ = ("index",)
    multiple_results = False

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, xs: Any) -> Any:
        return jax.lax.index_in_dim(xs, self.index, axis=0, keepdims=False)

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

    def __init__(self, traced: Traced, log: EventLog, leaf_addresses: list[str], leaf_is_param: list[bool]) -> None:
        self.t = traced
        self.log = log
        self.addresses = leaf_addresses
        self.is_param = leaf_is_param
        self.chains: dict[int, tuple[int, ...]] = {}  # event id -> call chain it ran in
        self.stack: list[int] = []
        self.next_call = 0
        self.enters: dict[int, ModuleEnter] = {}
        self.exits: dict[int, ModuleExit] = {}
        self.materialized: dict[Any, tuple] = {}
        self._stack_cache: dict[int, tuple[tuple[str, int], ...]] = {}

    # entry ------------------------------------------------------------------------------
    def run(self, leaves: list[Any], inputs: list[tuple[str, Any]]) -> list[tuple[Any, tuple]]:
        """Evaluate; returns the output (value, source) pairs. Inputs are (path, value)."""
        jaxpr = self.t.closed.jaxpr
        args: list[tuple[Any, tuple]] = []
        for addr, value, is_param in zip(self.addresses, leaves, self.is_param):
            args.append((value, ("param", addr) if is_param else ("buffer", addr, value)))
        for path, value in inputs:
            eid = self.log.new_id()
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

    # module calls ---------------------------------------------------------------------------
    def _open(self, cid: int) -> None:
        self._pop_to(self.t.table.calls[cid][2])
        addr, n, _ = self.t.table.calls[cid]
        ev = ModuleEnter(addr, n)
        self.enters[cid] = ev
        self.log.append(ev)
        self.stack.append(cid)
        self.next_call = cid + 1

    def _pop_to(self, parent: int) -> None:
        if parent >= 0 and parent not in self.stack:
            return
        while self.stack and self.stack[-1] != parent:
            cid = self.stack.pop()
            addr, n, _ = self.t.table.calls[cid]
            ev = ModuleExit(addr, n)
            self.exits[cid] = ev
            self.log.append(ev)

    def _sync(self, cid: int) -> None:
        """Emit the module enter/exit events that lead from the open calls to `cid`."""
        while self.next_call <= cid:
            self._open(self.next_call)
        if cid in self.stack:
            self._pop_to(cid)

    def _module_stack(self, cid: int) -> tuple[tuple[str, int], ...]:
        st = self._stack_cache.get(cid)
        if st is None:
            calls = self.t.table.calls
            st = tuple((calls[c][0], calls[c][1]) for c in self.t.table.chain(cid))
            self._stack_cache[cid] = st
        return st

    def _call_of(self, eqn: Any, ctx: _Ctx) -> tuple[int, tuple[int, ...]]:
        scope = ctx.scope + call_ids(eqn.source_info.name_stack)
        return (scope[-1] if scope else 0), scope

    # sources ---------------------------------------------------------------------------------
    def _materialize(self, src: tuple, cid: int) -> tuple:
        """A parent reference `("ev", id, slot)` for a value source, creating the buffer or
        constant event on first use."""
        if src[0] == "ev":
            return src
        key = (src[0], src[1]) if src[0] == "buffer" else ("const", id(src[1]))
        done = self.materialized.get(key)
        if done is not None:
            return done
        value = src[2] if src[0] == "buffer" else src[1]
        value = value if isinstance(value, jax.Array) else jax.numpy.asarray(value)
        eid = self.log.new_id()
        kind = "buffer" if src[0] == "buffer" else "constant"
        shape, dtype = shape_dtype(value)
        self.log.append(OpEvent(eid, kind, kind, outputs=(value,), shapes=(shape,), dtypes=(dtype,),
                                module_stack=self._module_stack(cid), path=src[1] if kind == "buffer" else "constant",
                                meta={"source": "closure"} if kind == "constant" else {}))
        self.chains[eid] = self.t.table.chain(cid)
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
                label = eqn.params.get("name")
                sub = _Ctx(scope, site, ctx.composites + ((str(label),) if label else ()), ctx.region)
                outs = self._eval(inner[0], [(c, ("const", c)) for c in inner[1]], ins, sub)
            elif name == "cond":
                outs = self._cond(eqn, ins, site, scope, ctx)
            elif name == "while":
                outs = self._while(eqn, ins, site, scope, ctx)
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
        self._sync(cid)
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
                ref = self._materialize(src, cid)
                template.append(ArgRef(index=len(parents)))
                parents.append((ref[1], ref[2]))
        out = run(*vals)
        outs = list(out) if multiple else [out]
        if ctx.composites:
            meta["composite"] = ctx.composites[-1]
            meta["composites"] = ctx.composites
        if ctx.region is not None:
            meta["region"] = ctx.region
        sd = [shape_dtype(o) for o in outs]
        eid = self.log.new_id()
        self.log.append(OpEvent(
            eid, "op", name, parents=tuple(parents), outputs=tuple(outs), shapes=tuple(s for s, _ in sd),
            dtypes=tuple(d for _, d in sd), module_stack=self._module_stack(cid), site=site,
            params=tuple(dict.fromkeys(params)), multi_output=multiple, func=func, args_template=tuple(template), meta=meta))
        self.chains[eid] = self.t.table.chain(cid)
        return [(o, ("ev", eid, i)) for i, o in enumerate(outs)]

    # control flow ------------------------------------------------------------------------------
    def _cond(self, eqn: Any, ins: list, site: Hashable, scope: tuple, ctx: _Ctx) -> list:
        index = int(np.asarray(ins[0][0]))
        branches = eqn.params["branches"]
        index = min(max(index, 0), len(branches) - 1)
        branch = branches[index]
        sub = _Ctx(scope, (site, "cond", index), ctx.composites, {"kind": "cond", "branch": index})
        return self._eval(branch.jaxpr, [(c, ("const", c)) for c in branch.consts], ins[1:], sub)

    def _while(self, eqn: Any, ins: list, site: Hashable, scope: tuple, ctx: _Ctx) -> list:
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
        for it in range(MAX_UNROLL + 1):
            if it == MAX_UNROLL:
                raise BackendUnsupportedError(
                    "value_dependent_branch_unsupported",
                    f"a while_loop ran more than {MAX_UNROLL} iterations; the jax backend unrolls loops to record them",
                    remedy="trace a shorter loop, or raise torchlens_jax.interpret.MAX_UNROLL", primitive="while")
            region = {"kind": "while", "iteration": it}
            pred = self._eval(cj.jaxpr, [(c, ("const", c)) for c in cj.consts], cconsts + carry,
                              _Ctx(scope, (site, "while_cond"), ctx.composites, region))[0][0]
            if not bool(np.asarray(pred)):
                break
            carry = self._eval(bj.jaxpr, [(c, ("const", c)) for c in bj.consts], bconsts + carry,
                               _Ctx(scope, (site, "while_body"), ctx.composites, region))
        return carry

    def _scan(self, eqn: Any, ins: list, site: Hashable, scope: tuple, ctx: _Ctx, cid: int) -> list:
        p = eqn.params
        nc, ncar, length, reverse = p["num_consts"], p["num_carry"], p["length"], p["reverse"]
        if length > MAX_UNROLL:
            raise BackendUnsupportedError(
                "value_dependent_branch_unsupported",
                f"a scan of length {length} exceeds the {MAX_UNROLL}-step unroll cap of the jax backend",
                remedy="trace a shorter scan, or raise torchlens_jax.interpret.MAX_UNROLL", primitive="scan")
        body = p["jaxpr"]
        consts, carry, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
        per_step: list[list] = []
        for i in (range(length - 1, -1, -1) if reverse else range(length)):
            region = {"kind": "scan", "iteration": i}
            step_ctx = _Ctx(scope, (site, "scan_body"), ctx.composites, region)
            x_i = []
            for k, x in enumerate(xs):
                fn = ScanSlice(i)
                x_i += self._emit("scan_slice", fn, fn, [x], (site, "scan_slice", k), cid, step_ctx, {}, False)
            outs = self._eval(body.jaxpr, [(c, ("const", c)) for c in body.consts], consts + carry + x_i, step_ctx)
            carry, ys = outs[:ncar], outs[ncar:]
            per_step.append(ys)
        stacked = []
        for k in range(len(per_step[0]) if per_step else 0):
            fn = ScanStack(reverse)
            stacked += self._emit("scan_stack", fn, fn, [ys[k] for ys in per_step], (site, "scan_stack", k), cid,
                                  _Ctx(scope, site, ctx.composites, {"kind": "scan"}), {}, False)
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
