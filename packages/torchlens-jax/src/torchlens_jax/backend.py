"""`JAXBackend`: the BackendProtocol implementation for JAX (preview).

A capture traces the model once with `jax.make_jaxpr` (parameters and buffers passed as
explicit arguments, every module call inside a marker `jax.named_scope`), then evaluates
the jaxpr equation by equation on the real values (`torchlens_jax.interpret`), emitting
core events. Core's builder turns them into the Trace.

Randomness: JAX has no hidden random state. A forward that draws random numbers takes its
key as an input (or holds it as a buffer), the key is recorded like any other value, and
the random primitives (`random_bits`, `threefry2x32`, ...) replay exactly from it: the
backend declares `rng_replay=True`, and `replay_rng=` is accepted (a bool; keys are always
recorded, so both values capture the same). The capture consumes no randomness of its own
and `seed=` has nothing to seed: it refuses with `explicit_seed_unsupported`.

Gradients: `CaptureOptions(backward_ready=True, save_grads=True)` keeps what a backward
needs; `trace.backward(loss)` then fills every saved op's `grads` with `jax.vjp` over the
evaluated jaxpr (`torchlens_jax.grads`).

Interventions: `interventions=True`. Replay edits run through `JaxEditOps`
(`torchlens_jax.edit_ops`, jax.numpy) and re-bind each recorded primitive of the edited
op's downstream cone; a live edit (`intervene=`, `tl.sweep`, the rerun engine) reaches the
capture as core's edit plan (`_edit_plan`), which the interpreter applies to an equation's
outputs before any later equation reads them; `attach_module_edits` edits module outputs
for `tl.when(...).bind(model)` and the guarded fast rerun.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from contextlib import nullcontext
from typing import Any, Hashable

import jax
import numpy as np

from torchlens.backends.sdk import (
    BackendCapabilities,
    BackendUnsupportedError,
    EventLog,
    InvalidArgumentError,
    OpEvent,
    Provenance,
    TraceCaptureError,
    ValidationStatus,
    apply_save,
    build_trace,
    check_requested_capabilities,
    keyword_path,
    positional_path,
    refusal_codes_for,
    save_plan,
)
from torchlens_jax import __version__
from torchlens_jax.describe import Description, describe, describe_linen, model_kind, unwrap_jit
from torchlens_jax.interpret import Interpreter, Traced, shape_dtype
from torchlens_jax.plugin import FRAMEWORK
from torchlens_jax.scopes import CallTable, Recorder, module_scopes

_FOREIGN = {"torch", "tensorflow", "keras", "paddle", "mlx", "tinygrad"}
_TRACE_CACHE: OrderedDict[Hashable, Traced] = OrderedDict()
_TRACE_CACHE_MAX = 64
_TRACE_LOCK = threading.Lock()


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _input_leaves(args: tuple, kwargs: dict) -> tuple[list[tuple[str, Any]], list[Any], list[int], Any]:
    """(path, array) for each array leaf of the call, every leaf, array positions, treedef."""
    flat, treedef = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)))
    n_arrays = sum(1 for _, leaf in flat if _is_array(leaf))
    out, positions = [], []
    for i, (path, leaf) in enumerate(flat):
        top = type(leaf).__module__.split(".")[0]
        if top in _FOREIGN:
            raise BackendUnsupportedError("foreign_tensor_input", f"input {jax.tree_util.keystr(path)} is a {top} value",
                                          remedy="pass jax arrays (or numpy arrays) to a JAX model", framework=top)
        if _is_array(leaf):
            out.append((_path_text(path, n_arrays), leaf))
            positions.append(i)
    return out, [leaf for _, leaf in flat], positions, treedef


def _refuse_tracers(where: str, values: list[Any], names: list[str] | None = None) -> None:
    """`tl.trace` called inside `jax.jit`, `jax.grad`, `jax.vmap` (or any JAX transform) sees
    tracers, not values: a trace of them would record leaked tracers. Refuse before anything
    is recorded."""
    for i, v in enumerate(values):
        if isinstance(v, jax.core.Tracer):
            name = names[i] if names is not None else f"{where}[{i}]"
            raise InvalidArgumentError(
                "trace_inside_jax_transform",
                f"{where} {name} is a JAX tracer ({type(v).__name__}): tl.trace was called inside jax.jit, "
                "jax.grad, jax.vmap or another JAX transform",
                remedy="call tl.trace outside the transform on concrete arrays (tl.trace evaluates the model "
                       "itself; to trace a jitted function, pass it to tl.trace: its body is stepped into)",
                where=where, name=name, tracer=type(v).__name__)


def _path_text(path: tuple, n_arrays: int) -> str:
    """Core's input-path convention (`torchlens.backends.sdk.input_paths`): `args[i]...` /
    `kwargs['k']...`, the nested part in jax's key notation (`[0]`, `['k']`, `.f`)."""
    first = path[0].idx if hasattr(path[0], "idx") else 0
    rest = jax.tree_util.keystr(tuple(path[2:]))
    if first == 0:
        idx = path[1].idx if hasattr(path[1], "idx") else path[1]
        return positional_path(idx) + rest
    key = path[1].key if hasattr(path[1], "key") else path[1]
    return keyword_path(key) + rest


