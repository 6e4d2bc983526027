"""`torchlens.backends.sdk`: everything a backend package needs from core, in one module.

A backend imports `torchlens` (for `hookimpl`) and this module, nothing else from core:
what is here is the supported contract, everything else is core's internals and may
change. The dependency test enforces it for the backends in this repository.

- Registration: `BackendSpec`, `FrameworkRequirement`, `hookimpl`, `lazy_loader`.
- Declarations: `BackendCapabilities`, the capability protocols (`SupportsInterventions`,
  `SupportsBackward`, `SupportsValidation`, `SupportsPersistence`, ...), `refusal_codes_for`.
- Capture: the event types (`EventLog`, `OpEvent`, `ModuleEnter`, `ModuleExit`, `ArgRef`,
  `ModelInfo`, `ModuleInfo`, `ParamInfo`, `BufferInfo`, `fill_template`), the builder entry
  `build_trace`, the model-input path convention (`input_paths`, `item_path`,
  `field_path`: `args[i]`, `kwargs['k']`, `[i]`, `['k']`, `.f`), save plans (`save_plan`, `apply_save`), `Provenance`, and the pre-capture
  refusals `check_requested_capabilities`.
- Verbs: `ValidationStatus`, `refuse_opaque` (loaded ops that must not replay),
  `param_values`, the payload codec types (`PayloadCodec`, `EncodedPayload`, `NumpyCodec`),
  `CallablePlaceholder` / `UnencodableValue` (what a loaded file holds instead of code),
  `NumpyEditOps`, `HookContext` and `fire` for interventions (the `EditOps` /
  `DifferentiableEditOps` protocols `edit_ops()` returns), `changed_params` /
  `param_addresses` (replay's parameter check), `refuse_unreplayable`, `progress`,
  `CaptureOptions` / `TraceOptions` (what `capture` receives), `AttributeWrite`,
  `install_hint`.
- Replay (issue 14 §2): core's one per-op replay engine. A backend's `validate` calls
  `replay_validate(trace, ops)` with its `ReplayOps` (subclass `ReplayOpsBase`: call, compare,
  RNG state, argument protection); `Replayer` re-executes single ops; `replay_ops_from`
  adapts an `EditOps`; `ReplayFailure` is a missing piece.
- Walking values (framework-free, the framework test passed in): `leaf_paths(obj, path, is_leaf)`
  (the path of every tensor leaf of nested tuples/lists/dicts), `foreign_leaf(obj, roots)` (the
  first array of another framework, or numpy, in an input), `call_site(frame, stop)` (the
  (code, instruction) key of an op's call site), `module_parents(addresses)` (each module's
  parent address).
- Base classes (`torchlens.backends.sdk_backend`): `BackendBase` (the protocol plumbing and the
  capture steps a preview backend shares) and `RecorderBase` (a recorder's bookkeeping: sources,
  argument templates, module scopes, output events).
- Gradients by perturbed replay (`torchlens.backends.sdk_grads`): `GradOptions` (the dataclass every
  `tl.backends.<name>.GradOptions` is), `GradState`, `keep_for_backward`, `backward_state`,
  `grad_keys`, `perturbed_replay`, `loss_value`, `store_grads`, `out_template` / `rebuild`,
  `forward_edits`, `by_event`.
- Reduce and discard (`torchlens.backends.sdk_stats`): `take_stats_fold()` says a `save="stats"`
  capture may fold each op's out into a `STATS_FOLD_SLOTS` float64 vector (saved as a `FoldedStats`)
  as the op runs.
- Errors: the typed error classes a backend raises.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Collection, Iterable, Mapping

from torchlens.backends.codes import CAPABILITY_REFUSALS, REFUSAL_CODES, VALIDATION_REASONS
from torchlens.backends.protocol import (
    CAPABILITY_PROTOCOLS,
    BackendCapabilities,
    BackendProtocol,
    BackendSpec,
    FrameworkRequirement,
    SupportsBackward,
    SupportsGenerationRecording,
    SupportsCallableTable,
    SupportsHostValues,
    SupportsInterventions,
    SupportsOpRebinding,
    SupportsPersistence,
    DifferentiableEditOps,
    EditOps,
    ReplayOps,
    SupportsValidation,
    SupportsValidationScopes,
    SupportsValidationSession,
    ValidationStatus,
    refusal_codes_for,
    supports,
)
from torchlens.backends.registry import install_hint
from torchlens.backends.sdk_grads import (
    SOURCE_KINDS,
    GradOptions,
    GradState,
    OutLeaf,
    backward_state,
    by_event,
    forward_edits,
    grad_keys,
    keep_for_backward,
    loss_value,
    out_template,
    perturbed_replay,
    rebuild,
    store_grads,
)
from torchlens.build.builder import build_trace
from torchlens.build.events import (
    ArgRef,
    BufferInfo,
    EventLog,
    ModelInfo,
    ModuleEnter,
    ModuleExit,
    ModuleInfo,
    OpEvent,
    ParamInfo,
    fill_template,
)
from torchlens.build.inputs import field_path, input_paths, item_path, keyword_path, positional_path
from torchlens.build.save import apply_save, save_plan
from torchlens.capture import check_requested_capabilities
from torchlens.errors import (
    ArtifactError,
    BackendUnsupportedError,
    InvalidArgumentError,
    LookupMissError,
    RecordingError,
    ReentrantTraceError,
    SaveBudgetExceededError,
    TorchLensError,
    TraceCaptureError,
    ValidationError,
)
from torchlens.options import CaptureOptions, TraceOptions
from torchlens.plugins.hookspecs import hookimpl
from torchlens.records.trace import Provenance
from torchlens.types import AttributeWrite, CallablePlaceholder, UnencodableValue
from torchlens.backends.sdk_stats import STATS_FOLD_SLOTS, FoldedStats, take_stats_fold  # save="stats" during the forward (issue 23)

#: Names served lazily (their modules are heavier or import more of core): name -> "module:attr".
_LAZY = {
    "PayloadCodec": "torchlens.io.codec:PayloadCodec",
    "EncodedPayload": "torchlens.io.codec:EncodedPayload",
    "NumpyCodec": "torchlens.io.codec:NumpyCodec",
    "refuse_opaque": "torchlens.io.opaque:refuse_opaque",
    "NumpyEditOps": "torchlens.intervention.numpy_ops:NumpyEditOps",
    "HookContext": "torchlens.intervention.edits:HookContext",
    "fire": "torchlens.intervention.edits:fire",
    "attach_class_edits": "torchlens.intervention.class_edits:attach_class_edits",
    "changed_params": "torchlens.replay.params:changed_params",
    "param_addresses": "torchlens.replay.params:param_addresses",
    "refuse_unreplayable": "torchlens.replay.preconditions:refuse_unreplayable",
    "progress": "torchlens.viz.progress:progress",
    "ReplayOpsBase": "torchlens.replay.engine:ReplayOpsBase",
    "replay_validate": "torchlens.replay.engine:validate",
    "replay_ops_from": "torchlens.replay.engine:replay_ops_from",
    "Replayer": "torchlens.replay.engine:Replayer",
    "ReplayFailure": "torchlens.replay.engine:ReplayFailure",
    # base classes written on this module (they import it): protocol plumbing and recorder bookkeeping
    "BackendBase": "torchlens.backends.sdk_backend:BackendBase",
    "RecorderBase": "torchlens.backends.sdk_backend:RecorderBase",
    # issue 22: the generation driver contract (see SupportsGenerationRecording)
    "ForwardData": "torchlens.recording.generation:ForwardData",
    "GenerationRequest": "torchlens.recording.generation:GenerationRequest",
    "GenerationRun": "torchlens.recording.generation:GenerationRun",
}


def lazy_loader(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__, __dir__` for a module whose public names import lazily, so importing it
    (for example a backend's package, reached by its plugin entry point) imports no framework.

    `names` maps a public name to `"module"` (the module itself) or `"module:attribute"`.
    A resolved name is cached in the module's globals; an unknown one is an AttributeError.

        __getattr__, __dir__ = lazy_loader(__name__, {"JAXBackend": "torchlens_jax.backend:JAXBackend"})
    """
    table = dict(names)

    def __getattr__(name: str) -> Any:
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        mod_name, _, attr = target.partition(":")
        value = importlib.import_module(mod_name)
        if attr:
            value = getattr(value, attr)
        sys.modules[package].__dict__[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(sys.modules[package].__dict__) | set(table))

    return __getattr__, __dir__


