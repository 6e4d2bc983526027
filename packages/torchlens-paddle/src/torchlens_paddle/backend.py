"""The PaddlePaddle backend: records every kernel call of a dygraph forward as core events.

Written on `torchlens.backends.sdk` only (the dependency test checks it). A capture wraps the
framework (`torchlens_paddle.patch`: every bound copy of a `paddle._C_ops` function and the
C-level `paddle.Tensor` operators), opens module scopes from `paddle.nn.Layer` forward
pre/post hooks, and restores every wrapped object and removes every hook in a `finally`.

- Dygraph only: a capture in static-graph mode refuses (`runtime_mode_unsupported`).
- In-place kernels (`relu_`, `x[i] = v`, `copy_`) refuse (`inplace_op_unsupported`): the
  recorded payloads are the live tensors, which an in-place write would change.
- Randomness (`rng_replay=True`): a random kernel (`gaussian`, `uniform`, `dropout`, ...)
  records paddle's generator state before it runs (`op.meta["rng_state"]`); replay restores
  it, draws, and puts the current state back. The state is kept as plain values (the fields
  of paddle's `GeneratorState`), so a saved and loaded trace replays its draws too.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from torchlens.backends.sdk import (
    ArgRef,
    BackendCapabilities,
    BackendUnsupportedError,
    BufferInfo,
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
from torchlens_paddle import __version__, patch
from torchlens_paddle.edit_ops import rng_snapshot
from torchlens_paddle.plugin import FRAMEWORK

paddle = patch.paddle
nn = paddle.nn
Tensor = patch.TENSOR

#: The frames a module call runs through (a call site stops there).
_LAYER_CODES = frozenset({nn.Layer.__call__.__code__, nn.Layer._dygraph_call_func.__code__})


def dtype_name(t: Any) -> str:
    return str(t.dtype).replace("paddle.", "")


def _leaf_paths(obj: Any, path: str) -> list[tuple[str, Any]]:
    return leaf_paths(obj, path, _is_leaf)


def _is_leaf(obj: Any) -> bool:
    return isinstance(obj, Tensor)


def _foreign(obj: Any) -> str | None:
    """The type name of the first array of another framework (or numpy) inside `obj`, if any."""
    return foreign_leaf(obj, ("torch", "jax", "jaxlib", "tensorflow", "mlx", "tinygrad"))


def flat_outputs(out: Any) -> list[Any] | None:
    """The tensor (or None) leaves of a call's tuple/list result, depth first; None when the
    result holds anything else."""
    if not isinstance(out, (tuple, list)) or not out:
        return None
    leaves: list[Any] = []
    for v in out:
        if isinstance(v, Tensor) or v is None:
            leaves.append(v)
        elif isinstance(v, (tuple, list)):
            inner = flat_outputs(v)
            if inner is None:
                return None
            leaves.extend(inner)
        else:
            return None
    return leaves


def out_tree(out: Any) -> list:
    """The nesting of a result as plain values (a saved trace keeps it): a list of leaf
    markers (0) and nested [kind, items] for inner tuples and lists."""
    return ["tuple" if isinstance(out, tuple) else "list",
            [out_tree(v) if isinstance(v, (tuple, list)) else 0 for v in out]]


def rebuild(tree: list, leaves: list[Any]) -> Any:
    kind, items = tree
    made = [rebuild(v, leaves) if isinstance(v, list) else leaves.pop(0) for v in items]
    return tuple(made) if kind == "tuple" else made


class _Recorder:
    """Turns wrapped calls into `OpEvent`s and module hooks into enter/exit events."""

    def __init__(self, modules: list[tuple[str, Any]], log: EventLog) -> None:
        self.log = log
        self.depth = 0
        self.addr_of = {id(m): a for a, m in modules}
        self.param_addr: dict[int, str] = {}
        self.buffer_addr: dict[int, str] = {}
        self.producer: dict[int, tuple[int, int]] = {}
        self.alive: list[Any] = []  # keeps ids stable during the capture
        self.stack: list[tuple[str, int]] = []
        self.calls: dict[str, int] = {}
        self.edit_plan: Any = None

    def source(self, kind: str, value: Any, path: str) -> tuple[int, int]:
        i = self.log.new_id()
        self.log.append(OpEvent(i, kind, kind, outputs=(value,), shapes=(tuple(value.shape),),
                                dtypes=(dtype_name(value),), path=path,
                                module_stack=tuple(self.stack) if kind != "input" else ()))
        self.register(value, (i, 0))
        return (i, 0)

    def register(self, value: Any, src: tuple[int, int]) -> None:
        self.producer[id(value)] = src
        self.alive.append(value)

    def _template(self, obj: Any, parents: list, params: list) -> Any:
        if isinstance(obj, Tensor):
            addr = self.param_addr.get(id(obj))
            if addr is not None:
                if addr not in params:
                    params.append(addr)
                return ArgRef(address=addr)
            src = self.producer.get(id(obj))
            if src is None:
                baddr = self.buffer_addr.get(id(obj))
                src = self.source("buffer", obj, baddr) if baddr else self.source("constant", obj, "constant")
            parents.append(src)
            return ArgRef(index=len(parents) - 1)
        if type(obj) is tuple:
            return tuple(self._template(o, parents, params) for o in obj)
        if type(obj) is list:
            return [self._template(o, parents, params) for o in obj]
        if type(obj) is dict:
            return {k: self._template(v, parents, params) for k, v in obj.items()}
        return obj

    def call(self, name: str, func: Any, qualname: str, args: tuple, kwargs: dict) -> Any:
        if patch.is_inplace(name) or name in patch.TENSOR_INPLACE:
            raise BackendUnsupportedError(
                "inplace_op_unsupported", f"the forward runs the in-place paddle op {qualname}",
                remedy="use the out-of-place form (paddle.nn.functional.relu, not relu_; paddle.where or "
                       "paddle.scatter, not item assignment)", backend="paddle", op=qualname)
        if name == "batch_norm" and len(args) > 5 and args[5] is False:
            raise BackendUnsupportedError(
                "inplace_op_unsupported", "the forward runs batch_norm in training mode, which updates the running "
                "statistics in place", remedy="call model.eval() before tracing (the paddle backend records "
                "batch_norm with running statistics only)", backend="paddle", op=qualname)
        rng = None
        if name in patch.RANDOM:
            rng = rng_snapshot()
        self.depth += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.depth -= 1
        return self.record(name, func, qualname, args, kwargs, out, rng)

    def record(self, name: str, func: Any, qualname: str, args: tuple, kwargs: dict, out: Any, rng: Any) -> Any:
        tree = None
        if isinstance(out, Tensor):
            outs, multi = (out,), False
        else:
            leaves = flat_outputs(out)
            if not leaves or not any(isinstance(v, Tensor) for v in leaves):
                return out  # not a tensor-producing call
            outs, multi = tuple(leaves), True
            if any(isinstance(v, (tuple, list)) for v in out):
                tree = out_tree(out)  # nested (the rnn kernel's states are a list inside its tuple)
        self.depth += 1
        try:
            site = call_site(sys._getframe(3), _LAYER_CODES)
            parents: list[tuple[int, int]] = []
            params: list[str] = []
            args_t = self._template(args, parents, params)
            kwargs_t = self._template(kwargs, parents, params)
            i = self.log.new_id()
            if self.edit_plan is not None and i in self.edit_plan:
                edited = tuple(self.edit_plan.apply(i, outs))
                outs = edited
                out = edited[0] if not multi else type(out)(edited) if tree is None else rebuild(tree, list(edited))
            meta: dict[str, Any] = {"qualname": qualname}
            if tree is not None:
                meta["out_tree"] = tree
            if rng is not None:
                meta["rng_state"] = rng
            shapes = tuple(tuple(o.shape) if o is not None else () for o in outs)
            dtypes = tuple(dtype_name(o) if o is not None else "none" for o in outs)
            self.log.append(OpEvent(
                i, "op", name, parents=tuple(parents), outputs=tuple(outs), shapes=shapes, dtypes=dtypes,
                module_stack=tuple(self.stack), site=(qualname, site), params=tuple(params), multi_output=multi,
                func=func, args_template=args_t, kwargs_template=kwargs_t, meta=meta))
            for slot, o in enumerate(outs):
                if o is not None:
                    self.register(o, (i, slot))
        finally:
            self.depth -= 1
        return out

    # module scopes (forward pre/post hooks) -------------------------------------------------
    def enter(self, module: Any, inputs: Any) -> None:
        addr = self.addr_of.get(id(module), f"<unregistered {type(module).__name__}>")
        n = self.calls.get(addr, 0) + 1
        self.calls[addr] = n
        self.stack.append((addr, n))
        ins = tuple(s for s in (self.producer.get(id(a)) for _p, a in _leaf_paths(inputs, "")) if s is not None)
        self.log.append(ModuleEnter(addr, n, ins))

    def exit(self, out: Any) -> None:
        addr, n = self.stack.pop()
        outs = tuple(s for s in (self.producer.get(id(o)) for _p, o in _leaf_paths(out, "")) if s is not None)
        self.log.append(ModuleExit(addr, n, outs))


class _Hooks:
    """Forward pre/post hooks on every layer of the model for one capture; `remove()` takes
    every one off again (also when the forward raises)."""

    def __init__(self, rec: _Recorder, layers: list[Any]) -> None:
        self.handles: list[Any] = []
        self.rec = rec
        self.layers = layers

    def install(self) -> None:
        rec = self.rec

        def pre(layer: Any, inputs: Any) -> None:
            if patch.ACTIVE.recorder is rec and not rec.depth:
                rec.enter(layer, inputs)
            return None

        def post(layer: Any, inputs: Any, outputs: Any) -> None:
            if patch.ACTIVE.recorder is rec and not rec.depth:
                rec.exit(outputs)
            return None

        try:
            for layer in self.layers:
                self.handles.append(layer.register_forward_pre_hook(pre))
                self.handles.append(layer.register_forward_post_hook(post))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        while self.handles:
            self.handles.pop().remove()


def model_modules(model: Any) -> list[tuple[str, Any]]:
    """(address, layer) pairs, root first as "self"; a plain function is the one root."""
    if not isinstance(model, nn.Layer):
        return [("self", model)]
    out: list[tuple[str, Any]] = [("self", model)]
    seen = {id(model)}
    for addr, m in model.named_sublayers():
        if id(m) not in seen:
            seen.add(id(m))
            out.append((addr, m))
    return out


class PaddleBackend:
    """BackendProtocol implementation for PaddlePaddle (preview, dygraph)."""

    name = "paddle"
    maturity = "preview"
    framework = FRAMEWORK
    materialization = "eager"
    _OPTIONS = frozenset({"save", "capture", "replay_rng"})

    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(validation_replay=True, payload_materialization=True, interventions=True,
                                   backward_capture=True, rng_replay=True)

    def backward(self, trace: Any, loss: Any = None, **kwargs: Any) -> Any:
        """Fill `op.grads` of every saved op: the gradient of `loss(output)` (a callable of the
        output; None sums its float leaves), by `paddle.grad` over the recorded ops."""
        from torchlens_paddle.grads import backward

        return backward(trace, loss, **kwargs)

    def edit_ops(self) -> Any:
        from torchlens_paddle.edit_ops import PaddleEditOps

        return PaddleEditOps()

    def attach_module_edits(self, model: Any, rules: list, ops: Any, fired: dict) -> Any:
        from torchlens_paddle.edit_ops import attach_module_edits

        return attach_module_edits(model, model_modules(model), rules, ops, fired)

    def runtime_available(self) -> str | None:
        return None

    def trace_options(self) -> frozenset[str]:
        return self._OPTIONS

    def refusal_codes(self) -> frozenset[str]:
        return refusal_codes_for(self, {"foreign_tensor_input", "runtime_mode_unsupported", "inplace_op_unsupported",
                                        "runtime_conflict"})

    def can_handle(self, model: Any, args: tuple, kwargs: dict) -> bool:
        if isinstance(model, nn.Layer):
            return True
        return callable(model) and any(isinstance(v, Tensor) for _p, v in _leaf_paths((args, kwargs), ""))

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, Tensor)

    def host_copy(self, value: Any) -> np.ndarray:
        if value.dtype == paddle.bfloat16:  # numpy has no bfloat16: float32 holds every value exactly
            return np.array(value.astype("float32").numpy(), copy=True)
        return np.array(value.numpy(), copy=True)

    def from_host(self, values: Any, like: Any) -> Any:
        a = paddle.to_tensor(np.asarray(values))
        return a if like is None else a.astype(like.dtype)

    def payload_codec(self) -> Any:
        from torchlens_paddle.codec import PaddleCodec

        return PaddleCodec()

    def realize_once(self, values: Any) -> Any:
        return values

    def resolve_callable(self, qualname: str) -> Any:
        """Saved op callables come back only from the closed table of wrapped framework calls."""
        return patch.resolve(qualname)

    def reference_output(self, model: Any, args: tuple, kwargs: dict) -> Any:
        return model(*args, **kwargs)

    def _check(self, model: Any, args: tuple, kwargs: dict) -> None:
        if not paddle.in_dynamic_mode():
            raise BackendUnsupportedError("runtime_mode_unsupported", "paddle is in static-graph mode",
                                          remedy="call paddle.disable_static() before tracing: the paddle backend "
                                                 "records dygraph forwards only", backend="paddle")
        if not callable(model):
            raise InvalidArgumentError("model_type_unsupported",
                                       f"{type(model).__name__} is not a paddle.nn.Layer or a callable",
                                       remedy="pass a paddle.nn.Layer or a function of paddle.Tensor inputs")
        foreign = _foreign((args, kwargs))
        if foreign:
            raise BackendUnsupportedError("foreign_tensor_input", f"an input is a {foreign}, not a paddle.Tensor",
                                          remedy="convert inputs with paddle.to_tensor(...) before tracing with "
                                                 "backend='paddle'", backend="paddle")
        if isinstance(model, nn.Layer) and not any(isinstance(v, Tensor) for _p, v in _leaf_paths((args, kwargs), "")):
            kinds = sorted({type(v).__name__ for _p, v in _leaf_paths((args, kwargs), "")}) or ["no input"]
            raise InvalidArgumentError("invalid_argument",
                                       f"no input of the call is a paddle.Tensor (got {', '.join(kinds)})",
                                       remedy="convert inputs with paddle.to_tensor(...) before tracing with "
                                              "backend='paddle'", backend="paddle")
        if isinstance(model, nn.Layer):
            for addr, m in model_modules(model):
                for key, value in vars(m).items():
                    if key.startswith("_") and key not in ("_parameters", "_buffers"):
                        continue
                    foreign = _foreign([value])
                    if foreign:
                        where = key if addr == "self" else f"{addr}.{key}"
                        raise BackendUnsupportedError(
                            "foreign_tensor_input", f"the model mixes frameworks: {where} is a {foreign}",
                            remedy="hold paddle.Tensor values only in a paddle.nn.Layer (convert with "
                                   "paddle.to_tensor(...))", backend="paddle", attribute=where)

    def capture(self, model: Any, args: tuple, kwargs: dict, save: Any = "all", capture: Any = None,
                replay_rng: bool = True, _edit_plan: Any = None, **options: Any) -> Any:
        check_requested_capabilities(self, capture, options)
        if not isinstance(replay_rng, bool):
            raise InvalidArgumentError("invalid_argument", f"replay_rng= takes a bool, not {type(replay_rng).__name__}",
                                       remedy="replay_rng=True (random paddle kernels always record the generator "
                                              "state they drew from)", option="replay_rng")
        plan = save_plan(save)
        self._check(model, args, kwargs)
        if patch.ACTIVE.recorder is not None:
            raise ReentrantTraceError("reentrant_trace", "a paddle capture is already running in this thread",
                                      remedy="trace outside the forward of another trace")
        modules = model_modules(model)
        log = EventLog()
        rec = _Recorder(modules, log)
        rec.edit_plan = _edit_plan
        is_layer = isinstance(model, nn.Layer)
        info = ModelInfo(type(model).__name__ if is_layer else getattr(model, "__name__", type(model).__name__))
        parent_of = module_parents(a for a, _m in modules)
        for addr, m in modules:
            info.modules.append(ModuleInfo(addr, type(m).__name__, type(m).__qualname__, parent=parent_of.get(addr),
                                           training=bool(getattr(m, "training", False))))
        if is_layer:
            for addr, p in model.named_parameters():
                mod, _, name = addr.rpartition(".")
                info.params.append(ParamInfo(addr, mod or "self", name, tuple(p.shape), dtype_name(p),
                                             not p.stop_gradient, p))
                rec.param_addr[id(p)] = addr
            for addr, b in model.named_buffers():
                mod, _, name = addr.rpartition(".")
                info.buffers.append(BufferInfo(addr, mod or "self", name, tuple(b.shape), dtype_name(b), b))
                rec.buffer_addr[id(b)] = addr
        for i, a in enumerate(args):
            for path, leaf in _leaf_paths(a, positional_path(i)):
                rec.source("input", leaf, path)
        for k, a in kwargs.items():
            for path, leaf in _leaf_paths(a, keyword_path(k)):
                rec.source("input", leaf, path)
        prov = Provenance("paddle", backend_version=__version__, framework_version=paddle.__version__,
                          model_class=type(model).__name__, start_time=time.time())
        start = time.perf_counter()
        patches = patch.Patches()
        hooks = _Hooks(rec, [m for _a, m in modules if isinstance(m, nn.Layer)])
        out: Any = None
        try:
            patch.ACTIVE.recorder = rec
            try:
                patches.install()
                hooks.install()
                if is_layer:
                    out = model(*args, **kwargs)
                else:
                    rec.enter(model, (args, kwargs))
                    out = model(*args, **kwargs)
                    rec.exit(out)
            finally:
                hooks.remove()
                patches.restore()
                patch.ACTIVE.recorder = None
        except BackendUnsupportedError:
            raise  # a typed refusal met during the forward (an in-place op): everything is restored
        except Exception as exc:
            partial = build_trace(info, log, output_state="output_forward_failed", provenance=prov, backend=self)
            raise TraceCaptureError("forward_failed", f"the forward raised {type(exc).__name__}: {exc}",
                                    remedy="fix the forward; exc.partial_trace holds the ops recorded before the failure",
                                    partial_trace=partial) from exc
        for path, leaf in _leaf_paths(out, "output"):
            src = rec.producer.get(id(leaf))
            if src is None:  # a parameter returned as is, or a value no wrapper saw
                src = rec.source("constant", leaf, "constant")
            i = log.new_id()
            log.append(OpEvent(i, "output", "output", parents=(src,), outputs=(leaf,),
                               shapes=(tuple(leaf.shape),), dtypes=(dtype_name(leaf),), path=path))
        prov.duration = time.perf_counter() - start
        prov.end_time = time.time()
        trace = build_trace(info, log, output=out, provenance=prov, options=capture, backend=self)
        if capture is not None and (capture.backward_ready or capture.save_grads):
            from torchlens_paddle.grads import keep_for_backward

            keep_for_backward(trace, out, save_grads=bool(capture.save_grads), edit_plan=_edit_plan)
        apply_save(trace, plan)
        return trace

    def validate(self, trace: Any, ground_truth: Any = None) -> ValidationStatus:
        """Replay every op on its parents' saved values through core's replay engine and
        compare bit for bit with its saved output."""
        from torchlens.backends.sdk import replay_validate
        from torchlens_paddle.edit_ops import PaddleEditOps

        gt = None if ground_truth is None else [self.host_copy(v) for _p, v in _leaf_paths(ground_truth, "")]
        return replay_validate(trace, PaddleEditOps(), ground_truth=gt)


__all__ = ["PaddleBackend", "model_modules"]