def _output_paths(out: Any) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(out)
    if len(flat) == 1 and not flat[0][0]:
        return [("output", flat[0][1])]
    return [(f"output{jax.tree_util.keystr(p)}", leaf) for p, leaf in flat]


def _static_key(leaves: list[Any], positions: list[int]) -> Hashable | None:
    pos = set(positions)
    statics = tuple(leaf for i, leaf in enumerate(leaves) if i not in pos)
    try:
        hash(statics)
    except TypeError:
        return None
    return statics


def trace_model(desc: Description, model: Any, all_leaves: list[Any], positions: list[int], treedef: Any,
                arrays: list[Any]) -> Traced:
    """Trace the model to a closed jaxpr (cached by model structure and input types)."""
    statics = _static_key(all_leaves, positions)
    key = None
    if desc.cache_key is not None and statics is not None:
        key = (desc.cache_key, treedef, statics, tuple(positions),
               tuple((tuple(a.shape), str(a.dtype), type(a).__name__) for a in arrays))
        with _TRACE_LOCK:
            hit = _TRACE_CACHE.get(key)
            if hit is not None:
                _TRACE_CACHE.move_to_end(key)
                return hit
    table = CallTable()
    recorder = Recorder(table)
    written: list[int] = []

    def traced(leaves: list[Any], xs: list[Any]) -> Any:
        full = list(all_leaves)
        for p, x in zip(positions, xs):
            full[p] = x
        args, kwargs = jax.tree_util.tree_unflatten(treedef, full)
        m = desc.rebuild(leaves)
        recorder.addr_of = {id(obj): (addr or "self") for addr, obj in desc.modules_of(m)}
        with recorder.call(m, "self"):
            out = m(*args, **kwargs)
        after = desc.state_after(m) if desc.state_after is not None else None
        if after is None:
            if desc.state_after is not None:
                raise BackendUnsupportedError(
                    "state_structure_changed", "the forward added or removed module state (an nnx Variable)",
                    remedy="create every Variable in __init__ and only assign .value in the forward")
            return out, []
        written[:] = [i for i, (a, b) in enumerate(zip(leaves, after)) if a is not b]
        return out, [after[i] for i in written]  # state the forward wrote: extra outputs, never written back

    modules = [obj for _, obj in desc.modules_of(model)]
    with module_scopes(modules, recorder), (desc.scopes(recorder) if desc.scopes is not None else nullcontext()):
        closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(list(desc.leaves), list(arrays))
    _refuse_tracers("closure constant", list(closed.consts))  # a closure over an outer transform's tracer
    result = Traced(closed, jax.tree_util.tree_structure(out_shape[0]), table, len(desc.leaves), tuple(written))
    if key is not None:
        with _TRACE_LOCK:
            _TRACE_CACHE[key] = result
            if len(_TRACE_CACHE) > _TRACE_CACHE_MAX:
                _TRACE_CACHE.popitem(last=False)
    return result


