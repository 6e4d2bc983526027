"""The TensorFlow / Keras 3 backend: records every eagerly executed TensorFlow op of a forward
as core events.

Written on `torchlens.backends.sdk` only (the dependency test checks it). A capture
(`torchlens_tf.patch`) registers one eager op callback, which TensorFlow calls after every op
it executes with the op's type, input tensors, attributes and output tensors; runs
`tf.function`s eagerly for the capture (`tf.config.run_functions_eagerly(True)`, restored
afterwards), so their ops are executed, and seen, one by one; and wraps `__call__` of the
model's Keras classes for module scopes. Everything is restored in a `finally`.

Each recorded op is a call of `torchlens_tf.ops.raw_op(<OpType>)` on its flat inputs with its
attributes as keywords: replay executes the same kernel on the same inputs, which is why the
callback (not a wrapper of the Python op functions) is the mechanism: the callback hands over
the exact inputs and attributes of the kernel call, whatever Python API issued it.

What is not an op: a `ReadVariableOp` of one of the model's variables is the parameter itself
(`ArgRef(address=...)`); a read of any other variable records the value read as a constant;
ops that return nothing (variable writes such as `AssignVariableOp`) or only resource handles
are not array computations and are not recorded (the docs list them). A stateful op that
returns arrays (the seedless `tf.random.*` draws, resource reads other than
`ReadVariableOp`) could not replay and refuses the capture with `tf_stateful_op_unsupported`.

Randomness (`rng_replay=True`): the stateless draws Keras and `tf.random.stateless_*` use take
their seed as an input tensor, so they replay exactly; a Keras `SeedGenerator`'s state is a
variable read (a constant holding the state the draw saw).
"""

from __future__ import annotations

import sys
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

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
from torchlens_tf import ops as raw, patch
from torchlens_tf.plugin import FRAMEWORK

_NOT_ARRAYS = (tf.resource, tf.variant)
#: op types that run a traced graph as one call: their ops are not seen one by one
_GRAPH_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall", "__inference", "XlaLaunch"})
#: ops TensorFlow marks stateful that compute their outputs from their inputs alone (checks,
#: identities, the stateless-random algorithm query): recorded and replayed like any op
_DETERMINISTIC_STATEFUL = frozenset({"CheckNumerics", "CheckNumericsV2", "GuaranteeConst", "DebugIdentityV2",
                                     "DebugIdentityV3", "StatelessRandomGetAlg", "IsTensorFloat32Enabled", "DeviceIndex"})


def _is_tensor(v: Any) -> bool:
    return isinstance(v, tf.Tensor) and not isinstance(v, tf.SparseTensor)


def _foreign(obj: Any) -> str | None:
    """The type name of the first array of another framework (or numpy) inside `obj`, if any."""
    return foreign_leaf(obj, ("torch", "jax", "jaxlib", "mlx", "paddle", "tinygrad"))


def _not_a_value(obj: Any) -> str | None:
    """The type name of the first input leaf that is TensorFlow but no concrete tensor value
    (a variable, a sparse or ragged tensor, a symbolic Keras tensor), if any."""
    if isinstance(obj, (tuple, list)):
        return next((f for f in map(_not_a_value, obj) if f), None)
    if isinstance(obj, dict):
        return _not_a_value(list(obj.values()))
    if isinstance(obj, (tf.Variable, tf.SparseTensor, tf.RaggedTensor, keras.KerasTensor)) or \
            getattr(obj, "_value", None) is not None and isinstance(getattr(obj, "_value"), tf.Variable):
        return type(obj).__name__
    return None


def _dtype(t: Any) -> str:
    return t.dtype.name


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def tf_variable(v: Any) -> Any:
    """The `tf.Variable` behind a Keras variable (or the variable itself)."""
    inner = getattr(v, "_value", None)
    if isinstance(inner, tf.Variable):
        return inner
    return v if isinstance(v, tf.Variable) else None


