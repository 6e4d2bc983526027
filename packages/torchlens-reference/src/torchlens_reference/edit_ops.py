"""Edit ops for the reference backend: numpy, plus replay under a recorded RNG state (they are
also its `ReplayOps` for core's replay engine)."""

from __future__ import annotations

import contextlib
from typing import Any

from torchlens.backends.sdk import NumpyEditOps, ReplayOpsBase


class ReferenceEditOps(NumpyEditOps, ReplayOpsBase):
    """Numpy edit ops that are also the reference backend's `ReplayOps` (validation and
    interventions replay through core's engine with them)."""

    @contextlib.contextmanager
    def rng_state(self, state: Any):
        if state is None:
            yield
            return
        from torchlens_reference import ops

        saved = ops.rng_state()
        ops.set_rng_state(state)
        try:
            yield
        finally:
            ops.set_rng_state(saved)
