"""Typed errors with stable codes.

Every error TorchLens raises on purpose is a `TorchLensError` carrying `code` (a stable
string callers branch on), `fields` (the facts behind it) and `remedy` (what to do). Every
code is registered once in `ERROR_CODES` with the class that raises it and a one-line
meaning; `docs/reference/error-codes.md` is generated from that table and a test checks
the two agree. Raising an unregistered code is itself a bug and fails loudly.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = [
    "ERROR_CODES",
    "TorchLensError",
    "InvalidArgumentError",
    "AmbiguousOpLookupError",
    "LookupMissError",
    "SelectorCompositionError",
    "PayloadUnavailableError",
    "ReentrantTraceError",
    "TraceCaptureError",
    "SaveBudgetExceededError",
    "PluginError",
    "BackendUnsupportedError",
    "ValidationError",
    "ArtifactError",
    "RecordingError",
    "render_error_codes_markdown",
]

#: code -> (error class name, meaning). The single registry of codes.
ERROR_CODES: dict[str, tuple[str, str]] = {}


def _register(cls_name: str, codes: Mapping[str, str]) -> None:
    for code, meaning in codes.items():
        if code in ERROR_CODES:
            raise RuntimeError(f"error code {code!r} registered twice")
        ERROR_CODES[code] = (cls_name, meaning)


class TorchLensError(Exception):
    """Base of every typed TorchLens error: `code`, `fields`, `remedy`."""

    code: str
    fields: dict[str, Any]
    remedy: str

    def __init__(self, code: str, message: str = "", *, remedy: str = "", **fields: Any) -> None:
        if code not in ERROR_CODES:
            raise RuntimeError(f"unregistered TorchLens error code {code!r}")
        self.code = code
        self.fields = dict(fields)
        self.remedy = remedy
        self.message = message or ERROR_CODES[code][1]
        super().__init__(self.message)

    def __str__(self) -> str:
        text = f"[{self.code}] {self.message}"
        if self.remedy:
            text += f"\n  remedy: {self.remedy}"
        return text

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class InvalidArgumentError(TorchLensError, ValueError):
    """An argument has the wrong type or value."""


class AmbiguousOpLookupError(TorchLensError, KeyError):
    """A key names several records where one was asked for."""

    __str__ = TorchLensError.__str__


class LookupMissError(TorchLensError, KeyError):
    """A key names no record of the entry point's kind."""

    __str__ = TorchLensError.__str__


class SelectorCompositionError(TorchLensError, ValueError):
    """A selector was built or composed in a way that has no meaning."""


class PayloadUnavailableError(TorchLensError):
    """A value was asked for that the capture did not keep."""


class ReentrantTraceError(TorchLensError, RuntimeError):
    """A trace was started while another trace is active in this thread."""


class SaveBudgetExceededError(TorchLensError, MemoryError):
    """A capture kept more payload bytes than its `save_budget` allows."""


class TraceCaptureError(TorchLensError, RuntimeError):
    """The traced forward raised; `partial_trace` holds what was recorded before."""

    def __init__(self, code: str, message: str = "", *, remedy: str = "", partial_trace: Any = None, **fields: Any) -> None:
        super().__init__(code, message, remedy=remedy, **fields)
        self.partial_trace = partial_trace


class PluginError(TorchLensError, RuntimeError):
    """A plugin could not be loaded or registered."""


class BackendUnsupportedError(TorchLensError):
    """A backend refuses a request; `code` is a member of `tl.backends.REFUSAL_CODES`."""


class InterventionError(TorchLensError, ValueError):
    """An intervention could not be built, staged or applied; nothing was mutated."""


class AmbiguousAxisError(InterventionError):
    """An edit's axis could not be inferred: zero or several axes match."""


class TraceMutationWarning(UserWarning):
    """A root trace (not a fork) was edited in place; warned once per root trace."""


def quiet() -> None:
    """Quiet `TraceMutationWarning` for the rest of the session (spec glossary l. 317):
    installs an `ignore` filter for it in the `warnings` module, so a
    `warnings.catch_warnings()` block that restores the filters ends it too."""
    import warnings

    warnings.filterwarnings("ignore", category=TraceMutationWarning)


__all__ += ["quiet"]


class ValidationError(TorchLensError):
    """Validation could not run (not: validation ran and found a mismatch)."""


class ArtifactError(TorchLensError):
    """A saved artifact (`.tlspec` directory, exported file) could not be written or was
    refused on read: a path rule, a digest, a schema or a version check failed."""