def _record_state_writes(backend: JAXBackend, trace: Any, desc: Description, written: tuple[int, ...],
                         writes: list[tuple[Any, tuple]]) -> None:
    """nnx state the forward wrote (a batch norm's running stats, an RNG stream's counter) as
    `Module.attribute_writes`: {name under the module: AttributeWrite("replaced", value)} on
    the module owning the Variable. The model itself is never changed (the capture evaluates
    a merged copy): apply the values with `nnx.update` to advance it."""
    from torchlens.backends.sdk import AttributeWrite

    owners = {r.address: (r.module, r.name) for r in [*desc.info.params, *desc.info.buffers]}
    for rec in trace._modules.values():
        rec._attribute_writes = {}
    for i, (value, _) in zip(written, writes):
        module, name = owners[desc.addresses[i]]
        rec = trace._modules.get(module)
        if rec is not None:
            rec._attribute_writes[name] = AttributeWrite("replaced", backend.host_copy(value))


def _note_buffer_write(ev: OpEvent, address: str) -> None:
    ev.meta["buffer_write"] = tuple(dict.fromkeys((*ev.meta.get("buffer_write", ()), address)))


def _linen_buffer_writes(interp: Interpreter, desc: Description, kwargs: dict, output: Any, outs: list) -> None:
    """`module.apply(variables, x, mutable=[...])` returns `(y, updated collections)`: each
    updated variable that names a buffer (batch_stats, ...) marks the op that computed its
    new value as a version of that buffer (`meta["buffer_write"]`, `Buffer.versions`)."""
    from collections.abc import Mapping

    if not kwargs.get("mutable") or not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], Mapping)):
        return
    n_first = len(jax.tree_util.tree_leaves(output[0]))
    flat, _ = jax.tree_util.tree_flatten_with_path(output[1])
    buffers = {a for a, p in zip(desc.addresses, desc.is_param) if not p}
    for (path, _), (_, src) in zip(flat, outs[n_first:]):
        names = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        address = desc.variable_address.get(names)
        ev = interp.op_events.get(src[1]) if src[0] == "ev" else None
        if address in buffers and ev is not None:
            _note_buffer_write(ev, address)


def clear_trace_cache() -> None:
    with _TRACE_LOCK:
        _TRACE_CACHE.clear()


