"""The tinygrad backend: records every outermost public `Tensor` call of a forward as one op.

Written on `torchlens.backends.sdk` only (the dependency test checks it). A capture wraps the
framework (`torchlens_tinygrad.patch`: the granularity decision is documented there), and
realizes each recorded output as the call returns (`Tensor.realize`), so every payload is a
concrete buffer and every later op of the forward reads realized inputs (which is also what
makes replay bit-exact: replay runs the same kernel on the same buffers). Every wrapped object
is restored in a `finally`.

Module scopes: tinygrad has no module base class. The model's attribute tree (instance
attributes, lists, tuples, dicts) is walked from the model; an object whose class defines
`__call__` and that holds a `Tensor` somewhere below it is a module, at its attribute path
(`layers.0`, `attn.qkv`); the `__call__` of each such class is wrapped during the capture.
Every `Tensor` in the tree is a parameter of its nearest module.

Randomness (`rng_replay=True`): before a draw (`Tensor.rand`, `randn`, `dropout`, ...) the
recorder reads tinygrad's global RNG state (`Tensor._seed` and the per-device key and
counter tensors) into `op.meta["rng_state"]`; replay sets that state, draws, and puts the
live state back, so validation consumes no randomness. Reading the state realizes the
pending counter update, which changes no value: a traced forward consumes the stream
exactly as a plain one.

In-place writes (`assign`, `a[i] = v`, `a += b`) into an intermediate are recorded with the
receiver as output (its earlier payload is snapshotted first); into an input or a model
tensor they refuse (`input_mutation_unsupported`). A `TinyJit` function called inside the
forward refuses (`mid_capture_execution_unsupported`): its replayed kernels bypass `Tensor`.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import numpy as np
from tinygrad import Tensor, dtypes

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
from torchlens_tinygrad import patch
from torchlens_tinygrad.plugin import FRAMEWORK

#: the framework's own members, bound at import (before any capture wraps them), for the
#: backend's bookkeeping, which must never be recorded as ops
_REALIZE, _CLONE, _NUMPY = Tensor.realize, Tensor.clone, Tensor.numpy


def realize(*values: Any) -> None:
    if values:
        _REALIZE(*values)


def snapshot(t: Any) -> Any:
    """A new realized tensor holding `t`'s current value (a later write into `t` leaves it alone)."""
    out = _CLONE(t)
    _REALIZE(out)
    return out


def host(t: Any) -> np.ndarray:
    return np.array(_NUMPY(t), copy=True)


def rng_snapshot() -> dict:
    """tinygrad's global RNG state as plain values (saved files carry it)."""
    return {"seed": int(Tensor._seed),
            "seeds": {d: host(t).tolist() for d, t in Tensor._device_seeds.items()},
            "counters": {d: host(t).tolist() for d, t in Tensor._device_rng_counters.items()}}


@contextlib.contextmanager
def rng_state(state: Any) -> Any:
    """Run under the recorded RNG `state`, then put the live state back (nothing consumed)."""
    if not state:
        yield
        return
    live = (Tensor._seed, Tensor._device_seeds, Tensor._device_rng_counters)
    Tensor._seed = state["seed"]
    Tensor._device_seeds = {d: Tensor(v, device=d, dtype=dtypes.uint32) for d, v in state["seeds"].items()}
    Tensor._device_rng_counters = {d: Tensor(v, device=d, dtype=dtypes.uint32) for d, v in state["counters"].items()}
    try:
        yield
    finally:
        Tensor._seed, Tensor._device_seeds, Tensor._device_rng_counters = live


_FOREIGN_ROOTS = ("torch", "jax", "jaxlib", "tensorflow", "mlx", "paddle", "keras")


def _foreign(obj: Any) -> str | None:
    """The type name of the first array of another framework (or numpy) inside `obj`, if any."""
    return foreign_leaf(obj, _FOREIGN_ROOTS, need_shape=True)


_NOT_WALKED = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType,
               str, bytes, int, float, bool, complex, type(None))


def _holds_tensor(obj: Any, seen: set, depth: int = 0) -> bool:
    if isinstance(obj, Tensor):
        return True
    if depth > 12 or id(obj) in seen or isinstance(obj, _NOT_WALKED):
        return False
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(o, seen, depth + 1) for o in obj)
    if isinstance(obj, dict):
        return any(_holds_tensor(o, seen, depth + 1) for o in obj.values())
    d = getattr(obj, "__dict__", None)
    return isinstance(d, dict) and any(_holds_tensor(o, seen, depth + 1) for o in d.values())


