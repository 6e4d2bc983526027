"""The reference backend's small models for tests and the conformance suite.

Each entry is a dict: `model`, `args`, `kwargs`, and for the random-draw model `reseed`
(a callable that puts the random stream in a fixed state). Roles the suite looks for: `mlp`,
`loop`, `constant`, `random`.
"""

from __future__ import annotations

import numpy as np

from torchlens_reference import nn, ops

_CONST = np.array([0.5, -1.0, 2.0, 0.25], dtype=np.float32)


class ConstantNet(nn.Module):
    """Adds a closure constant (a tensor that is no input, parameter or op output)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, seed=3)

    def forward(self, x):
        return ops.relu(ops.add(self.fc(x), _CONST))


class RandomNet(nn.Module):
    """Draws noise from the reference framework's global stream inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, seed=4)

    def forward(self, x):
        return ops.add(self.fc(x), ops.noise(x.shape))


def zoo() -> dict[str, dict]:
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    return {
        "mlp": {"model": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), "args": (x,), "kwargs": {}},
        "loop": {"model": nn.LoopNet(4, 3), "args": (x,), "kwargs": {}},
        "constant": {"model": ConstantNet(), "args": (x,), "kwargs": {}},
        "random": {"model": RandomNet(), "args": (x,), "kwargs": {}, "reseed": lambda: ops.seed(1234)},
    }
