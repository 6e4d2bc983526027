"""The fixed vocabularies backends share: refusal codes and validation reasons."""

from __future__ import annotations

from torchlens.errors import register_codes

#: capability flag -> the refusal code raised when it is False and the capability is asked for.
CAPABILITY_REFUSALS: dict[str, str] = {
    "backward_capture": "backward_capture_unsupported",
    "fastlog": "fastlog_unsupported",
    "interventions": "interventions_unsupported",
    "rng_replay": "rng_replay_unsupported",
    "streaming": "streaming_unsupported",
    "structure_only_capture": "structure_only_capture_unsupported",
    "validation_replay": "validation_replay_unsupported",
    "payload_materialization": "payload_materialization_unsupported",
    "intermediate_derived_grads": "intermediate_derived_grads_unsupported",
}

_OTHER_REFUSALS: dict[str, str] = {
    "trace_option_unsupported": "a trace option outside the backend's trace_options()",
    "module_identity_mode_unsupported": "the requested module identity mode is outside the backend's declared set",
    "save_level_unsupported": "the requested save level is outside the backend's declared set",
    "explicit_seed_unsupported": "seed= on a preview backend",
    "runtime_missing": "the backend's framework (or the backend package) is not importable",
    "runtime_version_unsupported": "the framework's version is outside the backend's supported range",
    "runtime_conflict": "the backend's framework cannot be loaded next to another framework already loaded in this "
                        "process (paddle's native core crashes when loaded after tensorflow's): refused instead of "
                        "crashing",
    "foreign_tensor_input": "an input leaf belongs to another framework",
    "constant_unrealizable": "a closure or literal constant has no readable buffer",
    "rng_state_in_graph": "the traced forward draws random numbers itself on a lazy backend",
    "unwrapped_op_in_capture": "a wrapper backend met a value with no captured producer",
    "runtime_mode_unsupported": "Paddle runs outside dygraph mode, or in PIR mode",
    "inplace_op_unsupported": "an in-place or global-state Paddle op runs inside the forward",
    "input_mutation_unsupported": "the traced tinygrad callable mutates an input",
    "tensor_output_required": "the traced tinygrad callable returns no tinygrad Tensor",
    "tinygrad_input_required": "no positional input of the tinygrad call is a tinygrad Tensor",
    "live_payloads_required": "tinygrad replay or derived gradients asked of an audit-only trace",
    "mid_capture_execution_unsupported": "the traced tinygrad callable realizes a tensor or runs TinyJit during capture",
    "traced_transform_entry_unsupported": "the MLX capture entry is an mx.compile, mx.grad or mx.vmap wrapper",
    "intervention_with_derived_grads_unsupported": "MLX grad_options= combined with intervene= or stop_after=",
    "intervention_result_invalid": "an MLX intervention returned a non-array or changed shape or dtype",
    "value_dependent_branch_unsupported": "the forward branches on a traced value the backend cannot follow",
    "followed_by_unsupported": "the backend cannot evaluate a followed_by temporal selector",
    "tf_stateful_op_unsupported": "the traced TensorFlow forward ran a stateful op that returns arrays (a seedless "
                                  "tf.random draw, a resource read other than ReadVariableOp), which a replay could "
                                  "not reproduce",
    "torchscript_boundary": "the forward enters TorchScript code whose ops cannot be observed",
}

REFUSAL_CODES: frozenset[str] = frozenset(CAPABILITY_REFUSALS.values()) | frozenset(_OTHER_REFUSALS)

register_codes("BackendUnsupportedError", {
    **{code: f"the backend declares {flag}=False and it was requested" for flag, code in CAPABILITY_REFUSALS.items()},
    **_OTHER_REFUSALS,
})

#: The closed list of per-op validation decision reasons.
VALIDATION_REASONS: frozenset[str] = frozenset({
    "replay_mismatch", "parent_payload_missing", "no_replayable_function",
    "constant_producer_leaf", "constant_parent_payload", "user_intervention_replacement",
    "effectful_region", "perturbation_insensitive", "dtype_tolerance_exceeded", "op_unclassified",
    "capture_inconsistent",
    "arg_logging_mismatch", "missing_saved_args", "dispatch_op_count_mismatch", "bfs_incomplete",
    "metadata_invariant_exception", "replay_execution_exception", "unattributed_tensor_arg",
    "dropped_parent_edge_witness",
    "declared_parents_inconsistent", "replay_coverage_incomplete",
    "replay_param_changed_since_capture",  # a parameter the op reads changed after capture
})

#: The closed list of rules under which a validation excuses what would otherwise fail: the
#: rule name in `decisions[*]["exemptions"][*]["rule"]` (a parent that does not move the
#: output) or `decisions[*]["compared"]` (how a replay was compared), with its meaning.
VALIDATION_EXEMPTIONS: dict[str, str] = {
    "zero_factor": "another operand is all zero (a zero state, a zero running mean, a zero-initialised weight or "
                   "gamma), so the parent cannot move the output; moving that operand makes it move",
    "constant_mask": "a bool operand is constant (all True or all False), so the unselected parent cannot move the "
                     "output; flipping the mask makes it move",
    "saturating_operand": "another operand holds the op where the parent cannot move the output; moving that "
                          "operand makes it move",
    "saturated_bound": "a clamp-like op (clamp, clip, hardtanh, relu, relu6) whose every input element lies beyond "
                       "a literal bound, so the output is that bound; fed a value inside the bounds it moves",
    "single_key_attention": "attention over a single key: the softmax weight is 1 whatever the query and key",
    "size_one_softmax": "a softmax over an axis of size 1 is constant whatever its input",
    "overwritten_receiver": "a *_scatter (a write through a view) whose source has as many elements as its receiver "
                            "overwrites every element of it",
    "discrete_output": "the output is bool or integer (a cast or comparison): a step function of a float parent "
                       "need not move under a perturbation (the record says whether a probe moved it)",
    "shape_dtype": "compared: the op returns uninitialised memory (empty, empty_like, new_empty, ...), so only its "
                   "shape and dtype are compared",
    "tolerance": "compared: the op ran inside a torch.compile'd region, so its eager replay is compared within a "
                 "tolerance derived from the dtype (32 epsilons, relative and scaled by the output's magnitude)",
}
