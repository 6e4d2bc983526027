"""Edit ops for the reference backend: numpy, plus replay under a recorded RNG state."""

from __future__ import annotations

import contextlib
from typing import Any

from torchlens.backends.sdk import NumpyEditOps


class ReferenceEditOps(NumpyEditOps):
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