_register("InvalidArgumentError", {
    "invalid_argument": "an argument has the wrong type or value",
    "backward_not_requested": "trace.backward was called on a trace not captured with backward_ready/save_grads",
    "model_type_unsupported": "the object to trace is not a model the backend can trace",
    "input_type_unsupported": "an input is of a type the backend cannot trace",
    "save_spec_invalid": "save= is not 'all', 'none', a selector or a list of labels",
    "capture_option_invalid": "a CaptureOptions field has a value outside its vocabulary",
    "on_nonfinite_invalid": "on_nonfinite is not one of 'ignore', 'track', 'warn', 'raise'",
    "accessor_count_by_key_required": "count_by() was called without a key",
    "accessor_count_by_key_unknown": "count_by() was given a field the records do not carry",
    "device_unavailable": "the forward asked for a device this machine does not have",
    "edit_detached_from_graph": "a keep_grad edit wrote values with no autograd graph",
    "graph_render_unavailable": "the graphviz 'dot' program needed to render a picture is missing",
    "file_format_unsupported": "draw() was asked for an output format it cannot write",
    "graph_render_failed": "the graphviz 'dot' program failed on the generated DOT source",
    "visualization_theme_invalid": "draw(theme=...) names no known theme",
    "visualization_show_containers_invalid": "draw(show_containers=...) is not a supported setting (or a removed one)",
    "draw_option_invalid": "a draw() option (depth, direction, layout, overrides) has a value outside its vocabulary",
    "collapse_value_invalid": "draw(collapse=...) is not 'none', 'auto', 'max' or a float in [0, 1]",
    "collapse_plan_unavailable": "the drawing skipped collapsing (pathologically large trace), so it has no collapse plan",
    "encoding_requires_dot_layout": "an encoding channel (color_by/size_by/stack_by) was combined with layout='rank'",
    "encoding_source_invalid": "an encoding channel's value source is unknown (or not valid for a rolled drawing)",
    "encoding_value_invalid": "an encoding channel's source produced a value of the wrong type",
    "encoding_callable_error": "an encoding channel's callable source raised; the original exception is chained",
    "encoding_scale_invalid": "size_scale is not 'sqrt' or 'linear'",
    "scale_requires_size_by": "size_scale was supplied without size_by",
    "size_by_rolled_varying": "size_by on a rolled drawing met a layer whose value varies across passes",
    "stack_by_auto_underivable": "stack_by=True/'auto' on a trace whose pass numbers are not monotone in execution order",
    "stack_by_requires_unrolled": "stack_by was combined with rolled=True",
    "flop_convention_invalid": "flop_convention is not 'fma2' or 'fma1'",
    "flop_convention_unavailable": "flop_convention='fma1' needs a MAC split that an op with FLOPs does not carry",
    "flop_keyword_removed": "a removed FLOP-counting keyword (count_fma_as_two=) was passed; use flop_convention=",
    "table_render_unavailable": "pandas, needed to build a table, is not installed",
})
_register("AmbiguousOpLookupError", {
    "ambiguous_op_lookup": "a key names several records where one was asked for",
    "multipass_bare_label_ambiguous": "a bare label of a multi-pass layer was given where one op is needed",
    "layer_pass_ambiguous": "a single-op read on a multi-pass Layer",
})
_register("LookupMissError", {
    "label_unknown": "no record has this label or address",
    "pass_out_of_range": "the pass number is outside 1..num_passes",
})
_register("SelectorCompositionError", {
    "selector_key_unknown": "a selector was given an unknown keyword or key",
    "selector_operand_invalid": "a selector was composed with something that is not a selector",
    "selector_no_match": "a selector matched no site where at least one was required",
    "selector_pattern_invalid": "a label_matches pattern is not a valid regular expression",
    "grad_selector_nested": "tl.grad was given another tl.grad selector",
    "grad_selector_inner_invalid": "tl.grad was given something other than a selector or a label (a list or dict)",
    "grad_selection_unsupported": "tl.grad was given a resolved Selection instead of a selector",
    "selector_cross_universe_and": "& or - combined activation sites with gradient sites",
    "selector_cross_universe_not": "~ was applied to a union that spans activation and gradient sites",
})
_register("PayloadUnavailableError", {
    "activation_not_saved": "the op's output was not saved by this capture's save=",
    "output_not_stored": "the model's return value is not held (loaded trace)",
    "output_forward_failed": "the forward failed before returning",
    "grad_not_saved": "the op has no saved gradient",
})
_register("ReentrantTraceError", {
    "reentrant_trace": "a trace was started while another trace is active",
})
_register("SaveBudgetExceededError", {
    "save_budget_exceeded": "the payloads a capture keeps exceed CaptureOptions(save_budget=...)",
})
_register("TraceCaptureError", {
    "forward_failed": "the traced forward raised; partial_trace holds the recorded prefix",
    "nonfinite_value": "an op produced NaN or Inf under on_nonfinite='raise'; partial_trace holds the prefix",
})
_register("PluginError", {
    "plugin_invalid": "a plugin entry point could not be imported or returned malformed objects",
    "backend_name_duplicate": "two registered backends share one name",
    "appliance_unknown": "no appliance is registered under this name",
    "appliance_name_taken": "an appliance name is already registered",
    "appliance_registration_invalid": "an appliance name or factory is malformed",
})
_register("BackendUnsupportedError", {
    "backend_unknown": "no backend of this name is registered or known",
    "backend_not_found": "no registered backend can trace this model",
    "backend_protocol_incomplete": "a backend's protocol object lacks members of BackendProtocol",
})
_register("InterventionError", {
    "intervention_site_invalid": "an intervention site is not a selector, label or mapping",
    "intervention_edit_invalid": "an edit is not a helper, a hook callable or a value",
    "intervention_shape_changed": "an edit changed the site's shape without allow_shape_change=True",
    "intervention_over_invalid": "mean_ablate's dim= is not None, an int, a tuple of ints or 'members'",
    "intervention_direction_invalid": "Rule(..., direction=...) was passed; the site decides the pass",
    "spec_rules_duplicate": "a merged recipe would hold the same clause twice",
    "replay_gradient_edit_unsupported": "a gradient edit was given to the replay engine",
    "replay_template_missing": "an op in the edit's downstream cone has no recorded callable or arguments to re-execute",
    "replay_payload_missing": "replay needs a payload this capture did not save",
    "replay_execution_failed": "re-executing an op of the downstream cone raised",
    "engine_invalid": "InterventionOptions(engine=...) is not 'replay', 'rerun' or 'set_only'",
    "rerun_inputs_required": "the rerun engine needs both model= and inputs=",
    "rerun_graph_diverged": "the edited rerun recorded a different graph than the unedited run",
    "zero_fire_policy_invalid": "on_zero_fire is not 'warn', 'error' or 'disclose'",
    "trace_zero_fire": "an intervention fired at zero sites during capture",
    "rerun_zero_fire": "an intervention fired at zero sites during a rerun",
    "bind_zero_fire": "a bound rule fired at zero sites",
    "bind_rule_unsupported": "a bound executor cannot apply this rule",
    "clear_edits_unmatched": "clear_edits(strict=True) named nothing it could remove",
    "edit_signal_mismatch": "an edit that reads forward state was attached to a gradient site",
    "patch_source_invalid": "patch_from's source has no value at the site",
    "helper_tensor_changed_since_capture": "a tensor an edit holds changed after the edit was staged",
    "steer_direction_invalid": "a steering or projection direction has the wrong shape or dtype",
    "do_loss_not_callable": "do(..., loss=) was given something that is not a callable of the returned trace",
    "do_loss_without_gradient_site": "do(..., loss=) was given for a plan with no gradient site",
    "subspace_basis_invalid": "a subspace basis is not a full-rank [k, d] matrix",
    "run_intervention_spec_not_persisted": "a loaded rule's edit is a placeholder for user code that was never saved",
    "subspace_edit_unsupported": "the verb has no subspace form",
    "subspace_projection_composed": "a subspace site was composed or nested",
    "affine_source_invalid": "set_affine_coordinates got a non-finite, non-float or mis-shaped W or bias",
    "affine_source_needs_subspace": "set_affine_coordinates was used outside tl.subspace",
})
_register("AmbiguousAxisError", {
    "axis_ambiguous": "an edit's axis matches zero or several axes of the site; pass dim=",
})
_register("ValidationError", {
    "validation_unavailable": "validation cannot run on this trace",
})
_register("ArtifactError", {
    "bundle_path_exists": "the save path already exists and overwrite=True was not given",
    "bundle_path_not_artifact": "overwrite=True would replace a path that is not a TorchLens artifact",
    "save_path_symlink_rejected": "the save path's final component is a symlink",
    "load_path_symlink_rejected": "the load path, its manifest or a listed file is a symlink",
    "artifact_save_level_unsupported": "the save level is not one this artifact kind can be written at",
    "artifact_write_failed": "the file system refused a write while saving; nothing was published",
    "artifact_not_found": "the load path does not exist or is not a directory",
    "artifact_read_failed": "the file system refused a read while loading",
    "artifact_kind_unsupported": "the manifest names an artifact kind this loader does not read",
    "artifact_file_missing": "a file the manifest lists is absent (or is not a regular file)",
    "artifact_file_unlisted": "the artifact holds a file its manifest does not list",
    "artifact_size_mismatch": "a listed file's size differs from the manifest",
    "artifact_digest_mismatch": "a listed file's sha256 differs from the manifest",
    "manifest_missing": "the artifact has no manifest.json",
    "manifest_malformed": "manifest.json is truncated, not JSON, or fails its schema",
    "manifest_version_unsupported": "the manifest names a saved format version this loader does not read",
    "manifest_disclosure_mismatch": "the manifest's counts or disclosures disagree with the records",
    "record_file_malformed": "a records file is not JSON or not a table of its record kind",
    "record_schema_invalid": "a record cell fails its typed schema",
    "record_reference_invalid": "a record names a label, address or payload that does not exist",
    "record_field_unencodable": "at save, a typed record field holds a value outside its type",
    "blob_malformed": "a payload blob is not a well-formed safetensors file, or disagrees with its payload records",
    "payload_codec_unavailable": "the payload codec the artifact names is not provided by an installed backend",
    "callable_not_persisted": "a saved callable placeholder was called: artifacts never store code",
    "safetensors_export_invalid": "a file read as a TorchLens safetensors export is malformed or of another schema",
    "recipe_audit_only": "a saved recipe holds callable placeholders and cannot be rebuilt",
    "recipe_record_malformed": "a saved intervention or recipe record is hand-edited or foreign",
    "subspace_spec_invalid": "a saved subspace basis or mask is malformed",
    "subspace_spec_basis_tampered": "saved subspace rows changed after saving",
    "subspace_spec_basis_not_orthonormal": "saved subspace rows are not orthonormal",
})