class _Recorder(RecorderBase):
    """Turns op callbacks into `OpEvent`s and Keras layer calls into enter/exit events."""

    def __init__(self, modules: list[tuple[str, Any]], log: EventLog, wrapper_code: Any) -> None:
        super().__init__(log, modules)
        self.busy = False
        self.handle_param: dict[int, str] = {}
        self.written: list[str] = []  # model variables the forward wrote into
        self.wrapper_code = wrapper_code

    def is_leaf(self, value: Any) -> bool:
        return _is_tensor(value)

    def dtype_of(self, value: Any) -> str:
        return _dtype(value)

    def shape_of(self, value: Any) -> tuple[int, ...]:
        return _shape(value)

    # the op callback --------------------------------------------------------------------------
    def on_op(self, op_type: Any, inputs: tuple, attrs: tuple, outputs: Any) -> None:
        name = raw.op_type_name(op_type)
        outs = tuple(outputs) if outputs else ()
        if name == "ReadVariableOp":
            addr = self.handle_param.get(id(inputs[0]))
            if addr is not None:  # the parameter itself, not an op
                self.param_addr[id(outs[0])] = addr
                self.alive.append(outs[0])
            else:  # another variable: the value it held when read
                self.source("constant", outs[0], "constant")
            return
        if not outs or all(o.dtype in _NOT_ARRAYS for o in outs):
            if inputs and inputs[0].dtype == tf.resource and id(inputs[0]) in self.handle_param:
                # a write into a model variable (`AssignSubVariableOp` of a BatchNormalization in
                # training mode): its later reads hold the new value, so they are constants with
                # the value read, no longer the parameter's captured value
                self.written.append(self.handle_param.pop(id(inputs[0])))
            return  # a state write, a no-op or a handle: no array computation
        if name in _GRAPH_CALLS or name.startswith("__inference"):
            raise BackendUnsupportedError(
                "unwrapped_op_in_capture", f"the forward ran a compiled TensorFlow graph ({name}) whose ops are not seen "
                "one by one", remedy="call the tf.function itself, not a concrete function or a loaded SavedModel "
                "signature: a tf.function's Python body runs eagerly during the capture", backend="tf", op_type=name)
        op_def = op_def_registry.get(name)
        stateful = op_def is None or (op_def.is_stateful and name not in _DETERMINISTIC_STATEFUL)
        if stateful or any(t.dtype in _NOT_ARRAYS for t in inputs):
            raise BackendUnsupportedError(
                "tf_stateful_op_unsupported", f"the forward ran the stateful TensorFlow op {name}, which returns arrays "
                "that a replay could not reproduce", remedy="draw random numbers with tf.random.stateless_* or keras.random "
                "(seeded), and read variables as values (var.value) instead of resource ops", backend="tf", op_type=name)
        self.busy = True
        try:
            site = call_site(sys._getframe(2), self.wrapper_code, 48)
            parents: list[tuple[int, int]] = []
            params: list[str] = []
            args_t = tuple(self.template(t, parents, params) for t in inputs)
            i = self.log.new_id()
            self.log.append(OpEvent(
                i, "op", raw.snake(name), parents=tuple(parents), outputs=outs,
                shapes=tuple(_shape(o) for o in outs), dtypes=tuple(_dtype(o) for o in outs),
                module_stack=tuple(self.stack), site=(name, site), params=tuple(params),
                multi_output=raw.is_multi_output(op_def), func=raw.raw_op(name), args_template=args_t,
                kwargs_template=raw.attrs_dict(attrs), meta={"op_type": name}))
            for slot, o in enumerate(outs):
                self.register(o, (i, slot))
        finally:
            self.busy = False


def _callback(op_type: Any, inputs: tuple, attrs: tuple, outputs: Any, op_name: Any = None, graph: Any = None) -> None:
    rec = patch.ACTIVE.recorder
    if rec is None or rec.busy or graph is not None:
        return None
    rec.on_op(op_type, inputs, attrs, outputs)
    return None



def _module_call_wrapper(original: Any) -> Any:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = patch.ACTIVE.recorder
        if rec is None or rec.busy or id(self) not in rec.addr_of or (rec.objs and rec.objs[-1] is self):
            return original(self, *args, **kwargs)
        rec.enter(self, args, kwargs)
        out = original(self, *args, **kwargs)
        rec.exit(out)
        return out

    __call__.__torchlens_original__ = original  # type: ignore[attr-defined]
    return __call__


_WRAPPER_CODE = _module_call_wrapper(lambda *a: None).__code__
#: attributes of a Keras layer that hold its bookkeeping, never a child layer of its own
_BOOKKEEPING = frozenset({"_layers", "_functional", "_tracked", "_inbound_nodes", "_outbound_nodes", "_operations"})


