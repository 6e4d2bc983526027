"""The Trace: the finalized record of one executed path."""

from __future__ import annotations

import copy as _copy
import threading
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from typing import TYPE_CHECKING, Any, Iterator

from torchlens.errors import (
    AmbiguousOpLookupError,
    InvalidArgumentError,
    LookupMissError,
    PayloadUnavailableError,
    SelectorCompositionError,
)
from torchlens.records.collections import (
    BufferCollection,
    LayerCollection,
    ModuleCallCollection,
    ModuleCollection,
    OpCollection,
    ParamCollection,
    split_pass_token,
)
from torchlens.records.module import Buffer, Module, ModuleCall, Param
from torchlens.records.op import Layer, Op
from torchlens.records.ports import port
from torchlens.types import TraceLike

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.types import Duration


def _scope(value: Any) -> Any:
    """`Provenance.distributed_scope`, checked against its closed vocabulary (issue 24)."""
    if value is None or value == "rank_local_shard":
        return value
    from torchlens.errors import ArtifactError

    raise ArtifactError("distributed_scope_invalid", f"provenance distributed_scope {value!r} is not None or 'rank_local_shard'",
                        remedy="load an artifact TorchLens wrote, unedited", field="distributed_scope")


#: held while deferred `Provenance.extra` entries are settled (one walk; other readers wait for it)
_SETTLE_LOCK = threading.RLock()


