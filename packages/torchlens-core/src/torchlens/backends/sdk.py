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
- Errors: the typed error classes a backend raises.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping

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


__all__ = [
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
]