class JAXBackend:
    """BackendProtocol implementation for JAX: plain functions, flax.nnx and equinox modules."""

    name = "jax"
    maturity = "preview"
    framework = FRAMEWORK
    materialization = "eager"
    _OPTIONS = frozenset({"save", "capture", "replay_rng", "loops", "param_args"})
    #: Refusals of this backend beyond those `refusal_codes_for` derives from capabilities().
    _OWN_REFUSALS = frozenset({"foreign_tensor_input", "value_dependent_branch_unsupported"})

    # identity -----------------------------------------------------------------------------------
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(validation_replay=True, payload_materialization=True, backward_capture=True,
                                   rng_replay=True, interventions=True)

    # interventions ------------------------------------------------------------------------------
    def edit_ops(self) -> Any:
        """The `jax.numpy` math edits and replay run with (`torchlens_jax.edit_ops.JaxEditOps`)."""
        from torchlens_jax.edit_ops import JaxEditOps

        return JaxEditOps()

    def attach_module_edits(self, model: Any, rules: list, ops: Any, fired: dict) -> Any:
        """Bound-executor hooks: edit each targeted module call's array outputs as it returns."""
        from torchlens_jax.edit_ops import attach_module_edits

        model = unwrap_jit(model)
        kind = model_kind(model)
        modules = describe(model).modules_of(model) if kind in ("nnx", "equinox") else []
        return attach_module_edits(model, modules, rules, ops, fired)

    def runtime_available(self) -> str | None:
        cached = self.__dict__.get("_runtime")
        if cached is not None:
            return cached[0]
        code = self._runtime_check()
        self.__dict__["_runtime"] = (code,)
        return code

    def _runtime_check(self) -> str | None:
        try:
            version = FRAMEWORK.installed_version()
            if version is None:
                return "runtime_missing"
            return None if FRAMEWORK.contains(version) else "runtime_version_unsupported"
        except Exception:  # noqa: BLE001 - never raises, by contract
            return "runtime_missing"

    def trace_options(self) -> frozenset[str]:
        return self._OPTIONS

    def refusal_codes(self) -> frozenset[str]:
        return refusal_codes_for(self, self._OWN_REFUSALS)

    # values ---------------------------------------------------------------------------------------
    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, jax.Array)

    def host_copy(self, value: Any) -> np.ndarray:
        """A NumPy copy with shape and dtype kept (0-d stays 0-d); typed PRNG keys are
        copied as their raw key data."""
        if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        return np.array(value, copy=True)

    def from_host(self, values: Any, like: Any = None) -> Any:
        """A jax.Array holding `values` (dtype of `like` when given)."""
        return jax.numpy.asarray(values, dtype=None if like is None else like.dtype)

    def payload_codec(self) -> Any:
        """The codec `trace.save` / `tl.load` use for this backend's payloads."""
        from torchlens_jax.codec import JaxCodec

        return JaxCodec()

    def realize_once(self, values: Any) -> Any:
        return values  # eager: every value is concrete when recorded

    # capture ----------------------------------------------------------------------------------------
    def can_handle(self, model: Any, args: tuple, kwargs: dict) -> bool:
        """flax.nnx and equinox modules always (a foreign input then refuses typed in capture);
        a plain callable when its inputs hold a JAX or NumPy array and no other framework's."""
        model = unwrap_jit(model)
        kind = model_kind(model)
        if kind in ("nnx", "equinox", "linen"):
            return True
        if kind != "function":
            return False
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if any(type(x).__module__.split(".")[0] in _FOREIGN for x in leaves):
            return False
        return any(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)

    def reference_output(self, model: Any, args: tuple, kwargs: dict) -> Any:
        return model(*args, **kwargs)

    def capture(self, model: Any, args: tuple, kwargs: dict, save: Any = "all", capture: Any = None,
                replay_rng: bool = True, _edit_plan: Any = None, loops: str = "unrolled", param_args: Any = None,
                **options: Any) -> Any:
        t_entry = time.perf_counter()  # setup_duration: from here to the forward's start
        # the same pre-capture refusals tl.trace makes, for callers that reach capture directly
        check_requested_capabilities(self, capture, options)
        if not isinstance(replay_rng, bool):
            raise InvalidArgumentError("invalid_argument", f"replay_rng= takes a bool, not {type(replay_rng).__name__}",
                                       remedy="replay_rng=True (JAX keys are recorded inputs: draws always replay)",
                                       option="replay_rng")
        if loops not in ("unrolled", "rolled"):
            raise InvalidArgumentError("invalid_argument", f"loops= takes 'unrolled' or 'rolled', not {loops!r}",
                                       remedy="loops='unrolled' (each step's ops, one module call per step; at most "
                                              "1,024 steps) or loops='rolled' (each scan / while loop one op, any length)",
                                       option="loops")
        plan = save_plan(save)
        model = unwrap_jit(model)  # nnx.jit / eqx.filter_jit: trace what they wrap (jitted code is stepped into anyway)
        if model_kind(model) is None:
            raise InvalidArgumentError("model_type_unsupported", f"the jax backend cannot trace a {type(model).__name__}",
                                       remedy="pass a JAX function, a flax.nnx.Module, an equinox.Module or a flax.linen module with its variables",
                                       model_type=type(model).__name__)
        if model_kind(model) == "linen":  # its variables travel with the call: split them off first
            from torchlens_jax.describe import split_linen

            module, variables, args, kwargs = split_linen(model, args, kwargs)
            _refuse_tracers("variable", jax.tree_util.tree_leaves(variables))
            desc = describe_linen(module, variables, args, kwargs)
        if param_args is not None:  # the caller names the arguments holding parameters
            if model_kind(model) != "function":
                raise InvalidArgumentError("invalid_argument", "param_args= is for plain functions; a module's "
                                           "parameters are named from the module already",
                                           remedy="drop param_args=", option="param_args")
            from torchlens_jax.describe import describe_function_params

            desc, args, kwargs = describe_function_params(model, args, kwargs, param_args)
        inputs, all_leaves, positions, treedef = _input_leaves(args, kwargs)
        _refuse_tracers("input", [x for _, x in inputs], [p for p, _ in inputs])
        if model_kind(model) != "linen" and param_args is None:
            desc = describe(model)
        _refuse_tracers("model leaf", list(desc.leaves), list(desc.addresses))
        start = time.perf_counter()
        prov = Provenance("jax", backend_version=__version__, framework_version=jax.__version__, model_class=desc.root_class,
                          start_time=time.time(), root_entry_point="function" if desc.kind == "function" else "module")
        prov.extra["model_kind"] = desc.kind
        prov.extra["loops"] = loops
        prov.extra["setup_duration"] = start - t_entry  # refusals, model description, input leaves
        arrays = [x for _, x in inputs]
        log = EventLog()
        try:
            traced = trace_model(desc, model, all_leaves, positions, treedef, arrays)
            interp = Interpreter(traced, log, desc.addresses, desc.is_param, edit_plan=_edit_plan, rolled=loops == "rolled")
            outs = interp.run(list(desc.leaves), inputs)
        except (BackendUnsupportedError, InvalidArgumentError):
            raise
        except Exception as exc:
            partial = build_trace(desc.info, log, output_state="output_forward_failed", provenance=prov, backend=self)
            raise TraceCaptureError("forward_failed", f"the forward raised {type(exc).__name__}: {exc}",
                                    remedy="fix the forward; exc.partial_trace holds the ops recorded before the failure",
                                    partial_trace=partial) from exc
        n_out = len(outs) - len(traced.written)
        outs, writes = outs[:n_out], outs[n_out:]
        values = [v for v, _ in outs]
        output = jax.tree_util.tree_unflatten(traced.out_tree, values)
        returned = []
        for (path, leaf), (_, src) in zip(_output_paths(output), outs):
            ref = interp._materialize(src, 0) if src[0] in ("const", "buffer") else src
            parents = ((ref[1], ref[2]),) if ref[0] == "ev" else ()
            if src[0] != "ev" and ref[0] == "ev" and ref[1] in interp.edited:
                leaf = interp.edited[ref[1]][ref[2]]  # an edited buffer or constant returned as it is
            i = log.new_id()
            leaf = interp.edit(i, (leaf,))[0]  # a live edit of the output op changes what the model returns
            returned.append(leaf)
            shape, dtype = shape_dtype(leaf)
            log.append(OpEvent(i, "output", "output", parents=parents, outputs=(leaf,), shapes=(shape,), dtypes=(dtype,), path=path,
                               meta={"param": ref[1]} if ref[0] == "param" else {}))
        if interp.edited:
            output = jax.tree_util.tree_unflatten(traced.out_tree, returned)
        interp.finish_module_calls(log.events)
        prov.duration = time.perf_counter() - start
        prov.end_time = time.time()
        prov.extra["num_equations"] = len(traced.closed.jaxpr.eqns)
        for i, (_, src) in zip(traced.written, writes):
            ev = interp.op_events.get(src[1]) if src[0] == "ev" else None
            if ev is not None:
                ev.meta["state_write"] = desc.addresses[i]
                if not desc.is_param[i]:  # a buffer's new value: a recorded version of it
                    _note_buffer_write(ev, desc.addresses[i])
        if desc.kind == "linen":
            _linen_buffer_writes(interp, desc, kwargs, output, outs)
        trace = build_trace(desc.info, log, output=output, provenance=prov, options=capture, backend=self)
        if desc.state_after is not None:
            _record_state_writes(self, trace, desc, traced.written, writes)
        trace.cost.forward_duration = prov.duration
        if capture is not None and (capture.backward_ready or capture.save_grads):
            from torchlens_jax.grads import keep_for_backward

            keep_for_backward(trace, traced.out_tree, save_grads=bool(capture.save_grads),  # before save= drops sources
                              edit_plan=_edit_plan)
        apply_save(trace, plan)
        # from the forward's end (tracing + evaluation) to here: records built, backward kept, save= applied
        prov.extra["cleanup_duration"] = time.perf_counter() - (start + prov.duration)
        return trace

    # gradients ----------------------------------------------------------------------------------------
    def backward(self, trace: Any, loss: Any = None, **kwargs: Any) -> Any:
        """Fill `op.grads` of every saved op: the gradient of `loss(output)` (a callable of the
        model's output pytree returning a scalar; default the sum of its float leaves) with
        respect to each output slot, by `jax.vjp` over the evaluated jaxpr."""
        from torchlens_jax.grads import backward

        return backward(trace, loss, **kwargs)

    # validation ---------------------------------------------------------------------------------------
    def rebind_op(self, op: Any) -> Any:
        """A loaded op's callable, rebuilt from its recorded primitive name and parameters,
        or None (the op then stays opaque and refuses replay).

        The primitive comes from the closed primitive table only (`primitive_table()`: JAX's
        own data primitives, by name), never from an import. Parameters are data: a
        parameter holding a callable placeholder or an unencodable stand-in (a saved jaxpr,
        callback or custom rule, which a file never carries as code) leaves the op opaque."""
        from torchlens.backends.sdk import CallablePlaceholder
        from torchlens_jax.interpret import PrimitiveCall

        if not isinstance(op.func, CallablePlaceholder) or not isinstance(op.meta, dict):
            return None
        scan = _scan_op(op.meta.get("scan_op"))
        if scan is not None:
            return scan
        name = op.meta.get("primitive")
        params = op.meta.get("primitive_params")
        if not isinstance(name, str) or type(params) is not dict:
            return None
        if name == "sharding_constraint":  # a placement hint: the value passes through unchanged
            from torchlens_jax.interpret import ShardingPassThrough

            prim = primitive_table().get(name)
            return None if prim is None else ShardingPassThrough(prim)
        if not all(type(k) is str for k in params) or not _plain_data(params):
            return None
        prim = primitive_table().get(name)
        if prim is None:
            return None
        placed = op.meta.get("in_shardings")
        if placed is not None:  # inputs sharded over several devices: place them the same way, or stay opaque
            return _sharded_call(prim, dict(params), placed)
        return PrimitiveCall(prim, dict(params))

    def validate(self, trace: Any, ground_truth: Any = None) -> ValidationStatus:
        from torchlens_jax.validate import validate_trace

        return validate_trace(self, trace, ground_truth)


