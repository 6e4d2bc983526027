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


# Tier-3 oracles (conformance cells c3_*): each model's computation written by hand in numpy ---
#
# `forward(tap, *args)` recomputes the model from its weights and calls `tap(label, value)` at
# each op output it reproduces (labels are the trace's), so the suite can edit the site.
# The reference framework has no autodiff, so no entry supplies a gradient oracle.

_NO_GRADS = "the reference framework has no autodiff (backward_capture is False)"


def _lin(layer: nn.Linear, x: np.ndarray) -> np.ndarray:
    return x @ layer.weight.value.T + layer.bias.value


def _mlp_forward(m: nn.Sequential):
    def forward(tap, x):
        h = tap("relu_1_2", np.maximum(tap("linear_1_1", _lin(m[0], x)), 0).astype(x.dtype))
        return tap("linear_2_3", _lin(m[2], h))
    return forward


def _loop_forward(m: nn.LoopNet):
    def forward(tap, x):
        h = tap("linear_1_1", _lin(m.inp, x))
        for i in range(1, m.steps + 1):
            h = tap(f"tanh_1_3:{i}", np.tanh(tap(f"linear_2_2:{i}", _lin(m.cell, h))))
        return h
    return forward


def _constant_forward(m: ConstantNet):
    def forward(tap, x):
        h = tap("add_1_3", np.add(tap("linear_1_1", _lin(m.fc, x)), _CONST))
        return tap("relu_1_4", np.maximum(h, 0).astype(h.dtype))
    return forward


def _random_forward(m: RandomNet):
    def forward(tap, x):  # the same draw from the framework's stream, after the same reseed
        return tap("add_1_3", np.add(tap("linear_1_1", _lin(m.fc, x)), ops.noise(x.shape)))
    return forward


def _c3(forward, site: str, other: np.ndarray) -> dict:
    return {"site": site, "forward": forward, "other_args": (other,), "other_kwargs": {},
            "grads_not_applicable": _NO_GRADS}


def zoo() -> dict[str, dict]:
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    other = np.cos(np.arange(12, dtype=np.float32)).reshape(3, 4)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    loop, constant, random = nn.LoopNet(4, 3), ConstantNet(), RandomNet()
    return {
        "mlp": {"model": mlp, "args": (x,), "kwargs": {}, "c3": _c3(_mlp_forward(mlp), "relu_1_2", other)},
        "loop": {"model": loop, "args": (x,), "kwargs": {}, "c3": _c3(_loop_forward(loop), "tanh_1_3:2", other)},
        "constant": {"model": constant, "args": (x,), "kwargs": {},
                     "c3": _c3(_constant_forward(constant), "add_1_3", other)},
        "random": {"model": random, "args": (x,), "kwargs": {}, "reseed": lambda: ops.seed(1234),
                   "c3": _c3(_random_forward(random), "linear_1_1", other)},
    }
