"""Base classes for a backend written on the SDK (served lazily by `torchlens.backends.sdk`;
imports no ML framework). Written on the SDK facade alone, like a backend package: it imports
`torchlens.backends.sdk`, so the facade imports it only when a name of it is first asked for.

The preview backends that record a forward op by op (mlx, tf, paddle, tinygrad) share most of
their protocol plumbing and half of their recorder; what differs is the framework. Two bases
hold the shared half, each filled in by a few class attributes and small methods:

- `BackendBase`: the `BackendProtocol` members that only name the package's own modules
  (`backward` -> `<package>.grads.backward`, `edit_ops` -> `<package>.edit_ops.<edit_ops_name>`,
  `payload_codec`, `attach_module_edits`), the declarations (`capabilities` from `CAPABILITIES`,
  `refusal_codes` from `own_refusals`, `trace_options`), `can_handle`, `reference_output`,
  `validate` through core's replay engine, and the capture steps every such capture makes in
  the same order (`open_capture`, `refuse_reentrant`, `describe_modules`, `input_leaves`,
  `start_provenance`, `forward_failed`, `finish_capture`).
- `RecorderBase`: the bookkeeping of a recorder: value -> producing event (`register`,
  `lookup`), source events (`source`), argument templates (`template`), module scopes
  (`enter`, `exit`) and the output events (`record_outputs`).

A subclass sets what names its framework (`is_tensor` / `is_leaf`, `dtype_of`, `module_types`,
...) and keeps its own capture loop; the MLX backend (`torchlens_mlx.backend`) is the shortest
complete use. docs/guides/plugins.md describes every hook.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Iterable

from torchlens.backends.sdk import (
    ArgRef,
    BackendCapabilities,
    EventLog,
    InvalidArgumentError,
    ModelInfo,
    ModuleEnter,
    ModuleExit,
    ModuleInfo,
    OpEvent,
    Provenance,
    ReentrantTraceError,
    TraceCaptureError,
    apply_save,
    build_trace,
    check_requested_capabilities,
    keyword_path,
    leaf_paths as _leaf_paths,
    module_parents,
    positional_path,
    refusal_codes_for,
    save_plan,
)


class BackendBase:
    """The shared part of a preview backend's `BackendProtocol` implementation.

    Set in a subclass: `name`, `framework`, `package` (the import name whose `grads`,
    `edit_ops` and `codec` modules hold the lazily imported parts), `edit_ops_name`,
    `codec_name`, `CAPABILITIES`, `own_refusals` (its codes beyond the derived ones),
    `module_types` (what `can_handle` accepts whatever the inputs), `capture_noun` and
    `replay_rng_note` (message texts); define `is_tensor`, `host_copy`, `from_host`,
    `resolve_callable`, `module_pairs(model)` and `capture`.
    """

    name: str  # set by the subclass, as `framework`
    maturity = "preview"
    materialization = "eager"
    _OPTIONS = frozenset({"save", "capture", "replay_rng"})
    CAPABILITIES = BackendCapabilities()
    package = ""
    edit_ops_name = ""
    codec_name = ""
    own_refusals: frozenset[str] = frozenset()
    module_types: tuple[type, ...] = ()
    capture_noun = "a capture"
    replay_rng_note = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A capability member the base would lend is withdrawn (set to None) from a subclass
        that does not declare the capability, so core's registration check (which refuses a
        backend implementing an undeclared capability) and `supports` see what is declared:
        `edit_ops` / `attach_module_edits` without `interventions`, `backward` without
        `backward_capture`, `payload_codec` without a `codec_name`. A member the subclass
        defines itself is left alone."""
        super().__init_subclass__(**kwargs)
        caps = cls.CAPABILITIES
        withdraw = {"edit_ops": not caps.interventions, "attach_module_edits": not caps.interventions,
                    "backward": not caps.backward_capture, "payload_codec": not cls.codec_name}
        for member, off in withdraw.items():
            if off and getattr(cls, member) is getattr(BackendBase, member):
                setattr(cls, member, None)

    # declarations ------------------------------------------------------------------------
    def capabilities(self) -> BackendCapabilities:
        return self.CAPABILITIES

    def runtime_available(self) -> str | None:
        return None

    def trace_options(self) -> frozenset[str]:
        return self._OPTIONS

    def refusal_codes(self) -> frozenset[str]:
        return refusal_codes_for(self, self.own_refusals)

    def realize_once(self, values: Any) -> Any:
        return values

    # the package's own parts, imported when first used -------------------------------------
    def _part(self, module: str) -> Any:
        return importlib.import_module(f"{self.package}.{module}")

    def backward(self, trace: Any, loss: Any = None, **kwargs: Any) -> Any:
        """Fill `op.grads` of every saved op: the gradient of `loss(output)` (a callable of the
        output; None sums its float leaves), by the framework's autodiff over the recorded ops
        (`<package>.grads.backward`)."""
        return self._part("grads").backward(trace, loss, **kwargs)

    def replay_ops(self) -> Any:
        """What `validate` replays with (a `ReplayOps`): the package's edit-ops class, which
        subclasses `ReplayOpsBase` in the four backends on this base."""
        return getattr(self._part("edit_ops"), self.edit_ops_name)()

    def edit_ops(self) -> Any:
        return self.replay_ops()

    def attach_module_edits(self, model: Any, rules: list, ops: Any, fired: dict) -> Any:
        return self._part("edit_ops").attach_module_edits(model, self.module_pairs(model), rules, ops, fired)

    def payload_codec(self) -> Any:
        return getattr(self._part("codec"), self.codec_name)()

    # values --------------------------------------------------------------------------------
    def leaves(self, obj: Any, path: str = "") -> list[tuple[str, Any]]:
        """`(path, tensor)` of every tensor (`is_tensor`) in nested tuples, lists and dicts."""
        return _leaf_paths(obj, path, self.is_tensor)

    def settle(self, *values: Any) -> None:
        """Make `values` concrete (a lazy framework evaluates them); eager frameworks: nothing."""

    def can_handle(self, model: Any, args: tuple, kwargs: dict) -> bool:
        if isinstance(model, self.module_types):
            return True
        return callable(model) and bool(self.leaves((args, kwargs)))

    def reference_output(self, model: Any, args: tuple, kwargs: dict) -> Any:
        out = model(*args, **kwargs)
        self.settle(*[v for _p, v in self.leaves(out)])
        return out

    def ground_truth_values(self, ground_truth: Any) -> Any:
        """The host values `validate` compares the output ops with (numpy arrays)."""
        import numpy as np

        return [np.asarray(v) for _p, v in self.leaves(ground_truth)]

    def validate(self, trace: Any, ground_truth: Any = None) -> Any:
        """Replay every op on its parents' saved values through core's replay engine and
        compare bit for bit with its saved output."""
        from torchlens.backends.sdk import replay_validate

        gt = None if ground_truth is None else self.ground_truth_values(ground_truth)
        return replay_validate(trace, self.replay_ops(), ground_truth=gt)

    # capture steps -------------------------------------------------------------------------
    def open_capture(self, capture: Any, options: dict, replay_rng: Any, save: Any) -> Any:
        """The refusals before anything runs, in order: options the backend cannot honour
        (`check_requested_capabilities`), a `replay_rng=` that is not a bool, a bad `save=`;
        returns the save plan."""
        check_requested_capabilities(self, capture, options)
        if not isinstance(replay_rng, bool):
            raise InvalidArgumentError("invalid_argument", f"replay_rng= takes a bool, not {type(replay_rng).__name__}",
                                       remedy=f"replay_rng=True ({self.replay_rng_note})", option="replay_rng")
        return save_plan(save)

    def refuse_reentrant(self, running: Any) -> None:
        """`reentrant_trace` when `running` (the thread's active recorder) is not None."""
        if running is not None:
            raise ReentrantTraceError("reentrant_trace", f"{self.capture_noun} is already running in this thread",
                                      remedy="trace outside the forward of another trace")

    def module_training(self, module: Any) -> bool:
        return bool(getattr(module, "training", False))

    def describe_modules(self, info: ModelInfo, modules: Iterable[tuple[str, Any]],
                         parents: dict[str, str | None] | None = None) -> None:
        """Append a `ModuleInfo` per `(address, module)` to `info`; `parents` (address -> parent
        address) defaults to `module_parents` of the addresses."""
        modules = list(modules)
        parent_of = module_parents(a for a, _m in modules) if parents is None else parents
        for addr, m in modules:
            info.modules.append(ModuleInfo(addr, type(m).__name__, type(m).__qualname__, parent=parent_of.get(addr),
                                           training=self.module_training(m)))

    def input_leaves(self, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
        """`(path, tensor)` of every input tensor: positional ones first (`args[i]...`), then
        keywords (`kwargs['k']...`)."""
        out = [x for i, a in enumerate(args) for x in self.leaves(a, positional_path(i))]
        return out + [x for k, a in kwargs.items() for x in self.leaves(a, keyword_path(k))]

    def backend_version(self) -> str:
        """The backend package's `__version__` (what `Provenance.backend_version` records)."""
        return importlib.import_module(self.package).__version__

    def start_provenance(self, model: Any, framework_version: str) -> tuple[Provenance, float]:
        """The capture's `Provenance` (started now) and the `perf_counter` start time."""
        prov = Provenance(self.name, backend_version=self.backend_version(), framework_version=framework_version,
                          model_class=type(model).__name__, start_time=time.time())
        return prov, time.perf_counter()

    def forward_failed(self, info: ModelInfo, log: EventLog, prov: Provenance, exc: BaseException) -> TraceCaptureError:
        """The `forward_failed` error for a forward that raised `exc` (raise it `from exc`),
        with the ops recorded before the failure as `partial_trace`."""
        partial = build_trace(info, log, output_state="output_forward_failed", provenance=prov, backend=self)
        return TraceCaptureError("forward_failed", f"the forward raised {type(exc).__name__}: {exc}",
                                 remedy="fix the forward; exc.partial_trace holds the ops recorded before the failure",
                                 partial_trace=partial)

    def finish_capture(self, info: ModelInfo, log: EventLog, out: Any, prov: Provenance, start: float, capture: Any,
                       plan: Any, **keep: Any) -> Any:
        """Close the provenance, build the trace, keep the backward state when the capture asks
        for gradients (`<package>.grads.keep_for_backward(trace, out, save_grads=..., **keep)`)
        and apply the save plan; returns the trace."""
        prov.duration = time.perf_counter() - start
        prov.end_time = time.time()
        trace = build_trace(info, log, output=out, provenance=prov, options=capture, backend=self)
        if capture is not None and (capture.backward_ready or capture.save_grads):
            self._part("grads").keep_for_backward(trace, out, save_grads=bool(capture.save_grads), **keep)
        apply_save(trace, plan)
        return trace


class RecorderBase:
    """The framework-free bookkeeping of a backend's recorder.

    Set or define in a subclass: `is_leaf(value)` (a tensor of the framework), `dtype_of`,
    optionally `shape_of` (default `tuple(value.shape)`), `settle` (make a value concrete; default
    nothing), `param_of` / `lookup` (extra ways to recognise a value) and `unseen` (the event for
    a tensor argument no event produced; default a constant).
    """

    def __init__(self, log: EventLog, modules: Iterable[tuple[str, Any]]) -> None:
        self.log = log
        self.addr_of = {id(m): a for a, m in modules}
        self.param_addr: dict[int, str] = {}
        self.producer: dict[int, tuple[int, int]] = {}
        self.events_by_id: dict[int, Any] = {}
        self.alive: list[Any] = []  # keeps ids stable during the capture
        self.stack: list[tuple[str, int]] = []
        self.objs: list[Any] = []
        self.calls: dict[str, int] = {}
        self.edit_plan: Any = None

    # framework hooks -----------------------------------------------------------------------
    def is_leaf(self, value: Any) -> bool:
        raise NotImplementedError

    def dtype_of(self, value: Any) -> str:
        raise NotImplementedError

    def shape_of(self, value: Any) -> tuple:
        return tuple(value.shape)

    def settle(self, value: Any) -> None:
        """Make a source value concrete before it is recorded (default: nothing)."""

    # values --------------------------------------------------------------------------------
    def leaves(self, obj: Any) -> list[tuple[str, Any]]:
        return _leaf_paths(obj, "", self.is_leaf)

    def append(self, ev: Any) -> None:
        self.events_by_id[ev.id] = ev
        self.log.append(ev)

    def source(self, kind: str, value: Any, path: str) -> tuple[int, int]:
        """A source event (`input`, `buffer`, `constant`) for `value`; every kind but `input`
        records the module stack it was met in."""
        i = self.log.new_id()
        self.settle(value)
        self.append(OpEvent(i, kind, kind, outputs=(value,), shapes=(self.shape_of(value),), dtypes=(self.dtype_of(value),),
                            path=path, module_stack=tuple(self.stack) if kind != "input" else ()))
        self.register(value, (i, 0))
        return (i, 0)

    def register(self, value: Any, src: tuple[int, int]) -> None:
        self.producer[id(value)] = src
        self.alive.append(value)

    def lookup(self, value: Any) -> tuple[int, int] | None:
        return self.producer.get(id(value))

    def param_of(self, value: Any) -> str | None:
        return self.param_addr.get(id(value))

    def unseen(self, value: Any) -> tuple[int, int]:
        return self.source("constant", value, "constant")

    def template(self, obj: Any, parents: list, params: list) -> Any:
        """`obj` with every tensor replaced by an `ArgRef`: a parameter by its address (added to
        `params`), any other tensor by its index in `parents` (its producer appended)."""
        if self.is_leaf(obj):
            addr = self.param_of(obj)
            if addr is not None:
                if addr not in params:
                    params.append(addr)
                return ArgRef(address=addr)
            src = self.lookup(obj)
            if src is None:
                src = self.unseen(obj)
            parents.append(src)
            return ArgRef(index=len(parents) - 1)
        if type(obj) is tuple:
            return tuple(self.template(o, parents, params) for o in obj)
        if type(obj) is list:
            return [self.template(o, parents, params) for o in obj]
        if type(obj) is dict:
            return {k: self.template(v, parents, params) for k, v in obj.items()}
        return obj

    # ops -----------------------------------------------------------------------------------
    def split_outputs(self, value: Any) -> tuple[tuple, bool] | None:
        """`(outputs, multi_output)` of a call's result: one tensor, or a non-empty tuple/list
        of tensors; None for anything else (the call produced no tensor: not an op)."""
        if self.is_leaf(value):
            return (value,), False
        if isinstance(value, (tuple, list)) and value and all(self.is_leaf(v) for v in value):
            return tuple(value), True
        return None

    def arguments(self, args: tuple, kwargs: dict) -> tuple[list, list, Any, Any]:
        """`(parents, params, args template, kwargs template)` of an op call (`template`)."""
        parents: list[tuple[int, int]] = []
        params: list[str] = []
        args_t = self.template(args, parents, params)
        return parents, params, args_t, self.template(kwargs, parents, params)

    def apply_edits(self, i: int, outs: tuple, out: Any, multi: bool, inplace: bool = False) -> tuple[tuple, Any]:
        """`(outs, out)` of event `i` after the edit plan's forward edits at it (the plan is
        applied whenever it holds `i`; an in-place op keeps its receiver as output)."""
        if self.edit_plan is None or i not in self.edit_plan:
            return outs, out
        edited = tuple(self.edit_plan.apply(i, outs))
        if inplace:
            return outs, out
        return edited, (edited[0] if not multi else type(out)(edited))

    # module scopes -------------------------------------------------------------------------
    def enter(self, module: Any, *inputs: Any) -> None:
        """A module call begins (its input tensors: the leaves of `inputs`)."""
        addr = self.addr_of.get(id(module), f"<unregistered {type(module).__name__}>")
        n = self.calls.get(addr, 0) + 1
        self.calls[addr] = n
        self.stack.append((addr, n))
        self.objs.append(module)
        ins = tuple(s for s in (self.lookup(a) for _p, a in self.leaves(inputs)) if s is not None)
        self.log.append(ModuleEnter(addr, n, ins))

    def exit(self, out: Any) -> None:
        addr, n = self.stack.pop()
        self.objs.pop()
        outs = tuple(s for s in (self.lookup(o) for _p, o in self.leaves(out)) if s is not None)
        self.log.append(ModuleExit(addr, n, outs))

    # outputs -------------------------------------------------------------------------------
    def record_outputs(self, leaves: Iterable[tuple[str, Any]]) -> None:
        """One `output` event per `(path, tensor)` of the forward's result; a tensor no event
        produced (a parameter returned as is) gets a constant first."""
        for path, leaf in leaves:
            src = self.lookup(leaf)
            if src is None:
                src = self.source("constant", leaf, "constant")
            i = self.log.new_id()
            self.log.append(OpEvent(i, "output", "output", parents=(src,), outputs=(leaf,),
                                    shapes=(self.shape_of(leaf),), dtypes=(self.dtype_of(leaf),), path=path))


__all__ = ["BackendBase", "RecorderBase"]