__getattr__, __dir__ = lazy_loader(__name__, _LAZY)


def param_values(trace: Any) -> dict[str, Any]:
    """address -> value of every parameter record of a trace (what a replay reads)."""
    return {p.address: p.value for p in trace.params}


def leaf_paths(obj: Any, path: str, is_leaf: Callable[[Any], bool]) -> list[tuple[str, Any]]:
    """`(path, leaf)` for every leaf (`is_leaf`) of nested tuples, lists and dicts, depth first;
    paths extend `path` by the model-input convention (`item_path`: `[i]`, `['k']`). Anything
    else (None, numbers, strings, other objects) contributes nothing.

        leaf_paths((x, {"m": y}), "args[0]", is_leaf)  # [("args[0][0]", x), ("args[0][1]['m']", y)]
    """
    if is_leaf(obj):
        return [(path, obj)]
    if isinstance(obj, (tuple, list)):
        return [x for i, o in enumerate(obj) for x in leaf_paths(o, item_path(path, i), is_leaf)]
    if isinstance(obj, dict):
        return [x for k, o in obj.items() for x in leaf_paths(o, item_path(path, k), is_leaf)]
    return []


def foreign_leaf(obj: Any, roots: Collection[str], *, numpy: bool = True, need_shape: bool = False) -> str | None:
    """`module.Type` of the first value inside nested tuples/lists/dict values whose type's top
    module is one of `roots` (another framework's array: `("torch", "jax", "jaxlib", ...)`; with
    `need_shape`, only such values that have a `shape`), or a numpy array when `numpy`; None when
    there is none. A backend refuses such an input with `foreign_tensor_input`."""
    if isinstance(obj, (tuple, list)):
        for o in obj:
            f = foreign_leaf(o, roots, numpy=numpy, need_shape=need_shape)
            if f:
                return f
        return None
    if isinstance(obj, dict):
        return foreign_leaf(list(obj.values()), roots, numpy=numpy, need_shape=need_shape)
    cls = type(obj)
    if (cls.__module__.split(".")[0] in roots and (not need_shape or hasattr(obj, "shape"))) or \
            (numpy and _is_ndarray(obj)):
        return f"{cls.__module__}.{cls.__name__}"
    return None