@dataclass
class Provenance:
    """How, when and from what the capture happened."""

    backend: str
    backend_version: str | None = None
    framework_version: str | None = None
    kind: str = "trace"
    model_class: str = ""
    start_time: float = 0.0
    end_time: float = 0.0
    duration: float = 0.0
    root_entry_point: str = "module"
    verified: bool = True
    verification_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    # Spec fields a backend records in `extra` (saved and loaded with it), promoted to named
    # attributes. None where the backend did not record the fact (docs/reference/trace-facts.md).
    @property
    def owner_thread_id(self) -> int | None:
        """`threading.get_ident()` of the thread that ran the capture."""
        return self.extra.get("owner_thread_id")

    @property
    def thread_count_start(self) -> int | None:
        """`threading.active_count()` just before the forward."""
        return self.extra.get("thread_count_start")

    @property
    def thread_count_end(self) -> int | None:
        """`threading.active_count()` just after the forward."""
        return self.extra.get("thread_count_end")

    @property
    def thread_activity_detected(self) -> bool | None:
        """Whether Python code ran on another thread during the forward."""
        return self.extra.get("thread_activity_detected")

    @property
    def model_object_id(self) -> int | None:
        """`id()` of the traced model object at capture time (identity within that process only)."""
        return self.extra.get("model_object_id")

    @property
    def setup_duration(self) -> Duration | None:
        """Seconds from the capture's start to the start of the model's forward (preparing
        the model, snapshotting its state, installing the interception)."""
        return _duration(self.extra.get("setup_duration"))

    @property
    def cleanup_duration(self) -> Duration | None:
        """Seconds from the end of the forward to the capture's return (removing the
        interception, restoring the model's state, building the records)."""
        return _duration(self.extra.get("cleanup_duration"))

    @property
    def fingerprint(self) -> str | None:
        """Address-free structural hash of the captured graph (sha256 hex): every op's
        callable, kind, parent positions, output shapes and dtypes and owning module class,
        in execution order. Equal for two captures of the same architecture on inputs of the
        same shapes, whatever the weights or module names. Computed on first read (and
        before the trace is saved or pickled), then kept."""
        value = self.extra.get("fingerprint")
        make = self.__dict__.get("_fingerprinter")
        if value is None and make is not None:
            value = self.extra["fingerprint"] = make()
            self.__dict__.pop("_fingerprinter", None)
        return value

    @property
    def input_structure(self) -> str | None:
        """The input tree as text: one `path: description` entry per leaf (a tensor's type,
        shape and dtype; a plain scalar's type and value; another object's type)."""
        return self.extra.get("input_structure")

    @property
    def input_signature_hash(self) -> str | None:
        """sha256 hex of `input_structure`: equal for inputs of the same tree, shapes, dtypes
        and scalar values, whatever the tensors' contents."""
        return self.extra.get("input_signature_hash")

    @property
    def input_object_id(self) -> int | None:
        """`id()` of the first input object (the first positional input, else the first
        keyword input) at capture time; identity within that process only."""
        return self.extra.get("input_object_id")

    @property
    def param_hash_quick(self) -> str | None:
        """sha256 hex over every parameter's address, shape, dtype, device and
        requires_grad plus up to 16 evenly spaced elements of it, taken before the forward:
        cheap, and changed by any update that touches most elements (an optimizer step)."""
        return self.extra.get("param_hash_quick")

    @property
    def param_hash_full(self) -> str | None:
        """sha256 hex over every parameter's addresses, shape, dtype and all of its bytes.
        Computed on first read (and by `Trace.save`) from the parameter values the trace
        holds, then kept; None (reason in `unavailable`) when a parameter changed since the
        capture, because its capture-time bytes are gone."""
        self.fingerprint  # noqa: B018 - a save reads this first, so the file keeps the lazy fingerprint too
        value = self.extra.get("param_hash_full")
        hasher = self.__dict__.get("_param_hasher")
        if value is None and hasher is not None:
            value, why = hasher()
            if value is not None:
                self.extra["param_hash_full"] = value
                self.__dict__.pop("_param_hasher", None)
            else:
                self.__dict__["_param_hash_full_reason"] = why
        return value

    # Spec fields this build never records: None, the reason in `unavailable` (never guessed).
    cache_hit = property(lambda self: self.extra.get("cache_hit"), doc="Whether a capture-cache hit answered (no cache yet).")
    cache_key = property(lambda self: self.extra.get("cache_key"), doc="The capture-cache key (no cache yet).")
    cache_path = property(lambda self: self.extra.get("cache_path"), doc="The capture-cache entry path (no cache yet).")
    recording_kept = property(lambda self: self.extra.get("recording_kept"), doc="Whether a Recording was kept (None for a tl.trace capture).")
    param_source = property(lambda self: self.extra.get("param_source"), doc="The parameters' portable origin (not recorded).")
    backend_config = property(lambda self: self.extra.get("backend_config"), doc="The backend's configuration (not recorded).")
    distributed_scope = property(lambda self: _scope(self.extra.get("distributed_scope")),
                                 doc="'rank_local_shard' when an armed capture recorded a collective boundary op "
                                     "(a rank-local recording, issue 24); None otherwise. Experimental.")
    observer_spans = property(lambda self: self.extra.get("observer_spans"), doc="Observer spans (no observers yet).")
    is_appended = property(lambda self: self.extra.get("is_appended"), doc="Whether the trace was appended to (no append yet).")

    @property
    def unavailable(self) -> dict[str, str]:
        """Spec provenance fields that read None on this trace, each with the reason."""
        why: dict[str, str] = {}
        self.fingerprint  # noqa: B018 - settle the lazy fields before asking which are missing
        for name in ("setup_duration", "cleanup_duration", "fingerprint", "input_structure", "input_signature_hash",
                     "input_object_id", "param_hash_quick", "owner_thread_id", "thread_count_start",
                     "thread_count_end", "thread_activity_detected", "model_object_id"):
            if self.extra.get(name) is None:
                why[name] = f"the {self.backend} backend did not record it for this capture"
        if self.param_hash_full is None:
            why["param_hash_full"] = self.__dict__.get("_param_hash_full_reason") or (
                "not computed while the capture's live parameter values were held: the trace was saved, "
                "exported or pickled before the hash was read, so this copy cannot vouch for capture-time bytes")
        never = {"cache_hit": "this build has no capture cache (cache=True)",
                 "cache_key": "this build has no capture cache (cache=True)",
                 "cache_path": "this build has no capture cache (cache=True)",
                 "recording_kept": "a tl.trace capture keeps no Recording (tl.record does)",
                 "param_source": "this build records no parameter origin",
                 "backend_config": "no backend records a configuration in this build",
                 "distributed_scope": "not a rank-local capture (no collective boundary op recorded under "
                                      "tl.distributed.arm())",
                 "observer_spans": "this build has no observers (tl.observers is not built)",
                 "is_appended": "this build has no trace append"}
        why.update({k: v for k, v in never.items() if self.extra.get(k) is None})
        return why

    def settle_extra(self) -> None:
        """Run the `extra` entries a backend deferred to their first read (torch: the grad_fn
        walk behind `extra["grad_fns"]`, which `trace.autograd` reads through this), once.
        A save, an export, a pickle and `Trace.cleanup()` call it first, so none of them sees
        an entry missing that an eager capture would have written."""
        pending = self.__dict__.get("_deferred_extra")
        if pending is None:
            return
        with _SETTLE_LOCK:  # a second reader waits for the walk instead of seeing no entry
            while pending:
                pending.pop(next(iter(pending)))()

    def __getstate__(self) -> dict[str, Any]:
        self.fingerprint  # noqa: B018 - lazy facts are settled so the copy keeps them
        self.settle_extra()
        state = dict(self.__dict__)
        for lazy in ("_param_hasher", "_fingerprinter", "_deferred_extra"):
            state.pop(lazy, None)  # they hold the live trace/model; a copy keeps what was computed
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def summary(self) -> str:
        """The capture-provenance text block: backend, model, timing, verdict and identity."""
        lines = [f"backend {self.backend} {self.backend_version or ''} (framework {self.framework_version or '?'}), "
                 f"model {self.model_class}, captured in {self.duration:.3f}s"]
        phases = [f"{name} {_duration(self.extra.get(name))}" for name in ("setup_duration", "cleanup_duration")
                  if self.extra.get(name) is not None]
        if phases:
            lines.append("phases: " + ", ".join(phases))
        lines.append("verified" if self.verified else f"not verified: {self.verification_reason}")
        self.fingerprint  # noqa: B018 - cheap next to a summary; param_hash_full is not computed for one
        for name in ("fingerprint", "input_signature_hash", "param_hash_quick", "param_hash_full"):
            value = self.extra.get(name)
            if value is not None:
                lines.append(f"{name} {value[:16]}")
        if self.input_structure:
            lines.append("inputs: " + "; ".join(self.input_structure.splitlines()))
        return "\n".join(lines)


