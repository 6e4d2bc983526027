"""The reference backend's small models, as (name, model, args) for tests and conformance."""

from __future__ import annotations

import numpy as np

from torchlens_reference import nn


def zoo() -> dict[str, tuple]:
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    return {
        "mlp": (nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), (x,), {}),
        "loop": (nn.LoopNet(4, 3), (x,), {}),
    }
