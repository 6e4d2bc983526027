"""The Trace: the finalized record of one executed path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

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

    def summary(self) -> str:
        return (f"backend {self.backend} {self.backend_version or ''} (framework {self.framework_version or '?'}), "
                f"model {self.model_class}, captured in {self.duration:.3f}s")


@dataclass
class Cost:
    """Compute, memory and timing totals of the capture."""

    total_flops: int = 0
    total_macs: int = 0
    macs_by_kind: dict[str, int] = field(default_factory=dict)
    forward_duration: float = 0.0
    total_activation_memory: int = 0
    total_param_memory: int = 0
    num_ops_with_flops: int = 0


class Trace:
    """Operations, dataflow edges, module context, selected payloads and capture metadata
    of one forward pass. `tl.trace(...)` returns one."""

    def __init__(self) -> None:
        self._ops: dict[str, Op] = {}
        self._layers: dict[str, Layer] = {}
        self._modules: dict[str, Module] = {}
        self._module_calls: dict[str, ModuleCall] = {}
        self._params: dict[str, Param] = {}
        self._buffers: dict[str, Buffer] = {}
        self._output: Any = None
        self._output_state: str | None = None  # None: held; else a PayloadUnavailable code
        self.uncalled_modules: list[str] = []
        self.provenance: Provenance = Provenance(backend="?")
        self.options: Any = None
        self.cost: Cost = Cost()
        self.annotations: dict[str, Any] = {}
        self.name: str = "root"
        self._backend: Any = None  # the BackendProtocol object, for verbs that execute code
        self.validation_replay_status: Any = None  # set by tl.validate / validate_forward_pass

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
            reason = self.__dict__.get("_output_reason") or {"output_not_stored": "loaded"}.get(self._output_state, "")
            why = {"fork": "a fork has no live forward return (its values may be edited)",
                   "edited": "a replay edit changed this trace's outputs; the live forward return is the clean value",
                   "loaded": "a loaded or unpickled trace holds no live model output"}.get(reason, "this trace holds no "
                                                                                             "live model output")
            raise PayloadUnavailableError(self._output_state, why, remedy="capture again with tl.trace(model, x), or read "
                                          "the output ops' saved values (trace.output_ops[0].out)", reason=reason)
        return self._output

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
        from torchlens.select.selectors import Selector

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
                from torchlens.select.selection import Selection

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
        return self.ops[key]  # raises the typed miss with suggestions

    def find_sites(self, selector: Any) -> Any:
        """Resolve a selector (or label) to its matching ops as a Selection (`.first()`,
        `.labels`, `.to_dataframe()`)."""
        from torchlens.select.selectors import as_selector

        return as_selector(selector).resolve(self)

    # views -----------------------------------------------------------------------------
    def summary(self, **kwargs: Any) -> str:
        from torchlens.viz.summary import trace_summary

        return trace_summary(self, **kwargs)

    def draw(self, path: Any = None, **kwargs: Any) -> Any:
        from torchlens.viz.draw import draw_trace

        return draw_trace(self, path, **kwargs)

    @property
    def module_collapse_order(self) -> list[tuple[str, float]]:
        """Every module's collapse priority, highest first."""
        from torchlens.viz.collapse import module_collapse_order

        return module_collapse_order(self)

    def to_pandas(self) -> Any:
        from torchlens.viz.tables import ops_dataframe

        return ops_dataframe(self)

    def using(self, name: str) -> Any:
        from torchlens.appliances import bind

        return bind(name, self)

    # verbs that run framework code -----------------------------------------------------
    def _verb(self, name: str) -> Any:
        backend = self._backend
        fn = getattr(backend, name, None) if backend is not None else None
        if fn is None:
            from torchlens.errors import BackendUnsupportedError

            raise BackendUnsupportedError("backend_unknown" if backend is None else "trace_option_unsupported",
                                          f"the {self.provenance.backend} backend does not implement {name}",
                                          remedy="use a backend that declares this capability", verb=name)
        return fn

    def backward(self, loss: Any, **kwargs: Any) -> Any:
        """Run the backward pass from `loss` and fill `op.grad` for saved ops. Gradient rules
        staged on this trace after its capture (`engine="set_only"`) cannot reach a graph that
        is already built: they refuse (`backward_armed_edit_unapplied`) rather than let the
        backward run without them."""
        from torchlens.intervention.verbs import unapplied_gradient_rules

        pending = unapplied_gradient_rules(self)
        if pending:
            from torchlens.errors import InterventionError

            raise InterventionError(
                "backward_armed_edit_unapplied", f"{len(pending)} gradient rule(s) staged after this capture "
                f"({', '.join(repr(r.target) for r in pending[:3])}) cannot be applied to its recorded backward graph",
                remedy="apply them on a rerun: trace.do(tl.grad(site), edit, model=model, inputs=x, loss=...), or "
                "capture with intervene=tl.when(tl.grad(site), edit); trace.clear_edits() drops them",
                rules=[repr(r.target) for r in pending])
        result = self._verb("backward")(self, loss, **kwargs)
        self.__dict__["_backward_passes"] = int(self.__dict__.get("_backward_passes", 0)) + 1  # trace.autograd
        return result

    def validate_forward_pass(self) -> bool:
        """Replay every op from its saved inputs (under its recorded RNG state) and compare;
        the detailed status lands in `trace.validation_replay_status`."""
        self._backend.capabilities().refuse_unless("validation_replay") if self._backend is not None else None
        validate = self._verb("validate")
        from torchlens.io.opaque import refuse_opaque

        refuse_opaque(self, self._ops.values())  # a loaded op the backend could not re-bind: refuse before any runs
        status = validate(self, None)
        self.validation_replay_status = status
        return bool(status)

    # persistence -----------------------------------------------------------------------
    def save(self, path: Any, level: str = "full", overwrite: bool = False) -> Any:
        """Write this trace as a `.tlspec` directory (saved format 3); `tl.load(path)` reads it."""
        from torchlens.io.bundle import save

        return save(self, path, level=level, overwrite=overwrite)

    def save_intervention(self, path: Any, level: str = "portable", overwrite: bool = False) -> Any:
        """Write this trace's staged recipe alone as a `.tlspec` directory of kind
        "intervention" (`tl.load` / `tl.io.load_intervention_spec` read it back)."""
        from torchlens.io.intervention import save_intervention

        return save_intervention(self, path, level=level, overwrite=overwrite)

    # interventions -----------------------------------------------------------------------
    def do(self, site: Any, edit: Any = None, /, *, model: Any = None, inputs: Any = None, intervention: Any = None,
           input_kwargs: dict | None = None, loss: Any = None) -> "Trace":
        """Stage an edit at `site` and propagate it: through the recorded graph (replay, no
        model), or by re-executing `model` on `inputs` (rerun). Returns this trace.

        `intervention=` takes `InterventionOptions` or `ReplayOptions`. Replay refuses
        (`replay_param_changed_since_capture`) when an op it recomputes reads a parameter
        that changed since capture, unless `allow_changed_params=True`."""
        from torchlens.intervention.verbs import do

        return do(self, site, edit, model=model, inputs=inputs, intervention=intervention, input_kwargs=input_kwargs,
                  loss=loss)

    def fork(self, name: str | None = None) -> "Trace":
        """A copy with its own intervention spec and values; edits to it leave this trace alone."""
        from torchlens.intervention.verbs import fork

        return fork(self, name)

    def __enter__(self) -> "Trace":
        """`with trace.fork() as scoped:` stages edits for the block; on exit the edits the
        block staged are detached (the recipe returns to what it was on entry)."""
        from torchlens.intervention.verbs import _state

        self.__dict__.setdefault("_scopes", []).append(_state(self)["recipe"])
        return self

    def __exit__(self, *exc: Any) -> None:
        from torchlens.intervention.verbs import _state

        _state(self)["recipe"] = self.__dict__["_scopes"].pop()

    def clear_edits(self, site: Any = None, handle: Any = None, *, strict: bool = False) -> "Trace":
        from torchlens.intervention.verbs import clear_edits

        return clear_edits(self, site, handle, strict=strict)

    def run(self, model: Any, inputs: Any, /, *, input_kwargs: dict | None = None, on_zero_fire: str = "warn") -> "Trace":
        """Re-execute `model` on `inputs` with this trace's recipe live; returns a new Trace."""
        from torchlens.intervention.verbs import run

        return run(self, model, inputs, input_kwargs=input_kwargs, on_zero_fire=on_zero_fire)

    @property
    def recipe(self) -> Any:
        from torchlens.intervention.verbs import recipe

        return recipe(self)

    @property
    def is_pristine(self) -> bool:
        from torchlens.intervention.verbs import is_pristine

        return is_pristine(self)

    @property
    def intervention_audit(self) -> list[dict[str, Any]]:
        from torchlens.intervention.verbs import _state

        return _state(self)["audit"]

    @property
    def last_run(self) -> dict[str, Any] | None:
        from torchlens.intervention.verbs import _state

        return _state(self)["last_run"]

    @property
    def direct_write_dirty(self) -> bool:
        """True once a saved value was overwritten directly (`op.out = v`), outside the recipe."""
        from torchlens.intervention.verbs import _state

        return bool(_state(self).get("direct_write_dirty"))

    @property
    def armed_edits(self) -> tuple:
        return tuple(r for r in self.recipe.rules if r.signal == "backward")

    def __repr__(self) -> str:
        n_layers = len(self._layers)
        return (f"<Trace of {self.provenance.model_class or 'model'} ({self.provenance.backend}): "
                f"{len(self._ops)} ops in {n_layers} layers, {len(self._modules)} modules, "
                f"{len(self._params)} params>")

    def _repr_html_(self) -> str:
        from torchlens.viz.tables import trace_html

        return trace_html(self)


__all__ = ["Trace", "Provenance", "Cost", "Op", "Layer", "Module", "ModuleCall", "Param", "Buffer",
           "AmbiguousOpLookupError", "SelectorCompositionError"]