# Codes added per area. Each area registers its own codes below its own marker (one
# `_register(ClassName, {...})` call per error class), so parallel work never edits one dict.
# --- area: callables (loading never runs code) ---
_register("ArtifactError", {
    "opaque_op_not_replayable": "a loaded op names a callable outside its backend's closed table (or its arguments "
                                "hold a callable placeholder); it is opaque and refuses replay before anything runs",
})
# --- area: hostile files (bounded allocation, typed loader refusals) ---
_register("ArtifactError", {
    "payload_meta_invalid": "a payload's codec metadata (layout permutation, flags, device, key implementation) is malformed",
})
# --- area: capture hygiene (threads, global state, save budget) ---
_register("ReentrantTraceError", {
    "capture_lock_timeout": "a torch capture waited longer than CAPTURE_LOCK_TIMEOUT_S for another thread's capture",
})
_register("TraceCaptureError", {  # coded RuntimeWarnings of a capture ("[code] message")
    "capture_rng_unaccounted": "warning: the global random stream advanced during the capture outside its recorded random ops",
    "capture_worker_thread": "warning: Python code ran on another thread during the capture; ops there are not recorded",
    "capture_state_restore_incomplete": "warning: the capture could not restore an item of the model's state",
})
# --- area: publishing (overwrite, crash safety, lazy loads, write failures) ---
_register("ArtifactError", {
    "artifact_publish_unconfirmed": "the artifact was renamed into place but flushing its directory failed; "
                                    "it may not survive a crash",
})
# --- area: intervention misuse (forks, changed parameters, helper arguments) ---


class ReplayPreconditionError(InterventionError):
    """Replay refused before recomputing anything: a precondition of the recorded graph no
    longer holds (a parameter an op of the cone reads changed since capture)."""


__all__ += ["ReplayPreconditionError"]

_register("ReplayPreconditionError", {
    "replay_param_changed_since_capture": "a parameter an op of the replay cone reads changed since capture "
                                          "(optimizer step, load_state_dict, in-place write, param.data = t)",
})
_register("InterventionError", {
    "edit_argument_invalid": "an edit helper's argument has the wrong type, is not finite, or is out of range",
    "edit_argument_shape_mismatch": "an edit helper's tensor argument does not broadcast to the site's shape",
    "axis_semantics_unknown": "mean_ablate(dim=...) names a semantic axis (batch, position, feature) with no axis-role evidence",
    "position_edit_invalid": "tl.positions got an unsupported positions form or an axis the site does not have",
    "position_edit_out_of_range": "tl.positions names a position past the site's sequence length",
    "keep_grad_edit_invalid": "keep_grad was given something that is not an edit or a hook callable",
    "subspace_basis_dim_mismatch": "a subspace basis's width differs from the site's last axis",
    "intervention_option_invalid": "intervention= is not InterventionOptions/ReplayOptions, or one of their flags is not a bool",
})

# --- area: drawing big graphs (layout cost) ---


class DrawCostWarning(TorchLensError, UserWarning):
    """A warning, not raised: a drawing is about to run a Graphviz layout expected to take
    long. Carries `code`, `fields` (nodes, edges, estimate) and `remedy` like an error."""


__all__ += ["DrawCostWarning"]

_register("DrawCostWarning", {
    "draw_layout_slow": "warning: the Graphviz dot layout of this drawing is expected to take longer than "
                        "tl.viz.LAYOUT_WARN_SECONDS (estimate from the drawn node count)",
})

# --- area: spec fidelity (issue 13: saved interventions, verbs, helpers, facts) ---


class OpaqueCallableError(InterventionError):
    """A rule holds user code (a hook, a spliced module, a `tl.where` predicate) that has no
    portable form: saving it below level "audit" refuses, naming the rule."""


__all__ += ["OpaqueCallableError"]

_register("OpaqueCallableError", {
    "intervention_spec_not_portable": "a rule runs user or session code (or a predicate), which a portable spec cannot hold",
})
_register("InterventionError", {
    "run_capability_unavailable": "the guarded fast rerun cannot run this trace or plan (fields['stage'] names the guard); "
                                  "trace.run falls back to the capture engine and reports it in last_run['fast_refused']",
    "output_structure_mismatch": "a rerun's model output does not pair with the captured output ops (leaf count or path)",
    "backward_armed_edit_unapplied": "trace.backward on a trace holding gradient rules staged after its capture, which its "
                                     "recorded backward graph cannot carry (apply them on a rerun)",
})


class ZeroFireWarning(TorchLensError, RuntimeWarning):
    """A warning, not raised: an intervention fired at zero sites (`on_zero_fire="warn"`).
    Carries `code` (`trace_zero_fire`, `rerun_zero_fire`, `bind_zero_fire`), `fields`
    (`hints`; `reason="module_output_not_tensor"` with `reason_detail` for a module that
    returned no tensor) and `remedy` like an error."""


__all__ += ["ZeroFireWarning"]

_register("SelectorCompositionError", {
    "bind_static_anchor_unresolved": "a module selector names an alias spelling of a module registered under several "
                                     "names; select its canonical named_modules() name",
})


# --- area: backend contract (issue 14: plugin loading, capability protocols, scorecard honesty) ---


class PluginWarning(TorchLensError, UserWarning):
    """A warning, not raised: a third-party plugin was skipped (it failed to import, to
    register, or its hook raised or returned malformed objects). Carries `code`, `fields`
    (plugin, distribution, error) and `remedy` like an error; the doctor lists the plugin."""


__all__ += ["PluginWarning"]

_register("PluginWarning", {
    "plugin_skipped": "warning: a third-party plugin failed to load or returned malformed objects and was skipped "
                      "(the doctor lists it as broken; other plugins keep working)",
})
_register("BackendUnsupportedError", {
    "backend_capability_members_missing": "a backend declares a capability in capabilities() but lacks the members "
                                          "of that capability's protocol (refused at registration)",
    "backend_capability_undeclared": "a backend has members of a capability protocol whose capability it does not "
                                     "declare (refused at registration)",
    "backend_refusal_codes_inconsistent": "a backend's refusal_codes() lists the refusal code of a capability it "
                                          "declares supported (refused at registration)",
})


# --- area: capture correctness (issue 12 §3: views, slots, reruns, data-dependent values) ---
_register("ReplayPreconditionError", {
    "replay_value_read_changed": "an op of the replay cone produced a value the forward read into Python (.item(), "
                                 ".tolist(), int(t), a branch condition), and the edit changes what that read gives: a "
                                 "shape, index or branch recorded at capture may no longer hold; rerun instead",
    "replay_op_unsupported": "an op of the replay cone cannot be re-executed from its recorded arguments "
                             "(torch.autograd.grad inside the forward, a write through a view of a non-contiguous "
                             "base); rerun instead",
})
_register("InterventionError", {
    "rerun_graph_diverged_downstream": "warning: an edit changed the rerun's graph after every edited op (its own "
                                       "effect on the control flow); the result records the edited run",
})
_register("InvalidArgumentError", {
    "backward_inference_only": "trace.backward on an inference-only capture (its forward ran under torch.no_grad() "
                               "or CaptureOptions(inference_only=True)): there is no autograd graph",
})
_register("TraceCaptureError", {
    "capture_nonfinite_detected": "warning (on_nonfinite='warn', once per capture): ops produced NaN or Inf",
    "capture_compiled_region_eager": "warning: a torch.compile'd submodule ran eagerly op by op during the capture; its "
                                     "values may differ in the last bits from a compiled call",
})