#: Primitives whose parameters carry code (jaxprs, Python callbacks, custom rules, native
#: targets, serialized modules): never in the table, so a saved op naming one stays opaque.
_CODE_PRIMITIVES = frozenset({
    "cond", "while", "scan", "pure_callback", "io_callback", "debug_callback", "debug_print", "inspect_sharding",
    "ffi_call", "call_exported", "custom_partitioning", "custom_linear_solve", "custom_vmap_call", "custom_transpose_call",
    "custom_jvp_call_jaxpr", "linear_call", "eval_jaxpr", "call", "call_hi_primitive", "call_hi_primitive_linearized",
    "core_map", "run_state", "shard_map", "xla_pmap", "xla_call", "pallas_call", "cudnn_fusion", "remat_opt",
    "platform_index", "shape_assertion",
})
_PRIMITIVES: dict[str, Any] | None = None
_PRIMITIVES_LOCK = threading.Lock()


def _scan_op(spec: Any) -> Any:
    """The ScanSlice / ScanStack a loaded scan op's `meta["scan_op"]` names, or None."""
    from torchlens_jax.interpret import ScanSlice, ScanStack

    if type(spec) is not dict:
        return None
    if spec.get("op") == "slice" and set(spec) == {"op", "index"} and type(spec["index"]) is int and spec["index"] >= 0:
        return ScanSlice(spec["index"])
    if spec.get("op") == "stack" and set(spec) == {"op", "reverse"} and type(spec["reverse"]) is bool:
        return ScanStack(spec["reverse"])
    return None


