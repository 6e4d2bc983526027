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
from typing import Any

import numpy as np

from torchlens.backends.sdk import (
    BackendBase,
    BackendCapabilities,
    BackendUnsupportedError,
    BufferInfo,
    EventLog,
    InvalidArgumentError,
    ModelInfo,
    OpEvent,
    ParamInfo,
    RecorderBase,
    call_site,
    foreign_leaf,
)
from torchlens_paddle import patch
from torchlens_paddle.edit_ops import rng_snapshot
from torchlens_paddle.plugin import FRAMEWORK

paddle = patch.paddle
nn = paddle.nn
Tensor = patch.TENSOR

#: The frames a module call runs through (a call site stops there).
_LAYER_CODES = frozenset({nn.Layer.__call__.__code__, nn.Layer._dygraph_call_func.__code__})


def dtype_name(t: Any) -> str:
    return str(t.dtype).replace("paddle.", "")


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


class _Recorder(RecorderBase):
    """Turns wrapped calls into `OpEvent`s and module hooks into enter/exit events."""

    def __init__(self, modules: list[tuple[str, Any]], log: EventLog) -> None:
        super().__init__(log, modules)
        self.depth = 0
        self.buffer_addr: dict[int, str] = {}

    def is_leaf(self, value: Any) -> bool:
        return isinstance(value, Tensor)

    def dtype_of(self, value: Any) -> str:
        return dtype_name(value)

    def unseen(self, value: Any) -> tuple[int, int]:
        """A tensor argument no event produced: a buffer of the model, else a constant."""
        baddr = self.buffer_addr.get(id(value))
        return self.source("buffer", value, baddr) if baddr else self.source("constant", value, "constant")

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
            parents, params, args_t, kwargs_t = self.arguments(args, kwargs)
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


class PaddleBackend(BackendBase):
    """BackendProtocol implementation for PaddlePaddle (preview, dygraph)."""

    name = "paddle"
    framework = FRAMEWORK
    package, edit_ops_name, codec_name = "torchlens_paddle", "PaddleEditOps", "PaddleCodec"
    CAPABILITIES = BackendCapabilities(validation_replay=True, payload_materialization=True, interventions=True,
                                       backward_capture=True, rng_replay=True)
    own_refusals = frozenset({"foreign_tensor_input", "runtime_mode_unsupported", "inplace_op_unsupported",
                              "runtime_conflict"})
    module_types = (nn.Layer,)
    capture_noun = "a paddle capture"
    replay_rng_note = "random paddle kernels always record the generator state they drew from"

    def module_pairs(self, model: Any) -> list[tuple[str, Any]]:
        return model_modules(model)

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, Tensor)

    def host_copy(self, value: Any) -> np.ndarray:
        if value.dtype == paddle.bfloat16:  # numpy has no bfloat16: float32 holds every value exactly
            return np.array(value.astype("float32").numpy(), copy=True)
        return np.array(value.numpy(), copy=True)

    def from_host(self, values: Any, like: Any) -> Any:
        a = paddle.to_tensor(np.asarray(values))
        return a if like is None else a.astype(like.dtype)

    def resolve_callable(self, qualname: str) -> Any:
        """Saved op callables come back only from the closed table of wrapped framework calls."""
        return patch.resolve(qualname)

    def ground_truth_values(self, ground_truth: Any) -> Any:
        return [self.host_copy(v) for _p, v in self.leaves(ground_truth)]

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
        if isinstance(model, nn.Layer) and not any(isinstance(v, Tensor) for _p, v in self.leaves((args, kwargs))):
            kinds = sorted({type(v).__name__ for _p, v in self.leaves((args, kwargs))}) or ["no input"]
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
        plan = self.open_capture(capture, options, replay_rng, save)
        self._check(model, args, kwargs)
        self.refuse_reentrant(patch.ACTIVE.recorder)
        modules = model_modules(model)
        log = EventLog()
        rec = _Recorder(modules, log)
        rec.edit_plan = _edit_plan
        is_layer = isinstance(model, nn.Layer)
        info = ModelInfo(type(model).__name__ if is_layer else getattr(model, "__name__", type(model).__name__))
        self.describe_modules(info, modules)
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
        for path, leaf in self.input_leaves(args, kwargs):
            rec.source("input", leaf, path)
        prov, start = self.start_provenance(model, paddle.__version__)
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
            raise self.forward_failed(info, log, prov, exc) from exc
        rec.record_outputs(self.leaves(out, "output"))
        return self.finish_capture(info, log, out, prov, start, capture, plan, edit_plan=_edit_plan)


__all__ = ["PaddleBackend", "model_modules"]
