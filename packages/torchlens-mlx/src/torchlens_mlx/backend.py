"""The MLX backend: records every `mlx.core` call of a forward as core events.

Written on `torchlens.backends.sdk` only (the dependency test checks it). A capture wraps the
framework (`torchlens_mlx.patch`), runs the forward under `mx.disable_compile()` so compiled
functions run op by op through the wrappers, evaluates each recorded output once
(`mx.eval`), and restores every wrapped object in a `finally`.

Randomness (`rng_replay=True`): a draw with `key=` records the key as an argument; a keyless
draw consumes MLX's global key, and the recorder reads that key before the call and stores
the half of its split the draw used (`op.meta["rng_key"]`), which replay passes as `key=`. The
capture reads the global state without advancing it, so a traced forward consumes randomness
exactly as a plain one. `replay_rng=` is accepted as a bool; both values capture the same (the
keys are always recorded). `CaptureOptions(seed=)` is refused by core for every preview
backend (`explicit_seed_unsupported`): seed with `mx.random.seed` or pass keys.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from torchlens.backends.sdk import (
    ArgRef,
    BackendCapabilities,
    BackendUnsupportedError,
    EventLog,
    InvalidArgumentError,
    ModelInfo,
    ModuleEnter,
    ModuleExit,
    ModuleInfo,
    OpEvent,
    ParamInfo,
    Provenance,
    ReentrantTraceError,
    TraceCaptureError,
    ValidationStatus,
    apply_save,
    build_trace,
    call_site,
    check_requested_capabilities,
    foreign_leaf,
    keyword_path,
    leaf_paths,
    module_parents,
    positional_path,
    refusal_codes_for,
    save_plan,
)
from torchlens_mlx import __version__, patch
from torchlens_mlx.plugin import FRAMEWORK

_RANDOM = "mlx.core.random."
#: the framework's own `view`/`astype`, bound at import (before any capture wraps them), for
#: the backend's bookkeeping on bfloat16 arrays, which must never be recorded as ops
_VIEW, _ASTYPE = mx.view, mx.array.astype


def snapshot(a: Any) -> Any:
    """A new array object holding `a`'s current value (an in-place op on `a` later leaves it alone)."""
    return mx.array(a)


def _buffer_key(a: Any) -> tuple:
    """Where an evaluated array's data lives, with its shape and dtype: `mx.compile`d functions
    (also with compilation disabled) hand their body new Python objects for the same arrays,
    so a value seen under a new object is found by its buffer (address, shape, strides: a
    transposed view of a square matrix is not the matrix)."""
    h = np.asarray(_VIEW(a, mx.uint16) if a.dtype == mx.bfloat16 else a)  # numpy has no bfloat16; a view shares the buffer
    return (h.__array_interface__["data"][0], h.shape, h.strides, str(a.dtype))


def _leaf_paths(obj: Any, path: str) -> list[tuple[str, Any]]:
    return leaf_paths(obj, path, _is_leaf)


def _is_leaf(obj: Any) -> bool:
    return isinstance(obj, mx.array)


def _foreign(obj: Any) -> str | None:
    """The type name of the first array of another framework (or numpy) inside `obj`, if any."""
    return foreign_leaf(obj, ("torch", "jax", "jaxlib", "tensorflow"))