def _sharded_call(prim: Any, params: dict, placed: Any) -> Any:
    """A ShardedPrimitiveCall from a loaded op's `meta["in_shardings"]` (each entry None or
    {"axes": ((name, size), ...), "types": (...), "spec": (...)}), or None when the data is
    malformed or this process has fewer devices than the recorded mesh."""
    from torchlens_jax.interpret import ShardedPrimitiveCall

    if type(placed) is not tuple or not _plain_data(placed):
        return None
    for entry in placed:
        if entry is None:
            continue
        if type(entry) is not dict or set(entry) != {"axes", "types", "spec"}:
            return None
        axes, types, spec = entry["axes"], entry["types"], entry["spec"]
        if not (type(axes) is tuple and all(type(a) is tuple and len(a) == 2 and type(a[0]) is str and type(a[1]) is int
                                             and a[1] > 0 for a in axes)):
            return None
        if not (type(types) is tuple and all(type(t) is str and t in jax.sharding.AxisType.__members__ for t in types)):
            return None
        if not (type(spec) is tuple and all(e is None or type(e) is str
                                            or (type(e) is tuple and all(type(x) is str for x in e)) for e in spec)):
            return None
        if int(np.prod([k for _, k in axes])) > jax.device_count():
            return None
    return ShardedPrimitiveCall(prim, params, placed)