def _is_module(obj: Any) -> bool:
    return (not isinstance(obj, (Tensor, *_NOT_WALKED)) and any("__call__" in c.__dict__ for c in type(obj).__mro__[:-1])
            and _holds_tensor(obj, set()))


def model_tree(model: Any) -> tuple[list[tuple[str, Any, str | None]], list[tuple[str, str, Any]], list[tuple[str, Any]]]:
    """(modules, tensors, attributes) of the model's attribute tree (module docstring):
    modules as (address, object, parent address), root first as "self"; tensors as
    (address, owning module address, tensor), each tensor once; every other attribute leaf
    as (address, value) (the foreign-array check reads them)."""
    modules: list[tuple[str, Any, str | None]] = [("self", model, None)]
    tensors: list[tuple[str, str, Any]] = []
    leaves: list[tuple[str, Any]] = []
    if isinstance(model, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        return modules, tensors, leaves
    seen_obj: set[int] = {id(model)}
    seen_t: set[int] = set()

    def join(prefix: str, key: Any) -> str:
        return f"{prefix}.{key}" if prefix else str(key)

    def walk(obj: Any, prefix: str, owner: str, depth: int) -> None:
        if depth > 12:
            return
        if isinstance(obj, (list, tuple)):
            items: Any = enumerate(obj)
        elif isinstance(obj, dict):
            items = obj.items()
        else:
            d = getattr(obj, "__dict__", None)
            items = d.items() if isinstance(d, dict) else ()
        for k, v in list(items):
            addr = join(prefix, k)
            if isinstance(v, Tensor):
                if id(v) not in seen_t:
                    seen_t.add(id(v))
                    tensors.append((addr, owner, v))
                continue
            if isinstance(v, _NOT_WALKED) or id(v) in seen_obj:
                leaves.append((addr, v))
                continue
            seen_obj.add(id(v))
            if _is_module(v):
                modules.append((addr, v, owner))
                walk(v, addr, addr, depth + 1)
            else:
                if not isinstance(v, (list, tuple, dict)):
                    leaves.append((addr, v))
                walk(v, addr, owner, depth + 1)

    walk(model, "", "self", 0)
    return modules, tensors, leaves


def _dtype(t: Any) -> str:
    return str(t.dtype).replace("dtypes.", "")


def _shape(t: Any) -> tuple:
    return tuple(int(s) for s in t.shape)


class _Recorder(RecorderBase):
    """Turns wrapped calls into `OpEvent`s and module calls into enter/exit events."""

    def __init__(self, modules: list[tuple[str, Any, str | None]], log: EventLog, wrapper_code: Any) -> None:
        super().__init__(log, [(a, m) for a, m, _p in modules])
        self.inputs: set[int] = set()
        self.refusal: Exception | None = None
        self.wrapper_code = wrapper_code

    def is_leaf(self, value: Any) -> bool:
        return isinstance(value, Tensor)

    def dtype_of(self, value: Any) -> str:
        return _dtype(value)

    def shape_of(self, value: Any) -> tuple:
        return _shape(value)

    def settle(self, value: Any) -> None:
        realize(value)

    def protect(self, value: Any) -> None:
        """Before an in-place write into `value`, the event that produced it gets a snapshot
        (payloads are the live tensors)."""
        src = self.producer.get(id(value))
        if src is None:
            return
        ev = self.events_by_id[src[0]]
        if ev.outputs[src[1]] is value:
            outs = list(ev.outputs)
            outs[src[1]] = snapshot(value)
            ev.outputs = tuple(outs)

    def refuse(self, exc: Exception) -> None:
        """A refusal raised inside the forward: kept so the capture re-raises it as itself."""
        self.refusal = exc
        raise exc

    # ops ----------------------------------------------------------------------------------
    def before(self, name: str, args: tuple, kwargs: dict, random: bool, inplace: bool = False) -> Any:
        """Before a draw: tinygrad's RNG state. Before an in-place write: refuse a write into an
        input or a model tensor; protect the receiver's payload."""
        if not (random or inplace):
            return None
        patch.ACTIVE.depth += 1
        try:
            if inplace and args and isinstance(args[0], Tensor):
                target = args[0]
                where = self.param_addr.get(id(target)) or ("an input" if id(target) in self.inputs else None)
                if where is not None:
                    self.refuse(BackendUnsupportedError(
                        "input_mutation_unsupported",
                        f"the forward writes into {where if where == 'an input' else 'model tensor ' + where} "
                        f"in place ({name})",
                        remedy="write into a copy (x = x.clone(); x[...] = v) or return the new value instead",
                        backend="tinygrad", method=name))
                self.template((args, kwargs), [], [])
                self.protect(target)
            if random:
                return rng_snapshot()
            return None
        finally:
            patch.ACTIVE.depth -= 1

    def record(self, name: str, func: Any, qualname: str, args: tuple, kwargs: dict, out: Any, rng: Any,
               inplace: bool = False) -> Any:
        value: Any = args[0] if inplace and (out is None or out is args[0]) else out
        split = self.split_outputs(value)
        if split is None:
            return out  # not a tensor-producing call
        outs, multi = split
        patch.ACTIVE.depth += 1
        try:
            site = call_site(sys._getframe(2), self.wrapper_code)
            parents, params, args_t, kwargs_t = self.arguments(args, kwargs)
            i = self.log.new_id()
            outs, out = self.apply_edits(i, outs, out, multi, inplace)
            realize(*outs)
            meta: dict[str, Any] = {"qualname": qualname}
            if rng is not None:
                meta["rng_state"] = rng
            self.append(OpEvent(
                i, "op", name, parents=tuple(parents), outputs=tuple(outs),
                shapes=tuple(_shape(o) for o in outs), dtypes=tuple(_dtype(o) for o in outs),
                module_stack=tuple(self.stack), site=(qualname, site), params=tuple(params), multi_output=multi,
                func=func, args_template=args_t, kwargs_template=kwargs_t, is_inplace=inplace, meta=meta))
            for slot, o in enumerate(outs):
                self.register(o, (i, slot))
        finally:
            patch.ACTIVE.depth -= 1
        return out


def _module_call_wrapper(original: Any) -> Any:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = patch.ACTIVE.recorder
        if rec is None or patch.ACTIVE.depth or id(self) not in rec.addr_of or (rec.objs and rec.objs[-1] is self):
            return original(self, *args, **kwargs)
        rec.enter(self, args, kwargs)
        out = original(self, *args, **kwargs)
        rec.exit(out)
        return out

    __call__.__torchlens_original__ = original  # type: ignore[attr-defined]
    return __call__


_WRAPPER_CODE = _module_call_wrapper(lambda *a: None).__code__


def _jit_guard(self: Any, *args: Any, **kwargs: Any) -> Any:
    rec = patch.ACTIVE.recorder
    exc = BackendUnsupportedError(
        "mid_capture_execution_unsupported",
        f"the forward calls the TinyJit function {getattr(self, 'fxn', None)!r}: its captured kernels run without "
        "Tensor calls, so the capture cannot see them",
        remedy="trace the function the TinyJit wraps (jitted.fxn) instead of the jitted one", backend="tinygrad")
    if rec is not None:
        rec.refuse(exc)
    raise exc


def _framework_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tinygrad")
    except PackageNotFoundError:  # a source checkout of tinygrad
        return "unknown"


class TinygradBackend(BackendBase):
    """BackendProtocol implementation for tinygrad (preview)."""

    name = "tinygrad"
    framework = FRAMEWORK
    materialization = "lazy"
    package, edit_ops_name, codec_name = "torchlens_tinygrad", "TinygradEditOps", "TinygradCodec"
    CAPABILITIES = BackendCapabilities(validation_replay=True, payload_materialization=True, interventions=True,
                                       backward_capture=True, rng_replay=True)
    own_refusals = frozenset({"foreign_tensor_input", "tinygrad_input_required", "tensor_output_required",
                              "input_mutation_unsupported", "mid_capture_execution_unsupported"})
    capture_noun = "a tinygrad capture"
    replay_rng_note = "tinygrad draws always record the RNG state they used"

    def module_pairs(self, model: Any) -> list[tuple[str, Any]]:
        return [(a, m) for a, m, _p in model_tree(model)[0]]

    def module_training(self, module: Any) -> bool:
        return False

    def settle(self, *values: Any) -> None:
        realize(*values)

    def can_handle(self, model: Any, args: tuple, kwargs: dict) -> bool:
        if any(isinstance(v, Tensor) for _p, v in self.leaves((args, kwargs))):
            return callable(model)
        return callable(model) and bool(model_tree(model)[1])

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, Tensor)

    def host_copy(self, value: Any) -> np.ndarray:
        return host(value)

    def from_host(self, values: Any, like: Any) -> Any:
        arr = np.asarray(values)
        t = Tensor(arr) if like is None else Tensor(arr, dtype=like.dtype)
        realize(t)
        return t

    def resolve_callable(self, qualname: str) -> Any:
        """Saved op callables come back only from the closed table of wrapped Tensor members."""
        return patch.replay_table().get(qualname)

    def ground_truth_values(self, ground_truth: Any) -> Any:
        return [self.host_copy(v) for _p, v in self.leaves(ground_truth)] or None

    def _check_inputs(self, model: Any, args: tuple, kwargs: dict) -> list:
        if not callable(model) or isinstance(model, Tensor):
            raise InvalidArgumentError("model_type_unsupported", f"{type(model).__name__} is not a callable tinygrad model",
                                       remedy="pass an object with __call__ holding tinygrad Tensors (tinygrad.nn "
                                              "layers) or a function of tinygrad Tensors", backend="tinygrad")
        foreign = _foreign((args, kwargs))
        if foreign:
            raise BackendUnsupportedError("foreign_tensor_input", f"an input is a {foreign}, not a tinygrad Tensor",
                                          remedy="convert inputs with Tensor(...) before tracing with backend='tinygrad'",
                                          backend="tinygrad")
        if not any(isinstance(v, Tensor) for _p, v in self.leaves(args)):
            raise BackendUnsupportedError("tinygrad_input_required",
                                          f"no positional input is a tinygrad Tensor (got "
                                          f"{', '.join(type(a).__name__ for a in args) or 'no positional input'})",
                                          remedy="pass the model's input as a tinygrad Tensor: Tensor(values)",
                                          backend="tinygrad")
        tree = model_tree(model)
        for addr, value in tree[2]:
            foreign = _foreign([value])
            if foreign:
                raise BackendUnsupportedError(
                    "foreign_tensor_input", f"the model mixes frameworks: {addr} is a {foreign}",
                    remedy="hold tinygrad Tensors only in a tinygrad model (convert with Tensor(...))",
                    backend="tinygrad", attribute=addr)
        return tree

    def capture(self, model: Any, args: tuple, kwargs: dict, save: Any = "all", capture: Any = None,
                replay_rng: bool = True, _edit_plan: Any = None, **options: Any) -> Any:
        plan = self.open_capture(capture, options, replay_rng, save)
        modules, tensors, _leaves = self._check_inputs(model, args, kwargs)
        self.refuse_reentrant(patch.ACTIVE.recorder)
        log = EventLog()
        rec = _Recorder(modules, log, _WRAPPER_CODE)
        rec.edit_plan = _edit_plan
        is_function = isinstance(model, (types.FunctionType, types.MethodType, types.BuiltinFunctionType))
        info = ModelInfo(getattr(model, "__name__", type(model).__name__) if is_function else type(model).__name__)
        self.describe_modules(info, [(a, m) for a, m, _p in modules], parents={a: p for a, _m, p in modules})
        realize(*[t for _a, _o, t in tensors])
        for addr, owner, t in tensors:
            name = addr if owner == "self" else addr[len(owner) + 1:]
            info.params.append(ParamInfo(addr, owner, name, _shape(t), _dtype(t), dtypes.is_float(t.dtype), t))
            rec.param_addr[id(t)] = addr
        for path, leaf in self.input_leaves(args, kwargs):
            if id(leaf) not in rec.param_addr:
                rec.source("input", leaf, path)
                rec.inputs.add(id(leaf))
        prov, start = self.start_provenance(model, _framework_version())
        patches = patch.Patches(patch.defining_classes([m for a, m, _p in modules if a != "self" or not is_function]),
                                _module_call_wrapper, jit_guard=_jit_guard)
        out: Any = None
        try:
            patch.ACTIVE.recorder = rec
            patch.ACTIVE.depth = 0
            patches.install()
            try:
                if not is_function:
                    out = model(*args, **kwargs)
                else:
                    rec.enter(model, args, kwargs)
                    out = model(*args, **kwargs)
                    rec.exit(out)
            finally:
                patches.restore()
                patch.ACTIVE.recorder = None
                patch.ACTIVE.depth = 0
        except Exception as exc:
            if rec.refusal is not None:
                raise rec.refusal from None
            raise self.forward_failed(info, log, prov, exc) from exc
        leaves = self.leaves(out, "output")
        if not leaves:
            raise BackendUnsupportedError("tensor_output_required",
                                          f"the forward returned {type(out).__name__}, which holds no tinygrad Tensor",
                                          remedy="return the Tensor (or a tuple, list or dict of Tensors) the model computes",
                                          backend="tinygrad")
        rec.record_outputs(leaves)
        return self.finish_capture(info, log, out, prov, start, capture, plan, edit_plan=_edit_plan)