# --- area: validation verdicts (issue 12 §1-§2, issue 13 validation scopes) ---
_register("ValidationError", {
    "backward_validation_carried_graph": "tl.validate(scope='backward'): the backward went through a graph an earlier "
                                         "backward freed, and module attributes (fields['attributes']) hold tensors "
                                         "with autograd history carried between calls",
})

# --- area: spec fidelity round 2 (issue 13 rest: edit helpers, trace facts, options) ---
_register("InterventionError", {
    "subspace_mode_invalid": "subspace_ablate got inconsistent mode arguments (an unknown mode, mode='mean' without "
                             "mean=, mode='resample' without seed=, or an argument another mode uses)",
    "transform_mask_missing": "tl.positions with 'first'/'last' got neither mask= nor assume_no_padding=True",
    "transform_mask_incompatible": "tl.positions: the mask does not describe the value (not a (batch, tokens) array "
                                   "matching it, or a row with no real token)",
})
_register("InvalidArgumentError", {
    "storage_option_invalid": "a StorageOptions field has a value outside its vocabulary",
    "recording_option_invalid": "a RecordingOptions field has a value outside its vocabulary",
})
_register("ArtifactError", {
    "subspace_spec_mask_tampered": "a saved subspace or element-mask edit's mask does not match its stored sha256",
})

# --- area: first hour round 3 (issue 27 rest: save= enforced in core, staged edit checks, notebook HTML) ---
_register("PluginError", {
    "backend_save_plan_ignored": "a backend kept payloads that save= did not ask for (it ignored save_plan/apply_save); "
                                 "core refuses its trace",
})

# --- area: spec fidelity round 3 (issue 13 leftovers: tied parameters, provenance facts, cited codes) ---
_register("ArtifactError", {
    "intervention_helper_renamed": "a saved spec names a removed helper spelling (mean_fill is now mean_ablate, "
                                   "resample_ablate is now scramble_elements); fields['replacement'] names the new one",
})
_register("InterventionError", {
    "rerun_entry_point_unsupported": "the rerun engine cannot rerun a capture rooted at a bound method "
                                     "(provenance.root_entry_point 'bound_method:...'); replay is unaffected",
})


# --- area: spec fidelity round 4 (issue 13 leftovers: provenance identity, tl.fingerprint) ---
class FingerprintMismatchError(TorchLensError, AssertionError):
    """`tl.fingerprint.assert_unchanged`: the model's structural hash is not the pinned one
    (an AssertionError too, so test runners report it as a failed assertion)."""


_register("FingerprintMismatchError", {
    "fingerprint_changed": "the model's address-free structural hash (trace.provenance.fingerprint) differs from the "
                           "pinned one: an op, its order, a dataflow edge, an output shape or dtype, or an owning "
                           "module class changed",
})
__all__ += ["FingerprintMismatchError"]

# --- area: spec fidelity round 4 S2 (issue 13 leftovers: Population, subspace partial axis, rerun refusals) ---
class ReplayFrontierWarning(TorchLensError, UserWarning):
    """A warning, not raised: a keep_grad edit kept the graph of a differentiable replay, whose
    gradients stop at the replay frontier (the edited site). Carries `code`, `fields`, `remedy`."""


__all__ += ["ReplayFrontierWarning"]

_register("ReplayFrontierWarning", {
    "keep_grad_replay_frontier": "warning (once per session): a keep_grad edit passed its check under differentiable "
                                 "replay; parameters upstream of the replay frontier get no gradient (the live path "
                                 "tl.when(site, keep_grad(edit)).bind(model)(x) reaches them)",
})
_register("InterventionError", {
    "subspace_projection_partial_axis": "tl.subspace(tl.units(site, mask), basis): at some position the mask covers "
                                        "only part of the features the basis touches (a units-restricted subspace "
                                        "picks whole positions)",
    "rerun_selector_unmatchable_live": "a rerun edit's selector matches sites of the rerun's graph but fired at none "
                                       "of them live (an input, an output or a __setitem__ op no live hook can "
                                       "edit); raised whatever on_zero_fire says, the trace unchanged",
    "bind_lazy_output": "a bound call returned an async lazy output (coroutine, awaitable, async generator or "
                        "iterator), which the bound executor cannot keep steered",
})
_register("SelectorCompositionError", {
    "grad_facet_unsupported": "tl.grad over a facet or head selector (tl.facet, tl.head, or a composition holding "
                              "one): a facet slice has no gradient site of its own",
})

