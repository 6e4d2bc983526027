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
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from torchlens.backends.sdk import (
    BackendBase,
    BackendCapabilities,
    BackendUnsupportedError,
    EventLog,
    InvalidArgumentError,
    ModelInfo,
    OpEvent,
    ParamInfo,
    RecorderBase,
    call_site,
    foreign_leaf,
)
from torchlens_mlx import patch
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


def _foreign(obj: Any) -> str | None:
    """The type name of the first array of another framework (or numpy) inside `obj`, if any."""
    return foreign_leaf(obj, ("torch", "jax", "jaxlib", "tensorflow"))


class _Recorder(RecorderBase):
    """Turns wrapped calls into `OpEvent`s and module calls into enter/exit events."""

    def __init__(self, modules: list[tuple[str, Any]], log: EventLog, wrapper_code: Any) -> None:
        super().__init__(log, modules)
        self.busy = False
        self.by_buffer: dict[tuple, tuple[int, int]] = {}
        self.param_buffer: dict[tuple, str] = {}
        self.wrapper_code = wrapper_code

    def is_leaf(self, value: Any) -> bool:
        return isinstance(value, mx.array)

    def dtype_of(self, value: Any) -> str:
        return _dtype(value)

    def settle(self, value: Any) -> None:
        mx.eval(value)

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
        super().register(value, src)
        self.by_buffer[_buffer_key(value)] = src

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

    # ops ----------------------------------------------------------------------------------
    def before(self, qualname: str, args: tuple, kwargs: dict) -> Any:
        """Before an `mx.random` call: the global key (`record` sees whether the call consumed
        it). Before an in-place operator: the receiver's payload is protected."""
        if qualname.rpartition(".")[2] in patch.INPLACE:
            self.busy = True  # sources for arrays first seen here, before the call writes into them
            try:
                self.template((args, kwargs), [], [])
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

    def record(self, name: str, func: Any, qualname: str, args: tuple, kwargs: dict, out: Any, rng: Any,
               inplace: bool = False) -> Any:
        receiver = args[0] if inplace else None
        if inplace:
            value: Any = receiver
        else:
            value = out
        split = self.split_outputs(value)
        if split is None:
            return out  # not an array-producing call
        outs, multi = split
        self.busy = True
        try:
            site = call_site(sys._getframe(2), self.wrapper_code)
            # in-place: the receiver's value before the write is the parent
            parents, params, args_t, kwargs_t = self.arguments(args, kwargs)
            i = self.log.new_id()
            outs, out = self.apply_edits(i, outs, out, multi, inplace)
            mx.eval(*outs)
            meta: dict[str, Any] = {"qualname": qualname}
            if rng is not None:
                now = mx.random.state[0]
                mx.eval(now)
                if not bool(mx.array_equal(now, rng)):
                    # a keyless draw: it used the second half of splitting the global key,
                    # which replay passes as an explicit key= (a list of ints: saved files carry it)
                    meta["rng_key"] = mx.random.split(rng)[1].tolist()
            self.append(OpEvent(
                i, "op", name, parents=tuple(parents), outputs=tuple(outs),
                shapes=tuple(tuple(o.shape) for o in outs), dtypes=tuple(_dtype(o) for o in outs),
                module_stack=tuple(self.stack), site=(qualname, site), params=tuple(params), multi_output=multi,
                func=func, args_template=args_t, kwargs_template=kwargs_t, is_inplace=inplace, meta=meta))
            for slot, o in enumerate(outs):
                self.register(o, (i, slot))
        finally:
            self.busy = False
        return out


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


class MLXBackend(BackendBase):
    """BackendProtocol implementation for MLX (preview)."""

    name = "mlx"
    framework = FRAMEWORK
    package, edit_ops_name, codec_name = "torchlens_mlx", "MLXEditOps", "MLXCodec"
    # rng_replay: every draw replays exactly, keyed (`key=` is a recorded argument) or keyless
    # (the global key the draw consumed is recorded and replayed as `key=`; module docstring)
    CAPABILITIES = BackendCapabilities(validation_replay=True, payload_materialization=True, interventions=True,
                                       backward_capture=True, rng_replay=True)
    own_refusals = frozenset({"foreign_tensor_input"})
    module_types = (nn.Module,)
    capture_noun = "an MLX capture"
    replay_rng_note = "MLX draws always record the key they used, so they always replay"

    def module_pairs(self, model: Any) -> list[tuple[str, Any]]:
        return model_modules(model)

    def settle(self, *values: Any) -> None:
        mx.eval(*values)

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
        plan = self.open_capture(capture, options, replay_rng, save)
        self._check_inputs(model, args, kwargs)
        self.refuse_reentrant(patch.ACTIVE.recorder)
        modules = model_modules(model)
        log = EventLog()
        rec = _Recorder(modules, log, _WRAPPER_CODE)
        rec.edit_plan = _edit_plan
        is_module = isinstance(model, nn.Module)
        info = ModelInfo(type(model).__name__ if is_module else getattr(model, "__name__", type(model).__name__))
        self.describe_modules(info, modules)
        if is_module:
            trainable = {id(p) for _a, p in _flat_params(model.trainable_parameters())}
            for addr, p in _flat_params(model):
                mod, _, name = addr.rpartition(".")
                mx.eval(p)
                info.params.append(ParamInfo(addr, mod or "self", name, tuple(p.shape), _dtype(p), id(p) in trainable, p))
                rec.param_addr[id(p)] = addr
                rec.param_buffer[_buffer_key(p)] = addr
        for path, leaf in self.input_leaves(args, kwargs):
            rec.source("input", leaf, path)
        prov, start = self.start_provenance(model, mx.__version__)
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
            raise self.forward_failed(info, log, prov, exc) from exc
        rec.record_outputs(self.leaves(out, "output"))  # (every leaf is evaluated: by its op, or as a source)
        return self.finish_capture(info, log, out, prov, start, capture, plan, edit_plan=_edit_plan)


def _flat_params(tree: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    if isinstance(tree, nn.Module):
        tree = tree.parameters()
    return tree_flatten(tree)