def _plain_data(value: Any, depth: int = 0) -> bool:
    """True when a decoded parameter value holds no callable placeholder and no unencodable
    stand-in at any depth (the decoder yields nothing else that could stand for code)."""
    from torchlens.backends.sdk import CallablePlaceholder, UnencodableValue

    if isinstance(value, (CallablePlaceholder, UnencodableValue)) or depth > 100:
        return False
    if type(value) in (tuple, list) or isinstance(value, tuple):
        return all(_plain_data(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(_plain_data(k, depth + 1) and _plain_data(v, depth + 1) for k, v in value.items())
    return True


def primitive_table() -> dict[str, Any]:
    """The closed primitive table: name -> JAX primitive object, for every data primitive
    JAX defines (scanned once from JAX's own modules; a name two primitives share, a call or
    map primitive and the code-carrying primitives in `_CODE_PRIMITIVES` are left out)."""
    global _PRIMITIVES
    with _PRIMITIVES_LOCK:
        if _PRIMITIVES is None:
            _PRIMITIVES = _build_primitive_table()
        return _PRIMITIVES


def _build_primitive_table() -> dict[str, Any]:
    import sys

    import jax.lax  # noqa: F401  (the modules that define the primitives a capture records)
    import jax.nn  # noqa: F401
    import jax.numpy  # noqa: F401
    import jax.random  # noqa: F401
    from jax.extend.core import Primitive

    from torchlens_jax.interpret import CALL_PRIMITIVES

    found: dict[str, set] = {}
    objs: dict[int, Any] = {}
    for modname, mod in sorted(sys.modules.items()):
        if not (modname == "jax" or modname.startswith("jax.")) or mod is None:
            continue
        for v in list(getattr(mod, "__dict__", {}).values()):
            if isinstance(v, Primitive):
                found.setdefault(v.name, set()).add(id(v))
                objs[id(v)] = v
    table = {}
    for name, ids in found.items():
        prim = objs[next(iter(ids))]
        if (len(ids) != 1 or name in _CODE_PRIMITIVES or name in CALL_PRIMITIVES
                or getattr(prim, "call_primitive", False) or getattr(prim, "map_primitive", False)):
            continue
        table[name] = prim
    return table


_BACKEND: JAXBackend | None = None


def get_backend() -> JAXBackend:
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = JAXBackend()
    return _BACKEND


__all__ = ["JAXBackend", "get_backend", "trace_model", "clear_trace_cache"]