# --- area: bundles (issue 25: tl.Bundle, the comparison gate, metrics, diff drawings) ---
class BundleError(TorchLensError):
    """A Bundle read or edit that cannot be answered: members that do not align, a guarded
    parameter read, an unknown stored comparison."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """A keyword or argument a verb does not take (in this form)."""


class ArgumentConflictError(InvalidArgumentError):
    """Two arguments that each make sense alone but disagree (a file_format that contradicts
    the path's extension)."""


__all__ += ["BundleError", "ArgumentTypeError", "ArgumentConflictError"]
_register("ArgumentConflictError", {
    "draw_format_mismatch": "draw(path, file_format=...): file_format disagrees with the path's extension "
                            "(Trace.draw and Bundle.draw)",
})
_register("InvalidArgumentError", {
    "bundle_member_invalid": "a Bundle member is not a Trace, or its name is not a non-empty string",
    "bundle_member_exists": "Bundle.add was given a name the bundle already holds",
    "bundle_baseline_unknown": "baseline= names no member of the bundle",
    "bundle_site_unresolved": "Bundle.at(site) / compare(on=) could not resolve the site in every member",
    "metric_invalid": "metric= is not a known output-difference metric name or a callable",
    "metric_size_mismatch": "an output-difference metric was given two values with different element counts",
    "bundle_show_kind_invalid": "bundle.show(kind=...) is not None, 'graph', 'strip', 'repr' or 'html'",
    "bundle_draw_option_invalid": "a Bundle.draw option (graph=, members=, metric=) has a value outside its vocabulary",
    "bundle_vary_mapping_invalid": "Bundle.vary was given a mapping that does not cover every member (or names others)",
    "bundle_member_unknown": "Bundle.why / provenance.summary: a member or relative_to= name is not a member of the bundle",
})
_register("ArgumentTypeError", {
    "bundle_draw_keyword_unsupported": "Bundle.draw got a keyword its renderer does not support (in this graph mode)",
})
_register("BundleError", {
    "bundle_gate_param_shapes": "comparison gate: the two members' models do not share parameter addresses, shapes "
                                "and dtypes (the same_param_shapes floor)",
    "bundle_gate_ordered": "comparison gate: a directed path of ordering relation rows joins the two members",
    "bundle_gate_graph_mismatch": "comparison gate: the members' graph-shape hashes differ and their inputs are not "
                                  "proven equal, so their sites do not line up",
    "comparison_unknown": "Bundle.stored_comparison was asked for a name never stored",
    "checkpoint_series_live_params": "a cross-member parameter value read on a Bundle whose members carry no "
                                     "capture-time parameter snapshot (only live references)",
    "checkpoint_snapshot_stale": "snapshot_params: a parameter changed since the trace was captured, so its current "
                                 "value is not capture-time evidence",
    "vary_partial_failure": "Bundle.vary failed on a member after earlier members were changed (fields: completed)",
    "bundle_relation_schema_invalid": "a relation row's kind, members or params are malformed",
    "bundle_relation_member_missing": "a relation row names a member the bundle does not hold",
    "bundle_relation_evidence_over_budget": "a relation row's evidence is larger than 1 MiB (as JSON)",
    "bundle_relation_evidence_site_missing": "an evidence item's claim names a site (op label) or param address its "
                                             "member does not have (fields kind, item, member, missing)",
    "bundle_relation_span_out_of_bounds": "a fed_by token span reaches past the end of a member's bound token stream",
    "bundle_relation_span_unverified": "a fed_by row claims verified/matched spans that the members' bound token "
                                       "streams contradict (ids differ, a source span outside the completion range, "
                                       "a digest that no longer matches)",
    "bundle_token_divergence_unavailable": "Bundle.token_divergence: a member has no token-stream binding with a "
                                           "completion range and retained ids (fields member, reason)",
    "bundle_relation_auto_spans_unavailable": "fed_by token_spans='auto': the source has no bound completion range, "
                                              "or a member's token ids were not retained",
    "bundle_relation_auto_spans_ambiguous": "fed_by token_spans='auto': a run of the source's output has several "
                                            "placements in the reader's prompt (a repeated quote, or a tie of trims)",
    "bundle_relation_auto_spans_unmatched": "fed_by token_spans='auto': a run of the source's output is not in the "
                                            "reader's prompt, even with two boundary tokens trimmed per side",
    "alternative_target_missing": "Bundle.add_alternative: a steered call is absent from either run (field side)",
    "alternative_target_unsteered": "Bundle.add_alternative: a declared steered call was captured without a spec "
                                    "that fired",
    "alternative_steer_undeclared": "Bundle.add_alternative: another second-run call was captured under a spec",
    "alternative_member_name_taken": "Bundle.add_alternative: a copy would reuse a member name; pass another prefix",
    "alternative_unchanged_call_diverged": "Bundle.add_alternative: an unsteered call saw the same prompt but wrote "
                                           "different text (noise TorchLens cannot separate from the steer)",
    "token_binding_invalid": "a torchlens.boundary_facts token_boundary_v1 descriptor is malformed or disagrees "
                             "with the trace's own token ids",
    "bundle_draw_grad_fns_missing": "Bundle.draw(graph='backward'/'combined'): a member has no grad_fn records "
                                    "(captured under no_grad, by a backend without autograd, or saved by an older "
                                    "build; fields member, reason)",
    "bundle_why_baseline_missing": "Bundle.why / provenance.summary(): no baseline is configured and no member reads "
                                   "pristine, and relative_to= was not given",
    "bundle_why_lineage_indirect": "Bundle.why: the member and the reference are joined only through a shared "
                                   "relative (siblings), not by one chain of rows pointing one way (field shared)",
    "bundle_why_lineage_ambiguous": "Bundle.why: several relation paths join the member and the reference, so no "
                                    "one chain is exact (field paths)",
    "bundle_why_lineage_opaque": "Bundle.why: the member and the reference are joined only through rows of "
                                 "unregistered (opaque) kinds, which are never interpreted",
    "bundle_episode_id_unknown": "Bundle.episode_status: no episode_member row carries this episode_id (field known)",
    "bundle_episode_ledger_invalid": "Bundle.episode_status: episode_ledger= is malformed, records another episode, "
                                     "or does not list exactly the episode's members (plus absent steps)",
})
_register("ArtifactError", {
    "bundle_artifact_malformed": "a saved bundle's manifest.json or relations.json is malformed or does not match "
                                 "its recorded digest",
})


# --- area: facets (issue 15: named views, recipes, facet edits) ---
class FacetError(TorchLensError, ValueError):
    """A facet spec, recipe, registration or facet edit that has no meaning; nothing was mutated."""


class FacetLookupError(TorchLensError, KeyError):
    """A facet name the module does not have now (unknown, or structurally absent): a KeyError."""

    __str__ = TorchLensError.__str__


class MissingFacetError(FacetLookupError):
    """A declared facet whose inputs the capture did not keep; the remedy names what to save."""


class FacetWarning(TorchLensError, UserWarning):
    """A warning, not raised: two recipes of one specificity tier and source declare the same
    facet for a module (the later registration wins), or a facet selector fans out."""


class LogitLensError(TorchLensError, ValueError):
    """The logit lens cannot project faithfully: no head, or a reconstruction that does not
    reproduce the captured logits on the last layer (experimental)."""


class LogitLensWarning(TorchLensError, UserWarning):
    """A warning, not raised: a user lens records no model identity (or one that cannot be
    compared) and does not reproduce the captured logits on the last layer (experimental)."""


__all__ += ["FacetError", "FacetLookupError", "MissingFacetError", "FacetWarning", "LogitLensError",
            "LogitLensWarning"]
_register("LogitLensError", {
    "logit_lens_head_unavailable": "no language-model head recipe (with a structurally found final norm) matched "
                                   "the trace, or several did",
    "logit_lens_verification_failed": "the reconstructed final norm + unembedding applied to the last block's "
                                      "facet does not reproduce the captured logits (pass verify=False to trust it)",
    "logit_lens_facet_unavailable": "no module provides the projected facet (facet=), or modules= names one without it",
    "logit_lens_mask_input_unavailable": "mask_input=True needs the trace's first input to be a saved integer "
                                         "token-id tensor",
    "logit_lens_layer_outside_head": "modules= names a block outside the tower the head reads (a CLIP text-tower "
                                     "block for the image head)",
    "logit_lens_identity_mismatch": "a user lens's measured model_identity differs from the traced model's "
                                    "(verify=False runs it anyway)",
})
_register("LogitLensWarning", {
    "logit_lens_identity_unrecorded": "a user lens with no comparable model_identity does not reproduce the captured "
                                      "logits on the last layer (fields: max_abs_error, top1_agreement)",
})
_register("FacetWarning", {
    "facet_recipe_collision": "two same-tier recipes declare one facet name for a module; the later one is used",
    "facet_selector_fanout": "an unscoped facet selector writes several sites (fields: site_count)",
    "facet_plugin_recipe_invalid": "a plugin's torchlens_facet_recipes hook returned a non-recipe object (skipped)",
})
_register("FacetLookupError", {
    "facet_unknown": "no structural output or recipe of this module declares the facet name",
    "facet_structurally_absent": "a recipe declares the facet but this module's structure has no such value "
                                 "(e.g. resid_mid on a parallel-residual block)",
    "facet_invalidated": "an edit marked the facet stale on this trace (trace.annotations['mi_invalidated_facets'], "
                         "set by the mechinterp kit's patch_head): it does not hold the run's value",
})
_register("SelectorCompositionError", {
    "facet_selector_unsupported": "a facet selector was resolved as plain sites (trace[...], find_sites, a "
                                  "composite): it names a facet slice, usable only as a do() site",
    "selector_module_facet_scope_conflict": "a facet selector already scoped to one module was scoped to another",
})
_register("MissingFacetError", {
    "facet_needs_capture": "a declared facet's inputs were not kept by this capture (save=, save_args=, RNG)",
})
_register("FacetError", {
    "facet_spec_invalid": "a FacetSpec was built with an unknown home kind or an incomplete primitive chain",
    "facet_transform_invalid": "a transform primitive does not fit the home value's shape (heads, split, dims)",
    "facet_index_out_of_range": "a head, section or select index is outside the facet's dimension",
    "facet_module_multi_call": "module.facets on a module called more than once: choose module.calls[n].facets",
    "facet_recipe_invalid": "a recipe returned something other than a mapping of names to FacetSpec (or None)",
    "facet_registration_invalid": "tl.facets.register got no class_name/class_qualname/predicate or a bad recipe",
    "facet_config_missing": "tl.facets.config_value found none of the named attributes on the module record",
    "facet_not_attention": "a head selector or attention facet was asked of a module no attention recipe matches",
    "facet_write_refused": "a facet edit on a computed, aliasing, non-op-home or non-raw facet (read-only)",
    "facet_write_overlap": "two facet edits on one home op write overlapping regions",
    "facet_grad_unavailable": "a MissingGrad sentinel was used as a tensor: the facet has no saved gradient",
    "facet_child_unknown": "child_output_spec/parameter_spec named no child module or parameter of the module",
    "facet_reconstruction_mismatch": "a reconstructed facet (fused-attention pattern, per-head result) failed its "
                                     "check against the captured op output (beyond the rounding the dtype allows); "
                                     "it is not served",
    "facet_annotation_invalid": "trace.annotations['mi_invalidated_facets'] is not a mapping of module address to "
                                "facet names",
})


# --- area: datasets at scale (issue 23: tl.stats, extraction helpers, data-parallel runs) ---
_register("InvalidArgumentError", {
    "stats_input_invalid": "a tl.stats accumulator got a value it cannot read as a real numeric array "
                           "(a graph-connected tensor must be detached first)",
    "stats_shape_mismatch": "a batch's feature or unit shape differs from the accumulator's earlier batches",
    "stats_merge_mismatch": "merge() got an accumulator of another kind or configuration",
    "stats_empty": "a statistic was read from an accumulator that has folded too few rows",
    "stats_option_unsupported": "a tl.stats option that is not built was requested (e.g. Quantile(mode='reservoir'))",
    "stats_histogram_range_required": "a streaming Histogram was built without fixed edges (range= or edges=)",
    "aggregate_loss_fn_required": "tl.stats.aggregate got a gradient metric key without loss_fn=",
    "aggregate_metric_invalid": "a tl.stats.aggregate metric key or accumulator is not usable",
    "extraction_layers_invalid": "extract/pluck/extract_dataset got no layers, or a layer that is not a name or selector",
    "extraction_dataset_invalid": "extract_dataset got a dataset it cannot iterate or a batch_size that is not a positive int",
    "extraction_path_exists": "disk-mode extract_dataset found a non-empty directory and resume=True was not given",
    "distributed_group_invalid": "distributed= is not True/False/None or a data-parallel group object",
    "distributed_unavailable": "distributed=True but no data-parallel group is initialised",
    "extraction_option_unsupported": "an extract_dataset option that is not built yet was requested "
                                     "(a ragged= other than 'trim')",
    "harvest_address_class_ungated": "intervened extraction got a spec addressed finer than by module or op type "
                                     "(or a gradient rule)",
    "extraction_intervention_batch_coupled": "an intervene= helper does not declare is_batch_independent=True, so "
                                             "stored rows would depend on the batching",
    "extraction_intervention_no_fire": "an intervened extraction batch where the spec fired nowhere",
    "extraction_intervention_site_drift": "an intervened extraction batch whose fired sites differ from the sites "
                                          "batch zero froze",
    "stats_capture_not_replayable": "replay, an edit, a fork, a re-run or validation was asked of a save='stats' "
                                    "trace, which kept per-op RunningStats and no payloads",
    "stats_capture_required": "tl.stats.site_stats got a trace that was not captured with save='stats'",
    "stats_aggregate_cache_unkeyable": "tl.stats.aggregate(cache=True) cannot key the run by value (a batch, "
                                       "accumulator, encoder or loss_fn it cannot hash)",
})
_register("PayloadUnavailableError", {
    "activation_reduced_to_stats": "a payload was read from a save='stats' trace: the out was folded into a "
                                   "RunningStats and discarded",
})
_register("PluginError", {
    "backend_stats_fold_invalid": "a backend that took the save='stats' during-forward fold saved something other "
                                  "than a 16-slot FoldedStats vector for an op",
})
_register("ArtifactError", {
    "stats_state_invalid": "a tl.stats state file is unreadable, damaged or does not fit its accumulator kind",
    "stats_state_foreign": "a file is not a tl_stats_state_v1 state (wrong format tag or unknown kind)",
    "extraction_resume_signature_mismatch": "resume=True found a run signature (model, dataset, layers, options) "
                                            "that differs from the stored manifest",
    "extraction_manifest_invalid": "an extraction directory's manifest.json is missing, unreadable or foreign",
    "extraction_shard_invalid": "an extraction shard is unreadable, truncated, or disagrees with the manifest "
                                "(digest, keys, dtypes, shapes)",
    "extraction_shard_foreign": "a shard file is not a tl_extraction_shard_v1 shard of this run",
})

# --- area: jax research (issue 28: transforms, containers, loaded-trace validation) ---
_register("InvalidArgumentError", {
    "trace_inside_jax_transform": "tl.trace was called inside jax.jit, jax.grad, jax.vmap or another JAX transform: "
                                  "its inputs, parameters or closure constants are tracers, not values",
    "linen_variables_missing": "a flax.linen module was traced without its variables (a mapping of collections, "
                               "as module.init returns)",
})
_register("BackendUnsupportedError", {
    "state_structure_changed": "an nnx forward added or removed module state (a Variable), so its state writes have "
                               "no leaf-by-leaf record",
})
_register("ArtifactError", {
    "save_records_invalid": "at save, the trace's records fail a check tl.load makes (a record names one that is not "
                            "saved); nothing is written",
})


# --- area: mechinterp kit (issue 16: the kit's mi_* refusals; the kit lives in torchlens-mechinterp) ---
class MechInterpError(TorchLensError, ValueError):
    """A mech-interp kit refusal (`mi_*`): the model, trace or arguments do not support the
    requested analysis; nothing was mutated, and the remedy names what would. As the kit's
    refusal contract says, the code is also `fields["code"]`."""

    def __init__(self, code: str, message: str = "", *, remedy: str = "", **fields: Any) -> None:
        super().__init__(code, message, remedy=remedy, **fields)
        self.fields["code"] = code


# --- area: mechinterp kit part 1a (residual decomposition, DLA, heads, circuits, neurons, retention) ---
_register("MechInterpError", {
    "mi_payloads_missing": "a kit function needs payloads the trace did not save; the refusal lists the COMPLETE "
                           "missing-site set (retention_plan prices it and builds the save= list)",
    "mi_lm_head_unavailable": "no language-model head with a structurally found final norm (or several) in the "
                              "trace, so the residual stream's end is not known",
    "mi_residual_rescaled": "the residual stream is not a plain sum of writers: a step rescales or mixes it, so "
                            "partial sums cannot replay the forward",
    "mi_residual_hop_unverified": "a value-preserving hop on the residual spine (view, to, clone, ...) changed the "
                                  "payload, so the walk cannot cross it",
    "mi_residual_open": "the strict walk did not close: a partial sum differs from the captured spine state under "
                        "torch.equal (strict=False returns a diagnostic stack with an unresolved_remainder row)",
    "mi_stack_open": "a ComponentStack was asked to construct with grade 'open' or an unknown grade; OPEN never "
                     "constructs",
    "mi_stack_diagnostic_only": "a diagnostic-only stack (strict=False, with an unresolved_remainder row) was "
                                "passed where a verified stack is required",
    "mi_dla_identity_failed": "the identity sum(rows) + constant == the captured native logit failed the "
                              "per-element budget (the worst element is named)",
    "mi_dla_token_invalid": "answer= / vs= is not a token id (or a list of them) inside the unembedding's "
                            "vocabulary, or their lengths differ",
    "mi_dla_grain_invalid": "grain= is not 'layer' or 'head'",
    "mi_dla_rows_invalid": "rows= names a component that is not a row of the table at this grain",
    "mi_stack_mismatch": "stack= does not decompose this trace's final-norm input (its rows do not sum to the "
                         "captured value under torch.equal): it belongs to another trace or target",
    "mi_position_invalid": "position= is not an int inside the sequence (or None for every position)",
    "mi_not_attention": "the module address names no attention block an attention recipe matched",
    "mi_head_result_unverified": "the per-head result rows plus the output bias do not reproduce the attention "
                                 "writer within its budget",
    "mi_head_weights_unresolved": "the head weight views cannot be derived: an unknown projection class, a "
                                  "projection without one weight, or no slice evidence for a fused QKV",
    "mi_not_mlp": "the module address names no MLP with one output projection (a linear / Conv1D child)",
    "mi_neuron_index_invalid": "neurons= names an index outside the MLP's hidden width, or repeats one",
    "mi_neuron_identity_failed": "per-neuron rows plus the bias constant do not reproduce the MLP's captured "
                                 "output within its budget",
    "mi_retention_function_unknown": "retention_plan was asked for a function that is not a kit trace function",
})


# --- area: mechinterp kit part 1b (head scores, prompts, aliases, patch grids) ---
_register("MechInterpError", {
    "mi_period_invalid": "FixedPeriodInduction(period=...) was given a period that is not a positive int",
    "mi_head_scores_kind_unknown": "head_scores kind= is not 'previous_token', 'duplicate_token', 'induction' or a "
                                   "FixedPeriodInduction",
    "mi_head_scores_setting_invalid": "a head_scores setting is not a bool, or does not apply to the kind",
    "mi_period_no_queries": "a FixedPeriodInduction score found a batch row with no query whose token repeats at "
                            "the period: nothing to score",
    "mi_no_attention": "the trace (or model) has no attention module call an attention recipe describes",
    "mi_tokens_unavailable": "the function needs token ids and the trace kept no integer token input",
    "mi_tokens_mismatched": "the token ids given do not match the captured sequence's [batch, pos] shape",
    "mi_head_counts_differ": "attention calls have different head counts, so no [layer, head] table exists",
    "mi_facet_absent": "an attention call declares no such facet (no recipe produced it for this attention)",
    "mi_facet_needs_capture": "a facet the function reads is declared but not readable in this capture (e.g. SDPA "
                              "without CaptureOptions(save_args=True))",
    "mi_tokenizer_invalid": "the tokenizer is not an object with encode(text) -> ids and decode(ids) -> text",
    "mi_prompt_invalid": "the prompt or answer is empty, not text / token ids, or the answer tokenizes to nothing",
    "mi_bos_policy_invalid": "prepend_bos= is not True, False or None, or BOS is asked for and the tokenizer has no "
                             "bos_token_id",
    "mi_logits_unavailable": "the model's output holds no [batch, pos, vocab] logits the prompt can be scored on",
    "mi_alias_unknown": "the alias is no spelling of the named generation (TransformerLens 2.x/3.x/4.x, nnterp, "
                        "interp-engine)",
    "mi_alias_generation_unknown": "generation= is not 'tl2', 'tl3', 'tl4', 'nnterp', 'interp-engine' or None",
    "mi_alias_unresolved": "the alias is real for this model family but its native coordinate is not in the trace",
    "mi_patch_preset_unknown": "patch_grid preset= names no preset",
    "mi_patch_engine_reserved": "patch engine='replay' is reserved (not built); patch grids run on the live-hook "
                                "rerun route",
    "mi_patch_setting_invalid": "a patch grid setting is invalid (budget not a positive int, heads / positions out "
                                "of range, site not 'k' or 'v', a non-callable metric)",
    "mi_patch_site_unwritable": "a patch grid cell's site is read-only (a computed or aliasing facet: fused SDPA "
                                "pattern, a grouped K/V head read through a query head)",
    "mi_patch_budget_exceeded": "the grid's disclosed cost (forward runs) exceeds budget=; nothing ran",
    "mi_patch_inputs_mismatched": "clean and corrupted inputs trace to different graphs or shapes, so their sites "
                                  "cannot be paired",
    "mi_patch_metric_invalid": "the metric did not return one finite scalar",
    "mi_patch_hook_not_fired": "a patch cell's hook fired zero times (or more than once) on the patched rerun: the "
                               "cell is an exception, never a number",
    "mi_patch_head_unsupported": "patch_head cannot lower the head edit: no single post-projection op found "
                                 "downstream of the fused attention kernel",
    "mi_facet_invalidated": "a facet the patch_head edit invalidated was read on the patched rerun",
    "mi_kv_expansion_unavailable": "grouped-query K/V are expanded inside a fused kernel (SDPA enable_gqa): there "
                                   "is no expansion op to patch one query head's copy at",
    "mi_kv_expansion_ambiguous": "several candidate K/V expansion ops in one attention call: the query-head copy to "
                                 "patch is ambiguous",
    "mi_kv_heads_not_grouped": "query and key/value head counts are equal: there is no grouped K/V to expand",
})

# --- area: mechinterp kit part 2 (issue 17) ---
_register("MechInterpError", {
    "mi_edge_graph_nonadditive": "component_graph: the residual stream is not additive under the input / head / "
                                 "bias / MLP decomposition (rescaled stream, other writer, a receiver not the sum "
                                 "of its senders, not pre-norm)",
    "mi_edge_graph_gqa_unsupported": "component_graph: grouped-query attention (fewer key/value heads than query "
                                     "heads) is not supported by the edge graph",
    "mi_edge_unknown": "patch_edges: an edge is not in the trace's component graph",
    "mi_edge_patch_edge_repeated": "patch_edges: an edge was passed more than once",
    "mi_edge_corrupted_graph_invalid": "patch_edges: corrupted_graph= is not a ComponentGraph",
    "mi_edge_patch_not_replayable": "patch_edges: the trace was not captured replayable",
    "mi_edge_scores_setting_invalid": "edge_scores: method / steps / example_reduction is not a valid setting, or "
                                      "the model offers no hook point the scores need",
    "mi_edge_scores_metric_invalid": "edge_scores: the metric is not callable or does not return one value per "
                                     "example",
    "mi_edge_scores_inputs_mismatched": "edge_scores / patch_edges: the corrupted input (or graph) differs in shape "
                                        "from the clean one",
    "mi_edge_scores_shared_norm": "edge_scores: one norm feeds several blocks (shared attention/MLP norm): a "
                                  "receiver-local gradient is not defined",
    "mi_faithfulness_curve_invalid": "circuit_performance_ratio / circuit_model_difference: the faithfulness curve "
                                     "is malformed (length, order, range, non-finite)",
})

# --- area: trace lifecycle and mechinterp part 2b (issue 17: replayable, Trace.cleanup, ACDC, causal_audit) ---
_register("PayloadUnavailableError", {
    "trace_cleaned_up": "trace.cleanup() released this trace's payloads, gradients and live output",
})
_register("MechInterpError", {
    "mi_acdc_setting_invalid": "acdc: threshold / metric / edges / max_tests is not a valid setting, or the metric "
                               "does not return a finite value",
    "mi_audit_table_invalid": "causal_audit: the table is not an EDGE table of the component graph, or edges= names "
                              "an edge it does not hold",
})

# --- area: tf backend (issue 19) ---
# (tf_stateful_op_unsupported is in the backend refusal vocabulary, torchlens/backends/codes.py)

# --- area: paddle backend (issue 20) ---
# (runtime_conflict is in the backend refusal vocabulary, torchlens/backends/codes.py)

# --- area: tinygrad backend (issue 21) ---

# --- area: recording (issue 22: tl.record, Recorder, generation recording) ---
class RecordingError(TorchLensError, ValueError):
    """A `tl.record` / `tl.recording` refusal: the recording cannot answer or the request is
    outside what the recorder supports; nothing was mutated. `partial_recording` holds a
    failed partial Recording when `on_forward_error="attach_partial"` attached one."""

    def __init__(self, code: str, message: str = "", *, remedy: str = "", partial_recording: Any = None,
                 **fields: Any) -> None:
        super().__init__(code, message, remedy=remedy, **fields)
        self.partial_recording = partial_recording


_register("RecordingError", {
    "recording_pass_missing": "a Recording was asked for a pass number it does not hold",
    "recording_site_missing": "a Recording pass holds no site of that name (it never ran there)",
    "recording_lean_omitted": "a read needs the full event journal, which a lean recording pass did not keep",
    "recording_failed_partial": "a failed partial Recording was passed to to_trace(), backward() or a verb built on "
                                "them (the capture-outcome error)",
    "recording_forward_failed": "the recorded forward raised; exc.partial_recording holds the prefix with "
                                "on_forward_error='attach_partial'",
    "recording_backward_not_requested": "Recording.backward() on a recording made without gradient hooks "
                                        "(backward_ready=, save_grads= or default_grad=)",
    "recording_backward_inference_only": "Recording.backward() on a recording whose forward ran without grad",
    "record_episode_unsupported": "tl.record(..., episode=): episode capture runs on tl.trace",
    "record_option_unsupported": "a tl.record keyword this recorder does not support yet (the message names it)",
    "backward_ready_conflict": "tl.record got detach_saved_activations=True together with backward_ready=True",
    "record_generation_unsupported": "generation recording does not support this generate() configuration (the reason "
                                     "field names it)",
    "record_generation_step_missing": "a GenerationRecording has no such step, position or series",
    "record_generation_reducer_invalid": "a generation reducer raised, returned a non-tensor or a wrong first axis, "
                                         "or named a site or KV layer the forward lacks",
    "record_generation_options_invalid": "a malformed GenerationOptions, or generation= without generate_kwargs=",
    "record_generation_budget_exceeded": "the generation's retained bytes, projected after the first decode step, "
                                         "exceed GenerationOptions(max_saved_bytes=)",
})
_register("PayloadUnavailableError", {
    "output_capture_stopped": "stop_after= ended the capture before the model returned",
})


# --- area: distributed (issue 24: tl.distributed arming, collective boundary ops, merge_ranks) ---
_register("BackendUnsupportedError", {
    "distributed_unavailable_runtime": "tl.distributed.arm() in a process whose framework has no distributed "
                                       "package (torch.distributed.is_available() is False)",
    "distributed_sharded_state_unsupported": "a capture saw sharded state (DTensor or FSDP-sharded parameters): a "
                                             "rank-local shard is not captured; refused at capture entry",
    "distributed_wrapper_unsupported": "a capture of a DistributedDataParallel wrapper: capture wrapper.module "
                                       "instead (the same forward; DDP's gradient all-reduce runs in backward)",
    "distributed_collective_unsupported": "a torch.distributed call during an armed capture in a form the recorder "
                                          "does not record (the message names it); refused instead of dropping it",
})
_register("ArtifactError", {
    "merge_artifact_tampered": "a rank trace's collective boundary record does not match its own saved values or "
                               "its collective_boundary_v1 schema (edited after capture)",
    "merge_run_mismatch": "merge_ranks got rank traces from different runs (their run ids differ)",
    "merge_duplicate_rank": "merge_ranks got two traces of the same global rank",
    "merge_boundary_unmatched": "a collective boundary op has no matching op on a member rank given to merge_ranks "
                                "(a rank is missing or the ranks ran different collectives)",
    "distributed_scope_invalid": "a trace's provenance distributed_scope is outside its closed vocabulary (None, "
                                 "'rank_local_shard')",
    "merge_boundary_mismatch": "matched boundary ops disagree on kind, reduce op, geometry or values (the "
                               "verdict names the field)",
})
_register("InvalidArgumentError", {
    "merge_input_invalid": "merge_ranks / merge_report got something other than a non-empty list of traces or "
                           "saved trace paths, or a trace captured without tl.distributed arming",
    "merge_output_ambiguous": "MergedTrace.output: the ranks whose outputs depend on every rank's inputs "
                              "returned different values",
})


# --- area: runnable (issue 25: trace.save(level="runnable"), trace.runnable, Readiness) ---
_register("ArtifactError", {
    "runnable_capture_not_replayable": "save(level='runnable') of a trace not captured with "
                                       "CaptureOptions(replayable=True), or captured with save_mode other than 'copy'",
    "runnable_trace_edited": "save(level='runnable') of a trace that was intervened on (edits, a recipe, direct "
                             "writes): the artifact would not be the captured forward",
    "runnable_op_unsupported": "save(level='runnable'): an op on the taken path has no name in the backend's "
                               "closed callable table, an argument with no portable encoding, an input at a path "
                               "other than args[i] / kwargs['k'], or the capture marked it not re-executable",
    "runnable_payload_missing": "save(level='runnable'): a value the run needs (a buffer's or a constant's saved "
                                "payload) was not saved by the capture",
    "runnable_state_missing": "save(level='runnable'): the capture-time parameter snapshot is missing or does "
                              "not match the parameter records",
    "runnable_descriptor_invalid": "load of a runnable artifact: the manifest's runnable object, "
                                   "runnable/descriptor.json or runnable/state.safetensors is malformed or does not "
                                   "match the trace's records",
})
_register("InvalidArgumentError", {
    "runnable_input_mismatch": "Runnable.run got inputs whose count, names, shapes or dtypes differ from the "
                               "captured inputs, or a value the backend cannot hold",
    "runnable_unavailable": "Runnable.run of an artifact whose readiness is 'unavailable' (the reasons say why)",
})


def register_codes(cls_name: str, codes: Mapping[str, str]) -> None:
    """Register further codes (used by `tl.backends` for the refusal codes)."""
    _register(cls_name, codes)


def load_all_codes() -> None:
    """Import every core module, so codes a module registers for itself are in the table."""
    import importlib
    import pkgutil

    import torchlens

    for info in pkgutil.walk_packages(torchlens.__path__, "torchlens."):
        if info.name.endswith("__main__") or info.name == "torchlens.cli":
            continue
        importlib.import_module(info.name)


def render_error_codes_markdown() -> str:
    """The text of `docs/reference/error-codes.md`, generated from `ERROR_CODES` after
    every core module has registered its codes."""
    load_all_codes()
    lines = [
        "# Error codes",
        "",
        "Every typed error carries `exc.code`, `exc.fields` and `exc.remedy`. Branch on the",
        "code, never on the message. This page is generated from `torchlens.errors.ERROR_CODES`",
        "(`python -m torchlens.errors > docs/reference/error-codes.md`); a test checks it is current.",
        "",
        "| code | error class | meaning |",
        "|---|---|---|",
    ]
    for code in sorted(ERROR_CODES):
        cls_name, meaning = ERROR_CODES[code]
        lines.append(f"| `{code}` | `{cls_name}` | {meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    from torchlens.errors import render_error_codes_markdown as _render  # the package's registry, not __main__'s

    print(_render(), end="")
