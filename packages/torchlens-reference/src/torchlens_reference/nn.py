"""A tiny module system over numpy arrays (the reference backend's "framework")."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from torchlens_reference import ops, runtime


class Parameter:
    """A named numpy array owned by a module."""

    def __init__(self, value: np.ndarray, trainable: bool = True) -> None:
        self.value = value
        self.trainable = trainable


class Module:
    """Base module: register children and parameters as attributes; override forward."""

    def __init__(self) -> None:
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_params", {})
        self.training = False

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Module):
            self._children[name] = value
        elif isinstance(value, Parameter):
            self._params[name] = value
        object.__setattr__(self, name, value)

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        yield prefix, self
        for name, child in self._children.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        for addr, mod in self.named_modules():
            for name, p in mod._params.items():
                yield (f"{addr}.{name}" if addr else name), p

    def forward(self, *args: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rec = runtime.RECORDER
        if rec is None:
            out = self.forward(*args, **kwargs)
            for hook in list(runtime.EXIT_HOOKS):
                out = hook(self, out)
            return out
        rec.enter(self, args)
        out = self.forward(*args, **kwargs)
        rec.exit(self, out)
        return out


class Linear(Module):
    def __init__(self, n_in: int, n_out: int, seed: int = 0) -> None:
        super().__init__()
        rng = np.random.default_rng(seed + n_in * 131 + n_out)
        self.weight = Parameter((rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32))
        self.bias = Parameter(np.zeros(n_out, dtype=np.float32))

    def forward(self, x):
        return ops.linear(x, self.weight.value, self.bias.value, params=(self.weight, self.bias))


class ReLU(Module):
    def forward(self, x):
        return ops.relu(x)


class Tanh(Module):
    def forward(self, x):
        return ops.tanh(x)


class Sequential(Module):
    def __init__(self, *layers: Module) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            setattr(self, str(i), layer)
        self._order = list(layers)

    def forward(self, x):
        for layer in self._order:
            x = layer(x)
        return x

    def __getitem__(self, i: int) -> Module:
        return self._order[i]


class LoopNet(Module):
    """Calls one Linear `steps` times in a loop: one Layer with `steps` passes."""

    def __init__(self, width: int = 4, steps: int = 3) -> None:
        super().__init__()
        self.inp = Linear(width, width, seed=1)
        self.cell = Linear(width, width, seed=2)
        self.act = Tanh()
        self.steps = steps

    def forward(self, x):
        h = self.inp(x)
        for _ in range(self.steps):
            h = self.act(self.cell(h))
        return h