def _is_ndarray(obj: Any) -> bool:
    np = sys.modules.get("numpy")  # an ndarray exists only once numpy is imported
    return np is not None and isinstance(obj, np.ndarray)


def module_parents(addresses: Iterable[str]) -> dict[str, str]:
    """address -> parent address for every module address but the root `"self"`: the nearest
    dotted prefix that is itself a module address (`layers.0` of a list attribute `layers` has the
    parent above `layers`), `"self"` when there is none."""
    known = set(addresses)
    parents = {}
    for addr in known:
        if addr == "self":
            continue
        up = addr.rpartition(".")[0]
        while up and up not in known:
            up = up.rpartition(".")[0]
        parents[addr] = up or "self"
    return parents


def call_site(frame: Any, stop: Any, limit: int = 16) -> tuple:
    """`(code, last instruction)` pairs from `frame` outwards, up to (not including) the first
    frame whose code is `stop` (a code object, or a set/frozenset of them) and at most `limit`
    pairs: the key that tells two calls of one op from the same Python line apart (loops,
    helpers) and the same call in two runs together."""
    key = []
    f = frame
    if isinstance(stop, (set, frozenset)):
        while f is not None and f.f_code not in stop and len(key) < limit:
            key.append((f.f_code, f.f_lasti))
            f = f.f_back
    else:
        while f is not None and f.f_code is not stop and len(key) < limit:
            key.append((f.f_code, f.f_lasti))
            f = f.f_back
    return tuple(key)


__all__ = [
    "leaf_paths", "foreign_leaf", "call_site", "module_parents",
    "GradOptions", "GradState", "OutLeaf", "SOURCE_KINDS", "out_template", "rebuild", "keep_for_backward",
    "backward_state", "grad_keys", "by_event", "forward_edits", "perturbed_replay", "loss_value", "store_grads",
    "BackendSpec", "FrameworkRequirement", "hookimpl", "lazy_loader",
    "BackendCapabilities", "BackendProtocol", "CAPABILITY_PROTOCOLS", "SupportsInterventions", "SupportsBackward",
    "SupportsValidation", "SupportsValidationSession", "SupportsPersistence", "SupportsHostValues",
    "SupportsCallableTable", "SupportsOpRebinding", "SupportsValidationScopes", "EditOps", "DifferentiableEditOps",
    "ReplayOps", "SupportsGenerationRecording",
    "supports", "install_hint", "CaptureOptions", "TraceOptions", "AttributeWrite", "refusal_codes_for", "CAPABILITY_REFUSALS",
    "REFUSAL_CODES", "VALIDATION_REASONS",
    "EventLog", "OpEvent", "ModuleEnter", "ModuleExit", "ArgRef", "ModelInfo", "ModuleInfo", "ParamInfo", "BufferInfo",
    "fill_template", "input_paths", "positional_path", "keyword_path", "item_path", "field_path", "build_trace",
    "save_plan", "apply_save", "Provenance", "check_requested_capabilities",
    "ValidationStatus", "param_values", "CallablePlaceholder", "UnencodableValue", *_LAZY,
    "TorchLensError", "BackendUnsupportedError", "InvalidArgumentError", "TraceCaptureError", "ArtifactError",
    "LookupMissError", "RecordingError", "ReentrantTraceError", "SaveBudgetExceededError", "ValidationError",
    "STATS_FOLD_SLOTS", "FoldedStats", "take_stats_fold",
]