def _duration(value: Any) -> Any:
    from torchlens.types import Duration

    return None if value is None else Duration(value)


@dataclass
class Cost:
    """Compute, memory and timing totals of the capture. The totals are `tl.types` quantities
    (`Flops`, `Macs`, `Duration`, `Bytes`): plain numbers that print with their unit; every
    assignment wraps, so a backend's `cost.forward_duration = 0.5` reads back as a Duration."""

    def __setattr__(self, name: str, value: Any) -> None:
        kind = _COST_QUANTITIES.get(name)
        if kind is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = kind(value)
        object.__setattr__(self, name, value)

    total_flops: int = 0
    total_macs: int = 0
    macs_by_kind: dict[str, int] = field(default_factory=dict)
    forward_duration: float = 0.0
    total_activation_memory: int = 0
    total_param_memory: int = 0
    num_ops_with_flops: int = 0
    backward_durations: tuple = ()

    # Fields computed from the trace's records on each read (so a loaded trace answers the
    # same); `trace.cost` binds its trace before handing the Cost out.
    def _records(self) -> Any:
        ref = self.__dict__.get("_trace_ref")
        trace = ref() if ref is not None else None
        return trace

    @property
    def forward_peak_memory(self) -> Any:
        """Liveness peak of the forward's activations, in Bytes: walking the ops in
        execution order, each op's output is allocated when the op runs and freed right
        after its last consumer runs (outputs the model returns stay to the end); the peak
        is the most bytes alive at once. Computed from recorded shapes and dtypes, the same
        on every backend and device; not an allocator reading (autograd-saved tensors and
        allocator caching come on top, and a view or in-place result counts at its own size)."""
        from torchlens.types import Bytes

        trace = self._records()
        return None if trace is None else Bytes(_liveness_peak(trace))

    @property
    def total_grad_memory(self) -> Any:
        """Bytes of the gradients a backward computes for the recorded op outputs: every
        output slot that required grad in the forward (model outputs counted once, as for
        `total_activation_memory`). Bytes(0) for an inference-only capture; None when the
        backend does not record which outputs required grad (`provenance.extra
        ["records_requires_grad"]` unset)."""
        from torchlens.types import Bytes

        trace = self._records()
        if trace is None or not trace.provenance.extra.get("records_requires_grad"):
            return None
        total = 0
        for op in trace._ops.values():
            if op.kind == "output":
                continue
            flags = op.meta.get("requires_grad") or ()
            total += sum(_slot_nbytes(op, i) for i, f in enumerate(flags) if f)
        return Bytes(total)

    @property
    def saved_grad_memory(self) -> Any:
        """Bytes of the gradients the trace holds (`op.grads` filled by `trace.backward`
        with `save_grads`); Bytes(0) before a backward."""
        from torchlens.types import Bytes

        trace = self._records()
        if trace is None:
            return None
        return Bytes(sum(_slot_nbytes(op, i) for op in trace._ops.values() if op.grads is not None
                         for i, g in enumerate(op.grads) if g is not None))

    @property
    def total_autograd_memory(self) -> Any:
        """Bytes autograd saved for backward during the captured forward, summed over the
        ops' `meta["autograd_memory"]` (each op counts every storage it saved once, a saved
        view in full; a tensor two ops save counts twice). Bytes(0) for an inference-only
        capture; None when the capture did not record gradients (the backend counts saved
        tensors only when backward_ready/save_grads is on)."""
        from torchlens.types import Bytes

        trace = self._records()
        if trace is None or not trace.provenance.extra.get("records_autograd_memory"):
            return None
        return Bytes(sum(op.meta.get("autograd_memory") or 0 for op in trace._ops.values()))

    @property
    def pinned_autograd_memory(self) -> Any:
        """Bytes the attached payloads keep alive: the tensors autograd saved for every op
        upstream of (and including) a saved op, each storage once, Parameters and views of
        them excluded. Bytes(0) when every payload is detached or the forward ran without
        grad; None on a loaded or unpickled trace (it is never saved) or when the capture did
        not record gradients."""
        from torchlens.types import Bytes

        pinned = self.__dict__.get("_pinned")
        return None if pinned is None else Bytes(pinned)

    @property
    def func_calls_duration(self) -> Any:
        """Seconds spent inside the recorded calls themselves (the sum of every op's
        measured `duration`); None when the backend times no op."""
        from torchlens.types import Duration

        trace = self._records()
        if trace is None:
            return None
        times = [op.meta.get("duration_s") for op in trace._ops.values()]
        times = [t for t in times if t is not None]
        return Duration(sum(times)) if times else None

    @property
    def overhead_duration(self) -> Any:
        """`forward_duration - func_calls_duration`: the forward's time outside the recorded
        calls (the model's own Python code between calls and TorchLens's interception)."""
        from torchlens.types import Duration

        calls = self.func_calls_duration
        return None if calls is None else Duration(max(float(self.forward_duration) - float(calls), 0.0))

    @property
    def unavailable(self) -> dict[str, str]:
        """Cost fields that read None here, each with the reason."""
        why = {}
        if self._records() is None:
            for k in ("forward_peak_memory", "total_grad_memory", "saved_grad_memory", "func_calls_duration",
                      "overhead_duration", "total_autograd_memory", "pinned_autograd_memory"):
                why[k] = "this Cost is not attached to a trace"
        else:
            if self.func_calls_duration is None:
                why["func_calls_duration"] = why["overhead_duration"] = "the backend timed no op of this capture"
            if self.total_grad_memory is None:
                why["total_grad_memory"] = "the backend does not record which op outputs required grad"
            if self.total_autograd_memory is None:
                why["total_autograd_memory"] = (
                    "autograd-saved tensors are counted only by the torch backend, during a capture that records "
                    "gradients (backward_ready=True or save_grads=True); this capture was not one")
            if self.pinned_autograd_memory is None:
                why["pinned_autograd_memory"] = (
                    "measured only during a capture that records gradients, and never saved: a loaded, "
                    "unpickled or copied trace holds no live graph to pin")
        return why

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_trace_ref", None)
        state.pop("_pinned", None)  # what live payloads pin; a copy holds none of it
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _slot_nbytes(op: Any, slot: int) -> int:
    from torchlens.records.op import itemsize, numel

    shapes, dtypes = op.shapes or (), op.dtypes or ()
    if slot >= len(shapes) or shapes[slot] is None:
        return 0
    return numel(shapes[slot]) * itemsize(dtypes[slot] if slot < len(dtypes) else None)