class _Recorder:
    """Turns wrapped calls into `OpEvent`s and module calls into enter/exit events."""

    def __init__(self, model: Any, modules: list[tuple[str, Any]], log: EventLog, wrapper_code: Any) -> None:
        self.log = log
        self.busy = False
        self.addr_of = {id(m): a for a, m in modules}
        self.param_addr: dict[int, str] = {}
        self.producer: dict[int, tuple[int, int]] = {}
        self.by_buffer: dict[tuple, tuple[int, int]] = {}
        self.events_by_id: dict[int, Any] = {}
        self.param_buffer: dict[tuple, str] = {}
        self.alive: list[Any] = []  # keeps ids stable during the capture
        self.stack: list[tuple[str, int]] = []
        self.objs: list[Any] = []
        self.calls: dict[str, int] = {}
        self.edit_plan: Any = None
        self.wrapper_code = wrapper_code

    # sources ------------------------------------------------------------------------------
    def source(self, kind: str, value: Any, path: str) -> tuple[int, int]:
        i = self.log.new_id()
        mx.eval(value)
        self._append(OpEvent(i, kind, kind, outputs=(value,), shapes=(tuple(value.shape),),
                                dtypes=(_dtype(value),), path=path,
                                module_stack=tuple(self.stack) if kind == "constant" else ()))
        self.register(value, (i, 0))
        return (i, 0)

    def protect(self, value: Any) -> None:
        """Payloads are the live arrays (a copy could change their memory layout, and with
        it the bits of the ops that read them); before an in-place operator writes into
        `value`, the event that produced it gets a snapshot instead."""
        src = self.lookup(value)
        if src is None:
            return
        ev = self.events_by_id[src[0]]
        if ev.outputs[src[1]] is value or self.producer.get(id(value)) == src:
            outs = list(ev.outputs)
            outs[src[1]] = snapshot(outs[src[1]])
            ev.outputs = tuple(outs)

    def register(self, value: Any, src: tuple[int, int]) -> None:
        self.producer[id(value)] = src
        self.by_buffer[_buffer_key(value)] = src
        self.alive.append(value)

    def lookup(self, value: Any) -> tuple[int, int] | None:
        src = self.producer.get(id(value))
        if src is None:
            mx.eval(value)
            src = self.by_buffer.get(_buffer_key(value))
        return src

    def param_of(self, value: Any) -> str | None:
        addr = self.param_addr.get(id(value))
        if addr is None and self.param_buffer:
            mx.eval(value)
            addr = self.param_buffer.get(_buffer_key(value))
        return addr

    def _append(self, ev: Any) -> None:
        self.events_by_id[ev.id] = ev
        self.log.append(ev)

    # ops ----------------------------------------------------------------------------------
    def before(self, qualname: str, args: tuple, kwargs: dict) -> Any:
        """Before an `mx.random` call: the global key (`record` sees whether the call consumed
        it). Before an in-place operator: the receiver's payload is protected."""
        if qualname.rpartition(".")[2] in patch.INPLACE:
            self.busy = True  # sources for arrays first seen here, before the call writes into them
            try:
                self._template((args, kwargs), [], [])
                self.protect(args[0])
            finally:
                self.busy = False
        if qualname.startswith(_RANDOM):
            self.busy = True
            try:
                state = mx.random.state[0]
                mx.eval(state)
                return snapshot(state)
            finally:
                self.busy = False
        return None

    def _template(self, obj: Any, parents: list, params: list) -> Any:
        if isinstance(obj, mx.array):
            addr = self.param_of(obj)
            if addr is not None:
                if addr not in params:
                    params.append(addr)
                return ArgRef(address=addr)
            src = self.lookup(obj)
            if src is None:
                src = self.source("constant", obj, "constant")
            parents.append(src)
            return ArgRef(index=len(parents) - 1)
        if type(obj) is tuple:
            return tuple(self._template(o, parents, params) for o in obj)
        if type(obj) is list:
            return [self._template(o, parents, params) for o in obj]
        if type(obj) is dict:
            return {k: self._template(v, parents, params) for k, v in obj.items()}
        return obj

    def record(self, name: str, func: Any, qualname: str, args: tuple, kwargs: dict, out: Any, rng: Any,
               inplace: bool = False) -> Any:
        receiver = args[0] if inplace else None
        if inplace:
            value: Any = receiver
        else:
            value = out
        if isinstance(value, mx.array):
            outs, multi = (value,), False
        elif isinstance(value, (tuple, list)) and value and all(isinstance(v, mx.array) for v in value):
            outs, multi = tuple(value), True
        else:
            return out  # not an array-producing call
        self.busy = True
        try:
            site = call_site(sys._getframe(2), self.wrapper_code)
            parents: list[tuple[int, int]] = []
            params: list[str] = []
            # in-place: the receiver's value before the write is the parent
            args_t = self._template(args, parents, params)
            kwargs_t = self._template(kwargs, parents, params)
            i = self.log.new_id()
            if self.edit_plan is not None and i in self.edit_plan:
                edited = tuple(self.edit_plan.apply(i, outs))
                if not inplace:
                    outs = edited
                    out = edited[0] if not multi else type(value)(edited)
            mx.eval(*outs)
            meta: dict[str, Any] = {"qualname": qualname}
            if rng is not None:
                now = mx.random.state[0]
                mx.eval(now)
                if not bool(mx.array_equal(now, rng)):
                    # a keyless draw: it used the second half of splitting the global key,
                    # which replay passes as an explicit key= (a list of ints: saved files carry it)
                    meta["rng_key"] = mx.random.split(rng)[1].tolist()
            self._append(OpEvent(
                i, "op", name, parents=tuple(parents), outputs=tuple(outs),
                shapes=tuple(tuple(o.shape) for o in outs), dtypes=tuple(_dtype(o) for o in outs),
                module_stack=tuple(self.stack), site=(qualname, site), params=tuple(params), multi_output=multi,
                func=func, args_template=args_t, kwargs_template=kwargs_t, is_inplace=inplace, meta=meta))
            for slot, o in enumerate(outs):
                self.register(o, (i, slot))
        finally:
            self.busy = False
        return out

    # module scopes --------------------------------------------------------------------------
    def enter(self, module: Any, args: tuple, kwargs: dict) -> None:
        addr = self.addr_of.get(id(module), f"<unregistered {type(module).__name__}>")
        n = self.calls.get(addr, 0) + 1
        self.calls[addr] = n
        self.stack.append((addr, n))
        self.objs.append(module)
        ins = tuple(s for s in (self.lookup(a) for _p, a in _leaf_paths((args, kwargs), "")) if s is not None)
        self.log.append(ModuleEnter(addr, n, ins))

    def exit(self, out: Any) -> None:
        addr, n = self.stack.pop()
        self.objs.pop()
        outs = tuple(s for s in (self.lookup(o) for _p, o in _leaf_paths(out, "")) if s is not None)
        self.log.append(ModuleExit(addr, n, outs))


