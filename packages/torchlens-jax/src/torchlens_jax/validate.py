"""Replay validation: re-execute every recorded op from its parents' saved payloads (and the
parameters it read) and compare with its own saved payload, bit for bit.

The walk, the argument filling and the typed failures are core's replay engine
(`replay_validate`); this module supplies `JaxReplayOps`. Each op's `func` binds its JAX
primitive with the equation's parameters, so the replay is that one primitive again.
Random primitives replay exactly because their key is a recorded input value. Constants and
other sources are leaves (`constant_producer_leaf`). Every op is checked; the first whose
replay differs is named with a reason from `tl.backends.VALIDATION_REASONS`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from torchlens.backends.sdk import BackendUnsupportedError, ReplayOpsBase, ValidationStatus, replay_validate


class JaxReplayOps(ReplayOpsBase):
    """The JAX side of core's replay engine: parents as arrays, a primitive's several results
    as its slots, comparison bit for bit on host copies (random primitives replay exactly
    because their key is a recorded input value, so no RNG state is restored)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def parent_value(self, op: Any, ref: Any, value: Any) -> Any:
        return _as_array(value)

    def outputs(self, op: Any, out: Any, args: tuple) -> tuple:
        return tuple(out) if getattr(op.func, "multiple_results", False) else (out,)

    def equal(self, a: Any, b: Any) -> bool:
        if a is None or b is None:
            return a is b
        ha, hb = self.backend.host_copy(a), self.backend.host_copy(b)
        return ha.shape == hb.shape and ha.dtype == hb.dtype and bool(np.array_equal(ha, hb, equal_nan=True))

    def preflight(self, trace: Any) -> None:
        _refuse_unreplayable(trace)


def validate_trace(backend: Any, trace: Any, ground_truth: Any = None) -> ValidationStatus:
    """Replay every op through core's engine (`replay_validate`) and compare; with
    `ground_truth`, the model's own outputs are compared with the output ops too."""
    truth = None if ground_truth is None else jax.tree_util.tree_leaves(ground_truth)
    return replay_validate(trace, JaxReplayOps(backend), ground_truth=truth)


def _as_array(value: Any) -> Any:
    return value if isinstance(value, jax.Array) else jax.numpy.asarray(value)


def _refuse_unreplayable(trace: Any) -> None:
    """A loaded trace holds callable placeholders (artifacts never store code), and the jax
    backend cannot yet rebuild a primitive call from saved records: refuse, typed."""
    from torchlens_jax.interpret import PrimitiveCall, ScanSlice, ScanStack

    for op in trace.ops:
        if op.kind == "op" and op.func is not None and not isinstance(op.func, (PrimitiveCall, ScanSlice, ScanStack)):
            raise BackendUnsupportedError(
                "validation_replay_unsupported",
                f"op {op.label!r} carries no replayable JAX primitive (a loaded trace keeps no code)",
                remedy="validate the live trace returned by tl.trace, before saving it", label=op.label)