def _liveness_peak(trace: Any) -> int:
    ops = [op for op in trace._ops.values() if op.kind != "output"]
    position = {op.label: i for i, op in enumerate(ops)}
    end = len(ops)
    free_at: dict[int, list[str]] = {}
    for i, op in enumerate(ops):
        last = i
        for child in op.children:
            j = position.get(child)
            last = end if j is None else max(last, j)  # an output child keeps it to the end
        free_at.setdefault(last, []).append(op.label)
    live = peak = 0
    size = {op.label: op.nbytes for op in ops}
    for i, op in enumerate(ops):
        live += size[op.label]
        peak = max(peak, live)
        for label in free_at.get(i, ()):
            live -= size[label]
    return peak


def _cost_quantities() -> dict[str, type]:
    from torchlens.types import Bytes, Duration, Flops, Macs

    return {"total_flops": Flops, "total_macs": Macs, "forward_duration": Duration, "total_activation_memory": Bytes,
            "total_param_memory": Bytes}


_COST_QUANTITIES = _cost_quantities()


class _CleanedOp(Op):
    """An op of a trace after `Trace.cleanup()`: its record stays, its payload and gradient
    reads refuse `trace_cleaned_up` (same slots as Op, so `op.__class__` can switch)."""

    __slots__ = ()

    def _cleaned(self, what: str) -> PayloadUnavailableError:
        return PayloadUnavailableError("trace_cleaned_up", f"op {self.label!r}: trace.cleanup() released its {what}",
                                       remedy="read payloads before calling trace.cleanup(), or capture again",
                                       label=self.label)

    @property
    def outs(self) -> tuple[Any, ...]:
        raise self._cleaned("saved output")

    @property
    def grad(self) -> Any:
        raise self._cleaned("gradient")