def _dtype(a: Any) -> str:
    return str(a.dtype).replace("mlx.core.", "")



def _module_call_wrapper(original: Any) -> Any:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = patch.ACTIVE.recorder
        if rec is None or rec.busy or (rec.objs and rec.objs[-1] is self):
            return original(self, *args, **kwargs)
        rec.enter(self, args, kwargs)
        out = original(self, *args, **kwargs)
        rec.exit(out)
        return out

    __call__.__torchlens_original__ = original  # type: ignore[attr-defined]
    return __call__


_WRAPPER_CODE = _module_call_wrapper(lambda *a: None).__code__


def model_modules(model: Any) -> list[tuple[str, Any]]:
    """(address, module) pairs, root first as "self"; a plain function is the one root."""
    if not isinstance(model, nn.Module):
        return [("self", model)]
    out: list[tuple[str, Any]] = [("self", model)]

    def walk(obj: Any, prefix: str) -> None:  # definition order, parents before children
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
        for k, v in items:
            addr = f"{prefix}{k}"
            if isinstance(v, nn.Module):
                out.append((addr, v))
                walk(v, addr + ".")
            elif isinstance(v, (dict, list, tuple)):
                walk(v, addr + ".")

    walk(model, "")
    named = {a for a, _m in model.named_modules()}
    return [(a, m) for a, m in out if a == "self" or a in named]