def _children(layer: Any) -> list[tuple[str, Any]]:
    """A layer's direct sub-layers with their names: a Sequential or functional model's
    `layers` by layer name; another layer's attributes (lists and dicts of layers by index and
    key), in definition order."""
    Layer = keras.layers.Layer
    if isinstance(layer, keras.Sequential) or any(c.__name__ == "Functional" for c in type(layer).__mro__):
        return [(sub.name, sub) for sub in layer.layers if type(sub).__name__ != "InputLayer"]
    out: list[tuple[str, Any]] = []
    for key, value in vars(layer).items():
        if key in _BOOKKEEPING or key.startswith("_self_"):  # `_self_*`: TensorFlow's own tracking tables
            continue
        if isinstance(value, Layer):
            out.append((key, value))
        elif isinstance(value, (list, tuple)):
            out.extend((f"{key}.{i}", v) for i, v in enumerate(value) if isinstance(v, Layer))
        elif isinstance(value, dict):
            out.extend((f"{key}.{k}", v) for k, v in value.items() if isinstance(v, Layer))
    found = {id(v) for _k, v in out}
    out.extend((sub.name, sub) for sub in getattr(layer, "_layers", ()) if id(sub) not in found)  # tracked elsewhere
    return out


def model_modules(model: Any) -> list[tuple[str, Any]]:
    """(address, layer) pairs, root first as "self", parents before children; a layer reached
    twice (shared) keeps its first address. A plain function is the one root."""
    out: list[tuple[str, Any]] = [("self", model)]
    if not isinstance(model, keras.layers.Layer):
        return out
    seen = {id(model)}

    def walk(layer: Any, prefix: str) -> None:
        for key, sub in _children(layer):
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            addr = f"{prefix}{key}"
            out.append((addr, sub))
            walk(sub, addr + ".")

    walk(model, "")
    return out


def _own_variables(layer: Any) -> list[tuple[str, Any, bool]]:
    """(name, variable, trainable) of the variables a layer holds itself: a Keras layer's own
    weights by their names (`kernel`, `moving_mean`); a plain `tf.Module`'s variables by their
    attribute paths (`w`, `layers.0.b`)."""
    def short(v: Any) -> str:
        return str(getattr(v, "name", "") or "variable").split(":")[0].rpartition("/")[2]

    if isinstance(layer, keras.layers.Layer):
        return [(short(v), v, True) for v in getattr(layer, "_trainable_variables", ())] + \
               [(short(v), v, False) for v in getattr(layer, "_non_trainable_variables", ())]
    if isinstance(layer, tf.Module):
        found = layer._flatten(with_path=True, predicate=lambda v: isinstance(v, tf.Variable))
        return [(".".join(str(p) for p in path), v, bool(v.trainable)) for path, v in found]
    return []