class Trace(TraceLike):
    """Operations, dataflow edges, module context, selected payloads and capture metadata
    of one forward pass. `tl.trace(...)` returns one."""

    def __init__(self, provenance: Provenance | None = None, cost: Cost | None = None) -> None:
        # `provenance` / `cost`: a builder that has them already passes them (no placeholder
        # records made only to be replaced)
        self._ops: dict[str, Op] = {}
        self._layers: dict[str, Layer] = {}
        self._modules: dict[str, Module] = {}
        self._module_calls: dict[str, ModuleCall] = {}
        self._params: dict[str, Param] = {}
        self._buffers: dict[str, Buffer] = {}
        self._output: Any = None
        self._output_state: str | None = None  # None: held; else a PayloadUnavailable code
        self.uncalled_modules: list[str] = []
        self.provenance: Provenance = provenance if provenance is not None else Provenance(backend="?")
        self.options: Any = None
        self._cost: Cost = cost if cost is not None else Cost()
        self.annotations: dict[str, Any] = {}
        self.name: str = "root"
        self._backend: Any = None  # the BackendProtocol object, for verbs that execute code
        self.validation_replay_status: Any = None  # set by tl.validate / validate_forward_pass
        # state other layers keep on a trace lives in these typed slots (issue 14 §4), never in
        # ad-hoc attributes: the intervention layer's state (recipe, audit, last run, evidence;
        # made on first use), the capturing backend's own state (`backend_state`), parameter
        # stamps replay checks, the `trace.do` scopes open on it, backward passes run, and why
        # `output` is unavailable.
        self._intervention: Any = None  # torchlens.intervention.state.InterventionState, made on first use
        self._backend_state: Any = None
        self._param_stamps: Any = None
        self._scopes: list[Any] = []
        self._backward_passes: int = 0
        self._output_reason: str | None = None
        self._edit_plan: Any = None  # the edit plan a live capture ran with (rerun engine)
        self._facet_snapshot: int = 0  # id of the facet-registry snapshot frozen at capture (0: none yet)
        self._facet_writes: Any = None  # accepted facet write masks per home op (overlap checks), see select.facet

    @property
    def cost(self) -> Cost:
        """Compute, memory and timing totals; the record-derived fields read this trace."""
        import weakref

        cost = self._cost
        cost.__dict__["_trace_ref"] = weakref.ref(self)
        return cost

    @cost.setter
    def cost(self, value: Cost) -> None:
        self._cost = value

    # state slots -------------------------------------------------------------------------
    @property
    def backend_state(self) -> Any:
        """The capturing backend's own state for this trace (for example the gradient store
        `trace.backward` fills); None when the backend keeps none. Shared by forks."""
        return self._backend_state

    @backend_state.setter
    def backend_state(self, value: Any) -> None:
        self._backend_state = value

    def copy(self, name: str | None = None) -> "Trace":
        """A copy whose records can be edited independently (`trace.fork()` builds on it):
        every record is copied and points at the copy; payload values, parameter stamps and
        the backend state are shared; the copy has no intervention state and no scopes, and
        no live forward return of its own (glossary: Trace.output)."""
        new = Trace.__new__(Trace)
        new.__dict__ = dict(self.__dict__)
        new.name = name or f"{self.name}-copy"
        new._intervention = None
        new._scopes = []
        new.annotations = dict(self.annotations)
        new._ops = {}
        for label, op in self._ops.items():
            o = _copy.copy(op)
            o.children = list(op.children)
            o._trace = new
            new._ops[label] = o
        new._layers = {}
        for label, layer in self._layers.items():
            lay = _copy.copy(layer)
            lay._trace = new
            lay.ops = [new._ops[o.label] for o in layer.ops]
            new._layers[label] = lay
        for attr in ("_modules", "_module_calls", "_params", "_buffers"):
            d = {}
            for k, rec in getattr(self, attr).items():
                r = _copy.copy(rec)
                r._trace = new
                d[k] = r
            setattr(new, attr, d)
        for m in new._modules.values():
            m.calls = [new._module_calls[c.label] for c in m.calls]
        if new._output_state is None:
            new.drop_output("fork")
        return new

    def adopt(self, other: "Trace") -> None:
        """Hold `other`'s records and payloads in place (the rerun engine's result), keeping
        this trace's name, intervention state and scopes."""
        keep = (self.name, self._intervention, self._scopes)
        self.__dict__.update(other.__dict__)
        self.name, self._intervention, self._scopes = keep
        for coll in (self._ops, self._layers, self._modules, self._module_calls, self._params, self._buffers):
            for rec in coll.values():
                rec._trace = self

    def drop_output(self, reason: str) -> None:
        """The live forward return no longer describes this trace (`reason`: "fork",
        "edited"); `trace.output` then refuses with `output_not_stored`."""
        self._output, self._output_state, self._output_reason = None, "output_not_stored", reason

    def set_output(self, value: Any) -> None:
        """Hold `value` as the live forward return (a rerun's)."""
        self._output, self._output_state, self._output_reason = value, None, None

    def cleanup(self) -> None:
        """Release what this trace holds for payload reads and backward: every op's saved
        outputs and gradients, the live forward return (with its autograd graph), the
        backend's state (the gradient store) and the intervention state (staged values,
        evidence). The records stay readable (labels, shapes, dtypes, dataflow, modules,
        options, provenance; records a backend deferred to their first read, such as torch's
        grad_fn records, are taken first, then the graph they waited on is released). Afterwards `op.out`, `op.grad` and `trace.output` refuse with
        `PayloadUnavailableError` code `trace_cleaned_up`. Calling it again does nothing;
        forks and copies made earlier hold their own references and keep them. Saving a
        cleaned trace writes its records without payloads."""
        self.provenance.settle_extra()  # records deferred to their first read (grad_fns) stay readable
        for op in self._ops.values():
            op._outputs, op.saved, op.grads = (), False, None
            if type(op) is Op:
                op.__class__ = _CleanedOp
        self._output, self._output_state, self._output_reason = None, "trace_cleaned_up", "cleaned_up"
        self._backend_state = None
        self._intervention = None
        self._facet_writes = None
        self.annotations["cleaned_up"] = True

    # accessors -------------------------------------------------------------------------
    @property
    def ops(self) -> OpCollection:
        return OpCollection(self, self._ops)

    @property
    def layers(self) -> LayerCollection:
        return LayerCollection(self, self._layers)

    @property
    def modules(self) -> ModuleCollection:
        return ModuleCollection(self, self._modules)

    @property
    def module_calls(self) -> ModuleCallCollection:
        return ModuleCallCollection(self, self._module_calls)

    @property
    def params(self) -> ParamCollection:
        return ParamCollection(self, self._params)

    @property
    def buffers(self) -> BufferCollection:
        return BufferCollection(self, self._buffers)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(self._ops)

    @property
    def layer_labels(self) -> tuple[str, ...]:
        return tuple(self._layers)

    @property
    def input_ops(self) -> list[Op]:
        return [o for o in self._ops.values() if o.kind == "input"]

    @property
    def output_ops(self) -> list[Op]:
        return [o for o in self._ops.values() if o.kind == "output"]

    @property
    def output_layers(self) -> list[str]:
        """The labels of the output ops, in order (`trace[trace.output_layers[0]]` is the first)."""
        return [o.label for o in self._ops.values() if o.kind == "output"]

    @property
    def saved_ops(self) -> OpCollection:
        return self.ops.saved

    @property
    def compute_ops(self) -> OpCollection:
        return self.ops.compute

    @property
    def nonfinite_ops(self) -> OpCollection:
        """Ops whose output held NaN or Inf (needs on_nonfinite='track', 'warn' or 'raise')."""
        return self.ops.nonfinite

    # fact groups (records/facts.py) ---------------------------------------------------
    @property
    def source(self) -> Any:
        """Facts about the model's source code (`SourceFacts`)."""
        from torchlens.records.facts import source_facts

        return source_facts(self)

    @property
    def health(self) -> Any:
        """How complete the capture really was (`HealthFacts`)."""
        from torchlens.records.facts import health_facts

        return health_facts(self)

    @property
    def graph(self) -> Any:
        """The graph's shape: edges, recurrence, orphans, tied parameters (`GraphFacts`)."""
        from torchlens.records.facts import graph_facts

        return graph_facts(self)

    @property
    def autograd(self) -> Any:
        """The backward records (`AutogradFacts`)."""
        from torchlens.records.facts import autograd_facts

        return autograd_facts(self)

    @property
    def num_ops(self) -> int:
        return len(self._ops)

    @property
    def num_uncalled_modules(self) -> int:
        return len(self.uncalled_modules)

    @property
    def num_buffer_layers(self) -> int:
        return sum(1 for l in self._layers.values() if l.kind == "buffer")

    @property
    def backend(self) -> str:
        return self.provenance.backend

    @property
    def output(self) -> Any:
        """The model's return value exactly as the model returned it."""
        if self._output_state is not None:
            reason = self._output_reason or {"output_not_stored": "loaded"}.get(self._output_state, "")
            why = {"fork": "a fork has no live forward return (its values may be edited)",
                   "edited": "a replay edit changed this trace's outputs; the live forward return is the clean value",
                   "loaded": "a loaded or unpickled trace holds no live model output"}.get(reason, "this trace holds no "
                                                                                             "live model output")
            raise PayloadUnavailableError(self._output_state, why, remedy="capture again with tl.trace(model, x), or read "
                                          "the output ops' saved values (trace.output_ops[0].out)", reason=reason)
        return self._output

    @property
    def outcome(self) -> Any:
        """The frozen `CaptureOutcome` of this trace's capture: COMPLETE, STOPPED, FAILED (a
        partial trace), UNATTESTED (the backend recorded none) or UNKNOWN (issue 22)."""
        from torchlens.records.outcome import trace_outcome

        return trace_outcome(self)

    @property
    def graph_edges(self) -> list[tuple[str, str]]:
        return [(p, o.label) for o in self._ops.values() for p in o.parents]

    def __len__(self) -> int:
        return len(self._ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self._ops.values())

    # lookup ----------------------------------------------------------------------------
    def _pass_op(self, layer: Layer, token: str, key: str) -> Op:
        if token == "last":
            return layer.ops[-1]
        if token.isdigit():
            n = int(token)
            if 1 <= n <= len(layer.ops):
                return layer.ops[n - 1]
            raise LookupMissError("pass_out_of_range", f"layer {layer.label!r} has {len(layer.ops)} pass(es); {key!r} is out of range",
                                  remedy=f"passes are 1-based: {layer.label}:1 .. {layer.label}:{len(layer.ops)}", key=key)
        raise LookupMissError("label_unknown", f"{key!r}: pass token {token!r} is not a number, 'last' or 'all'",
                              remedy=f"write {layer.label}:1, {layer.label}:last or {layer.label}:all", key=key)

    def _op_by_any_label(self, key: str) -> Op | None:
        """The one op a label names (bare single-pass, pass-qualified), or None."""
        op = self._ops.get(key)
        if op is not None:
            return op
        base, token = split_pass_token(key)
        layer = self._layers.get(base)
        if layer is None:
            return None
        if token is None:
            return layer.ops[0] if len(layer.ops) == 1 else None
        if token == "all":
            return None
        return self._pass_op(layer, token, key)

    def __getitem__(self, key: Any) -> Any:
        """The plain entry point: returns the kind the key names.

        A layer label gives its Layer and `label:N` its Op; `label:all` a Selection; a module
        address its Module and `address:N` its ModuleCall; a parameter or buffer address its
        Param/Buffer; a selector the Selection it resolves to; an int the op at that index.
        """
        Selector = port("Selector")

        if isinstance(key, Selector):
            return key.resolve(self)
        if isinstance(key, int) and not isinstance(key, bool):
            return self.ops[key]
        if not isinstance(key, str):
            raise InvalidArgumentError("invalid_argument", f"trace[...] takes a label, address, selector or int, not {type(key).__name__}",
                                       remedy="for example trace['linear_1_1'] or trace[tl.func('relu')]", key=repr(key))
        if key in self._layers:
            return self._layers[key]
        if key in self._ops:
            return self._ops[key]
        if key in self._modules:
            return self._modules[key]
        if key in self._module_calls:
            return self._module_calls[key]
        if key in self._params:
            return self._params[key]
        if key in self._buffers:
            return self._buffers[key]
        base, token = split_pass_token(key)
        if base in self._layers and token is not None:
            layer = self._layers[base]
            if token == "all":
                Selection = port("Selection")

                return Selection(self, list(layer.ops))
            return self._pass_op(layer, token, key)
        if base in self._buffers and token is not None and token.isdigit():
            buf = self._buffers[base]
            n = int(token)
            if 1 <= n <= len(buf.op_labels):
                return self._ops[buf.op_labels[n - 1]]
        for m in self._modules.values():
            if key in m.all_addresses:
                return m
        from torchlens.records.collections import canonical_label

        alias = canonical_label(self, key)  # an older underscored label spelling (`batch_norm_1_5`)
        if alias != key:
            return self[alias]
        return self.ops[key]  # raises the typed miss with suggestions

    def modules_with_facet(self, name: str) -> list[Module]:
        """Modules whose recipes declare facet `name`, available now in at least one call."""
        return port("modules_with_facet")(self, name)

    def attention_blocks(self) -> list[Module]:
        """Modules an attention facet recipe matched (`torchlens.facets`)."""
        return port("attention_blocks")(self)

    def find_sites(self, selector: Any) -> Any:
        """Resolve a selector (or label) to its matching ops as a Selection (`.first()`,
        `.labels`, `.to_dataframe()`)."""
        as_selector = port("as_selector")

        return as_selector(selector).resolve(self)

    # views -----------------------------------------------------------------------------
    def summary(self, **kwargs: Any) -> str:
        trace_summary = port("trace_summary")

        return trace_summary(self, **kwargs)

    def draw(self, path: Any = None, **kwargs: Any) -> Any:
        draw_trace = port("draw_trace")

        return draw_trace(self, path, **kwargs)

    @property
    def module_collapse_order(self) -> list[tuple[str, float]]:
        """Every module's collapse priority, highest first."""
        module_collapse_order = port("module_collapse_order")

        return module_collapse_order(self)

    def to_pandas(self) -> Any:
        ops_dataframe = port("ops_dataframe")

        return ops_dataframe(self)

    def using(self, name: str) -> Any:
        bind = port("bind_appliance")

        return bind(name, self)

    # verbs that run framework code -----------------------------------------------------
    def _capable_backend(self, flag: str, verb: str) -> Any:
        """The trace's backend, refusing typed when it is unknown (a loaded trace whose
        backend is not installed) or does not declare `flag` (its capability code)."""
        backend = self._backend
        if backend is None:
            from torchlens.errors import BackendUnsupportedError

            raise BackendUnsupportedError("backend_unknown", f"the {self.provenance.backend} backend is not available to "
                                          f"run {verb}", remedy=f"install the {self.provenance.backend} backend",
                                          verb=verb)
        backend.capabilities().refuse_unless(flag, f"the {backend.name} backend does not support {verb}")
        return backend

    def backward(self, loss: Any, **kwargs: Any) -> Any:
        """Run the backward pass from `loss` and fill `op.grad` for saved ops. Gradient rules
        staged on this trace after its capture (`engine="set_only"`) are armed first on the
        graph the capture kept (a backward-ready capture on a backend that can hook it); one
        that cannot be armed there refuses (`backward_armed_edit_unapplied`) rather than let the
        backward run without it. An armed site's own `grad` holds the edited gradient."""
        unapplied_gradient_rules = port("unapplied_gradient_rules")

        pending = unapplied_gradient_rules(self)
        if pending:
            from torchlens.errors import InterventionError

            raise InterventionError(
                "backward_armed_edit_unapplied", f"{len(pending)} gradient rule(s) staged after this capture "
                f"({', '.join(repr(r.target) for r in pending[:3])}) cannot be applied to its recorded backward graph",
                remedy="apply them on a rerun: trace.do(tl.grad(site), edit, model=model, inputs=x, loss=...), or "
                "capture with intervene=tl.when(tl.grad(site), edit); trace.clear_edits() drops them",
                rules=[repr(r.target) for r in pending])
        import time

        from torchlens.types import Duration

        backend = self._capable_backend("backward_capture", "backward")
        started = time.perf_counter()
        result = backend.backward(self, loss, **kwargs)
        took = time.perf_counter() - started
        if self._intervention is not None:  # the edited gradients the hooks trace.backward armed saw
            for label, slots in self._intervention.take_armed_site_grads().items():
                op = self._ops[label]
                if op.grads is not None:
                    op.grads = tuple(slots.get(i, g) for i, g in enumerate(op.grads))
        self._backward_passes += 1  # trace.autograd.backward_passes
        # a new Cost: a fork shares its root's Cost object, and this backward is this trace's own
        self._cost = _replace(self._cost, backward_durations=tuple(self._cost.backward_durations) + (Duration(took),))
        return result

    def validate_forward_pass(self) -> bool:
        """Replay every op from its saved inputs (under its recorded RNG state) and compare;
        the detailed status lands in `trace.validation_replay_status`."""
        validate = self._capable_backend("validation_replay", "validate_forward_pass").validate
        refuse_opaque = port("refuse_opaque")

        refuse_opaque(self, self._ops.values())  # a loaded op the backend could not re-bind: refuse before any runs
        status = validate(self, None)
        self.validation_replay_status = status
        return bool(status)

    # persistence -----------------------------------------------------------------------
    def save(self, path: Any, level: str = "full", overwrite: bool = False) -> Any:
        """Write this trace as a `.tlspec` directory (saved format 3); `tl.load(path)` reads it."""
        save = port("save_trace")

        return save(self, path, level=level, overwrite=overwrite)

    @property
    def runnable(self) -> Any:
        """The `Runnable` of a trace loaded from a `level="runnable"` save (its `readiness`,
        `reasons` and `run(*inputs)`; `torchlens.io.runnable`); None for every other trace."""
        return self.__dict__.get("_runnable")

    def save_intervention(self, path: Any, level: str = "portable", overwrite: bool = False) -> Any:
        """Write this trace's staged recipe alone as a `.tlspec` directory of kind
        "intervention" (`tl.load` / `tl.io.load_intervention_spec` read it back)."""
        save_intervention = port("save_intervention")

        return save_intervention(self, path, level=level, overwrite=overwrite)

    # interventions -----------------------------------------------------------------------
    def do(self, site: Any, edit: Any = None, /, *, model: Any = None, inputs: Any = None, intervention: Any = None,
           input_kwargs: dict | None = None, loss: Any = None) -> "Trace":
        """Stage an edit at `site` and propagate it: through the recorded graph (replay, no
        model), or by re-executing `model` on `inputs` (rerun). Returns this trace.

        `intervention=` takes `InterventionOptions` or `ReplayOptions`. Replay refuses
        (`replay_param_changed_since_capture`) when an op it recomputes reads a parameter
        that changed since capture, unless `allow_changed_params=True`."""
        do = port("do")

        return do(self, site, edit, model=model, inputs=inputs, intervention=intervention, input_kwargs=input_kwargs,
                  loss=loss)

    def fork(self, name: str | None = None) -> "Trace":
        """A copy with its own intervention spec and values; edits to it leave this trace alone."""
        fork = port("fork")

        return fork(self, name)

    def __enter__(self) -> "Trace":
        """`with trace.fork() as scoped:` stages edits for the block; on exit the edits the
        block staged are detached (the recipe returns to what it was on entry)."""
        _state = port("intervention_state")

        self._scopes.append(_state(self).recipe)
        return self

    def __exit__(self, *exc: Any) -> None:
        _state = port("intervention_state")

        _state(self).recipe = self._scopes.pop()

    def clear_edits(self, site: Any = None, handle: Any = None, *, strict: bool = False) -> "Trace":
        clear_edits = port("clear_edits")

        return clear_edits(self, site, handle, strict=strict)

    def run(self, model: Any, inputs: Any, /, *, input_kwargs: dict | None = None, on_zero_fire: str = "warn") -> "Trace":
        """Re-execute `model` on `inputs` with this trace's recipe live; returns a new Trace."""
        run = port("run_trace")

        return run(self, model, inputs, input_kwargs=input_kwargs, on_zero_fire=on_zero_fire)

    @property
    def recipe(self) -> Any:
        recipe = port("trace_recipe")

        return recipe(self)

    @property
    def is_pristine(self) -> bool:
        is_pristine = port("is_pristine")

        return is_pristine(self)

    @property
    def intervention_audit(self) -> list[dict[str, Any]]:
        _state = port("intervention_state")

        return _state(self).audit

    @property
    def last_run(self) -> dict[str, Any] | None:
        _state = port("intervention_state")

        return _state(self).last_run

    @property
    def direct_write_dirty(self) -> bool:
        """True once a saved value was overwritten directly (`op.out = v`), outside the recipe."""
        _state = port("intervention_state")

        return bool(_state(self).direct_write_dirty)

    @property
    def armed_edits(self) -> tuple:
        return tuple(r for r in self.recipe.rules if r.signal == "backward")

    def __repr__(self) -> str:
        n_layers = len(self._layers)
        return (f"<Trace of {self.provenance.model_class or 'model'} ({self.provenance.backend}): "
                f"{len(self._ops)} ops in {n_layers} layers, {len(self._modules)} modules, "
                f"{len(self._params)} params>")

    def _repr_html_(self) -> str:
        trace_html = port("trace_html")

        return trace_html(self)


__all__ = ["Trace", "Provenance", "Cost", "Op", "Layer", "Module", "ModuleCall", "Param", "Buffer",
           "AmbiguousOpLookupError", "SelectorCompositionError"]