class MLXBackend:
    """BackendProtocol implementation for MLX (preview)."""

    name = "mlx"
    maturity = "preview"
    framework = FRAMEWORK
    materialization = "eager"
    _OPTIONS = frozenset({"save", "capture", "replay_rng"})

    def capabilities(self) -> BackendCapabilities:
        # rng_replay: every draw replays exactly, keyed (`key=` is a recorded argument) or keyless
        # (the global key the draw consumed is recorded and replayed as `key=`; module docstring)
        return BackendCapabilities(validation_replay=True, payload_materialization=True, interventions=True,
                                   backward_capture=True, rng_replay=True)

    def backward(self, trace: Any, loss: Any = None, **kwargs: Any) -> Any:
        """Fill `op.grads` of every saved op: the gradient of `loss(output)` (a callable of the
        output; None sums its float leaves), by `mx.vjp` over the recorded ops."""
        from torchlens_mlx.grads import backward

        return backward(trace, loss, **kwargs)

    def edit_ops(self) -> Any:
        from torchlens_mlx.edit_ops import MLXEditOps

        return MLXEditOps()

    def attach_module_edits(self, model: Any, rules: list, ops: Any, fired: dict) -> Any:
        from torchlens_mlx.edit_ops import attach_module_edits

        return attach_module_edits(model, model_modules(model), rules, ops, fired)

    def runtime_available(self) -> str | None:
        return None

    def trace_options(self) -> frozenset[str]:
        return self._OPTIONS

    def refusal_codes(self) -> frozenset[str]:
        return refusal_codes_for(self, {"foreign_tensor_input"})

    def can_handle(self, model: Any, args: tuple, kwargs: dict) -> bool:
        if isinstance(model, nn.Module):
            return True
        return callable(model) and any(isinstance(v, mx.array) for _p, v in _leaf_paths((args, kwargs), ""))

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, mx.array)

    def host_copy(self, value: Any) -> np.ndarray:
        mx.eval(value)
        if value.dtype == mx.bfloat16:  # numpy has no bfloat16: float32 holds every value exactly
            return np.array(_ASTYPE(value, mx.float32), copy=True)
        return np.array(value, copy=True)

    def from_host(self, values: Any, like: Any) -> Any:
        a = mx.array(np.asarray(values))
        return a if like is None else a.astype(like.dtype)

    def payload_codec(self) -> Any:
        from torchlens_mlx.codec import MLXCodec

        return MLXCodec()

    def realize_once(self, values: Any) -> Any:
        return values

    def resolve_callable(self, qualname: str) -> Any:
        """Saved op callables come back only from the closed table of wrapped framework calls."""
        if qualname.startswith("torchlens_mlx.patch.at_") and qualname.rpartition("at_")[2] in patch.AT_METHODS:
            return getattr(patch, qualname.rpartition(".")[2])
        if qualname.startswith("torchlens_mlx.patch.prop_"):
            name = qualname.rpartition("prop_")[2]
            return patch.property_getter(name) if name in patch.array_table() else None
        if qualname.startswith("mlx.core.array."):
            return patch.array_table().get(qualname.rpartition(".")[2])
        return patch.function_table().get(qualname)

    def reference_output(self, model: Any, args: tuple, kwargs: dict) -> Any:
        out = model(*args, **kwargs)
        mx.eval(*[v for _p, v in _leaf_paths(out, "")])
        return out

    def _check_inputs(self, model: Any, args: tuple, kwargs: dict) -> None:
        if not callable(model):
            raise InvalidArgumentError("model_type_unsupported", f"{type(model).__name__} is not an mlx.nn.Module or a callable",
                                       remedy="pass an mlx.nn.Module or a function of mx.array inputs")
        foreign = _foreign((args, kwargs))
        if foreign:
            raise BackendUnsupportedError("foreign_tensor_input", f"an input is a {foreign}, not an mx.array",
                                       remedy="convert inputs with mx.array(...) before tracing with backend='mlx'")
        if isinstance(model, nn.Module):
            for addr, m in model_modules(model):
                for key, value in [*m.items(), *vars(m).items()]:  # arrays and plain attributes
                    foreign = _foreign([value])
                    if foreign:
                        where = key if addr == "self" else f"{addr}.{key}"
                        raise BackendUnsupportedError(
                            "foreign_tensor_input", f"the model mixes frameworks: {where} is a {foreign}",
                            remedy="hold mx.array values only in an mlx.nn model (convert with mx.array(...))",
                            backend="mlx", attribute=where)

    def capture(self, model: Any, args: tuple, kwargs: dict, save: Any = "all", capture: Any = None,
                replay_rng: bool = True, _edit_plan: Any = None, **options: Any) -> Any:
        check_requested_capabilities(self, capture, options)
        if not isinstance(replay_rng, bool):
            raise InvalidArgumentError("invalid_argument", f"replay_rng= takes a bool, not {type(replay_rng).__name__}",
                                       remedy="replay_rng=True (MLX draws always record the key they used, so they "
                                              "always replay)", option="replay_rng")
        plan = save_plan(save)
        self._check_inputs(model, args, kwargs)
        if patch.ACTIVE.recorder is not None:
            raise ReentrantTraceError("reentrant_trace", "an MLX capture is already running in this thread",
                                      remedy="trace outside the forward of another trace")
        modules = model_modules(model)
        log = EventLog()
        rec = _Recorder(model, modules, log, _WRAPPER_CODE)
        rec.edit_plan = _edit_plan
        is_module = isinstance(model, nn.Module)
        info = ModelInfo(type(model).__name__ if is_module else getattr(model, "__name__", type(model).__name__))
        parent_of = module_parents(a for a, _m in modules)
        for addr, m in modules:
            info.modules.append(ModuleInfo(addr, type(m).__name__, type(m).__qualname__, parent=parent_of.get(addr),
                                           training=bool(getattr(m, "training", False))))
        if is_module:
            trainable = {id(p) for _a, p in _flat_params(model.trainable_parameters())}
            for addr, p in _flat_params(model):
                mod, _, name = addr.rpartition(".")
                mx.eval(p)
                info.params.append(ParamInfo(addr, mod or "self", name, tuple(p.shape), _dtype(p), id(p) in trainable, p))
                rec.param_addr[id(p)] = addr
                rec.param_buffer[_buffer_key(p)] = addr
        for i, a in enumerate(args):
            for path, leaf in _leaf_paths(a, positional_path(i)):
                rec.source("input", leaf, path)
        for k, a in kwargs.items():
            for path, leaf in _leaf_paths(a, keyword_path(k)):
                rec.source("input", leaf, path)
        prov = Provenance("mlx", backend_version=__version__, framework_version=mx.__version__,
                          model_class=type(model).__name__,
                          start_time=time.time())
        start = time.perf_counter()
        patches = patch.Patches(patch.defining_classes([m for _a, m in modules if isinstance(m, nn.Module)]),
                                _module_call_wrapper)
        out: Any = None
        try:
            patch.ACTIVE.recorder = rec
            patches.install()
            mx.disable_compile()
            try:
                if is_module:
                    out = model(*args, **kwargs)
                else:
                    rec.enter(model, args, kwargs)
                    out = model(*args, **kwargs)
                    rec.exit(out)
            finally:
                mx.enable_compile()
                patches.restore()
                patch.ACTIVE.recorder = None
        except Exception as exc:
            partial = build_trace(info, log, output_state="output_forward_failed", provenance=prov, backend=self)
            raise TraceCaptureError("forward_failed", f"the forward raised {type(exc).__name__}: {exc}",
                                    remedy="fix the forward; exc.partial_trace holds the ops recorded before the failure",
                                    partial_trace=partial) from exc
        for path, leaf in _leaf_paths(out, "output"):
            src = rec.lookup(leaf)
            if src is None:  # a parameter returned as is, or a value no wrapper saw
                src = rec.source("constant", leaf, "constant")
            i = log.new_id()
            mx.eval(leaf)
            log.append(OpEvent(i, "output", "output", parents=(src,) if src else (), outputs=(leaf,),
                               shapes=(tuple(leaf.shape),), dtypes=(_dtype(leaf),), path=path))
        prov.duration = time.perf_counter() - start
        prov.end_time = time.time()
        trace = build_trace(info, log, output=out, provenance=prov, options=capture, backend=self)
        if capture is not None and (capture.backward_ready or capture.save_grads):
            from torchlens_mlx.grads import keep_for_backward

            keep_for_backward(trace, out, save_grads=bool(capture.save_grads), edit_plan=_edit_plan)
        apply_save(trace, plan)
        return trace

    def validate(self, trace: Any, ground_truth: Any = None) -> ValidationStatus:
        """Replay every op on its parents' saved values through core's replay engine and
        compare bit for bit with its saved output."""
        from torchlens.backends.sdk import replay_validate
        from torchlens_mlx.edit_ops import MLXEditOps

        gt = None if ground_truth is None else [np.asarray(v) for _p, v in _leaf_paths(ground_truth, "")]
        return replay_validate(trace, MLXEditOps(), ground_truth=gt)


def _flat_params(tree: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    if isinstance(tree, nn.Module):
        tree = tree.parameters()
    return tree_flatten(tree)