class TFBackend(BackendBase):
    """BackendProtocol implementation for TensorFlow / Keras 3 (preview)."""

    name = "tf"
    framework = FRAMEWORK
    package, edit_ops_name, codec_name = "torchlens_tf", "TFEditOps", "TFCodec"
    # rng_replay: the draws a capture records are stateless (the seed is an input), so they
    # replay exactly; stateful draws refuse the capture (module docstring)
    CAPABILITIES = BackendCapabilities(validation_replay=True, payload_materialization=True, interventions=True,
                                       backward_capture=True, rng_replay=True)
    own_refusals = frozenset({"foreign_tensor_input", "unwrapped_op_in_capture", "tf_stateful_op_unsupported"})
    module_types = (keras.layers.Layer, tf.Module)
    capture_noun = "a TensorFlow capture"
    replay_rng_note = "recorded draws are stateless, so they always replay"

    def module_pairs(self, model: Any) -> list[tuple[str, Any]]:
        return model_modules(model)

    def module_training(self, module: Any) -> bool:
        return False

    def is_tensor(self, value: Any) -> bool:
        return _is_tensor(value)

    def host_copy(self, value: Any) -> np.ndarray:
        return np.array(value, copy=True)

    def from_host(self, values: Any, like: Any) -> Any:
        a = tf.constant(np.asarray(values))
        return a if like is None else tf.cast(a, like.dtype) if a.dtype != like.dtype else a

    def resolve_callable(self, qualname: str) -> Any:
        """Saved op callables come back only from the closed table of TensorFlow op types."""
        if qualname.startswith("raw_op."):
            return raw.raw_op(qualname[len("raw_op."):])
        return None

    def _check_inputs(self, model: Any, args: tuple, kwargs: dict) -> None:
        mod = type(model).__module__.split(".")[0]
        if not callable(model) or mod in ("torch", "jax", "flax", "mlx", "paddle", "tinygrad"):
            raise InvalidArgumentError(
                "model_type_unsupported", f"{type(model).__module__}.{type(model).__name__} is not a Keras model, "
                "a tf.Module or a callable of tf.Tensor inputs",
                remedy="pass a Keras model or layer (Keras 3 on the TensorFlow backend), a tf.Module, or a function of "
                       "tf.Tensor inputs; trace other frameworks' models with their own backend", backend="tf")
        if isinstance(model, keras.layers.Layer) and keras.backend.backend() != "tensorflow":
            raise BackendUnsupportedError("runtime_mode_unsupported", f"Keras runs on the {keras.backend.backend()} "
                                          "backend, not tensorflow", remedy="set KERAS_BACKEND=tensorflow before importing keras",
                                          backend="tf")
        foreign = _foreign((args, kwargs))
        if foreign:
            raise BackendUnsupportedError("foreign_tensor_input", f"an input is a {foreign}, not a tf.Tensor",
                                          remedy="convert inputs with tf.constant(...) before tracing with backend='tf'",
                                          backend="tf")
        odd = _not_a_value((args, kwargs))
        if odd:
            raise InvalidArgumentError("invalid_argument", f"an input is a {odd}, not a tf.Tensor value",
                                       remedy="pass concrete dense tensors: tf.convert_to_tensor(variable), "
                                              "sparse.to_dense() / ragged.to_tensor(); call a model on values, not on "
                                              "keras.Input placeholders", backend="tf", input_type=odd)
        if not self.leaves((args, kwargs)):
            raise InvalidArgumentError("invalid_argument", "no input of the call is a tf.Tensor",
                                       remedy="pass the model's inputs as tf.Tensor values (tf.constant(...)): an input "
                                              "the backend cannot see would be recorded as a constant, not an input",
                                       backend="tf")
        if isinstance(model, keras.layers.Layer):
            for addr, m in model_modules(model):
                for key, value in vars(m).items():
                    foreign = _foreign([value])
                    if foreign and not isinstance(value, np.ndarray):
                        where = key if addr == "self" else f"{addr}.{key}"
                        raise BackendUnsupportedError(
                            "foreign_tensor_input", f"the model mixes frameworks: {where} is a {foreign}",
                            remedy="hold tf values only in a Keras model (convert with tf.constant(...))",
                            backend="tf", attribute=where)
            if not model.built:
                raise InvalidArgumentError("model_type_unsupported", f"the Keras model {model.name!r} is not built: "
                                           "its first call would create its variables", backend="tf",
                                           remedy="call the model once (or model.build(input_shape)) before tracing it")

    def capture(self, model: Any, args: tuple, kwargs: dict, save: Any = "all", capture: Any = None,
                replay_rng: bool = True, **options: Any) -> Any:
        plan = self.open_capture(capture, options, replay_rng, save)
        self._check_inputs(model, args, kwargs)
        self.refuse_reentrant(patch.ACTIVE.recorder)
        modules = model_modules(model)
        log = EventLog()
        rec = _Recorder(modules, log, _WRAPPER_CODE)
        is_layer = isinstance(model, keras.layers.Layer)
        info = ModelInfo(type(model).__name__ if is_layer or isinstance(model, tf.Module)
                         else getattr(model, "__name__", type(model).__name__))
        self.describe_modules(info, modules)
        seen_vars: set[int] = set()
        taken: set[str] = set()
        for addr, m in modules:
            for pname, v, trainable in _own_variables(m):
                tv = tf_variable(v)
                if tv is None or id(tv) in seen_vars:
                    continue
                seen_vars.add(id(tv))
                paddr = pname if addr == "self" else f"{addr}.{pname}"
                k = 1
                while paddr in taken:  # two weights of one layer with one name
                    k += 1
                    paddr = f"{pname}_{k}" if addr == "self" else f"{addr}.{pname}_{k}"
                taken.add(paddr)
                value = tv.value()  # the value read now (replay and saved files use it)
                info.params.append(ParamInfo(paddr, addr, pname, _shape(value), _dtype(value), bool(trainable), value))
                rec.handle_param[id(tv.handle)] = paddr
                rec.alive.append(tv.handle)
        for path, leaf in self.input_leaves(args, kwargs):
            rec.source("input", leaf, path)
        prov, start = self.start_provenance(model, tf.__version__)
        layers = [m for _a, m in modules if isinstance(m, keras.layers.Layer)]
        patches = patch.Patches(patch.defining_classes(layers), _module_call_wrapper, _callback)
        out: Any = None
        try:
            patch.ACTIVE.recorder = rec
            try:
                patches.install()
                if is_layer:
                    out = model(*args, **kwargs)
                else:
                    rec.enter(model, args, kwargs)
                    out = model(*args, **kwargs)
                    rec.exit(out)
            finally:
                patches.restore()
                patch.ACTIVE.recorder = None
        except BackendUnsupportedError:
            raise
        except Exception as exc:
            raise self.forward_failed(info, log, prov, exc) from exc
        rec.record_outputs(self.leaves(out, "output"))
        return self.finish_capture(info, log, out, prov, start, capture, plan)


__all__ = ["TFBackend", "model_modules"]
