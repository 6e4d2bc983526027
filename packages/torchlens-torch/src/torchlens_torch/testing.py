"""Shared pytest fixtures and independent oracles for torch-backend tests.

A pytest plugin module, loaded explicitly (never auto-registered through `pytest11`):

    # conftest.py
    pytest_plugins = ["torchlens_torch.testing"]

The oracles here never use TorchLens: module outputs come from the test's own forward
hooks in a separate plain forward, call counts from a separate `TorchFunctionMode`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import random
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from torchlens_torch.zoo import ZOO, ZooEntry


# oracles ----------------------------------------------------------------------------------

def tensor_leaves(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensor leaves of nested tuples/lists/dicts and dataclasses (HF ModelOutput included), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 16:
        return []
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensor_leaves(item, depth + 1)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in tensor_leaves(item, depth + 1)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # a @dataclass output's fields, in order
        return [t for f in dataclasses.fields(obj) for t in tensor_leaves(getattr(obj, f.name, None), depth + 1)]
    return []


@contextlib.contextmanager
def mha_fastpath_disabled() -> Iterator[None]:
    """The capture turns the MHA/TransformerEncoderLayer fast path off; so do the oracles."""
    mha = torch.backends.mha
    before = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(before)


def hooked_module_outputs(model: nn.Module, args: tuple, kwargs: dict, seed: int = 0) -> dict[str, list[list[torch.Tensor]]]:
    """address -> one list of cloned output tensors per call, from per-module forward hooks
    in a plain forward (run on a deep copy so the model's own state is untouched)."""
    model = copy.deepcopy(model)
    seen: dict[str, list[list[torch.Tensor]]] = {}
    handles = []
    for name, mod in model.named_modules():
        addr = name or "self"

        def hook(m: nn.Module, inp: Any, out: Any, addr: str = addr) -> None:
            seen.setdefault(addr, []).append([t.detach().clone() for t in tensor_leaves(out)])

        handles.append(mod.register_forward_hook(hook))
    try:
        torch.manual_seed(seed)
        with mha_fastpath_disabled():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen


class CallCounter(TorchFunctionMode):
    """Counts torch calls that produce tensors (a tensor, a tuple/list holding one, or a
    tensor `__setitem__`), as any TorchFunctionMode sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "?")
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if isinstance(out, torch.Tensor):
            self.names.append(name)
        elif isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
            self.names.append(name)
        elif name == "__setitem__" and args and isinstance(args[0], torch.Tensor):
            self.names.append(name)
        return out


def count_torch_calls(model: nn.Module, args: tuple, kwargs: dict, seed: int = 0) -> list[str]:
    """Names of the tensor-producing torch calls of one plain forward (on a deep copy)."""
    model = copy.deepcopy(model)
    counter = CallCounter()
    torch.manual_seed(seed)
    with mha_fastpath_disabled(), counter:
        model(*args, **kwargs)
    return counter.names


def state_fingerprint(model: nn.Module) -> dict[str, Any]:
    """Everything a pure-observer capture must leave as it was."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return {
        "state_dict": buf.getvalue(),
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
        "training": {k: m.training for k, m in model.named_modules()},
        "attrs": {k: sorted(m.__dict__) for k, m in model.named_modules()},
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state()[1].copy(),
    }


def assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["state_dict"] == after["state_dict"], "state_dict bytes changed"
    assert before["buffers"].keys() == after["buffers"].keys()
    for k in before["buffers"]:
        assert torch.equal(before["buffers"][k], after["buffers"][k]), f"buffer {k} changed"
    assert before["training"] == after["training"], "training flags changed"
    assert before["attrs"] == after["attrs"], "module attributes added or removed"
    assert torch.equal(before["torch_rng"], after["torch_rng"]), "torch RNG advanced"
    assert before["python_rng"] == after["python_rng"], "python RNG advanced"
    assert np.array_equal(before["numpy_rng"], after["numpy_rng"]), "numpy RNG advanced"


# fixtures ---------------------------------------------------------------------------------

def _entry(name: str) -> ZooEntry:
    entry = ZOO[name]
    if not entry.available():
        pytest.skip(f"zoo entry {name!r} needs {', '.join(entry.requires)}")
    return entry


@pytest.fixture(params=sorted(ZOO))
def zoo_name(request: Any) -> str:
    """Every zoo entry's name (HF entries skip when transformers is missing)."""
    _entry(request.param)
    return request.param


@pytest.fixture
def zoo_case(zoo_name: str) -> tuple[nn.Module, tuple, dict]:
    """`(model, args, kwargs)` of one zoo entry, freshly built with seed 0."""
    return _entry(zoo_name).build(0)


@pytest.fixture
def build_zoo():
    """`build_zoo(name)` -> `(model, args, kwargs)`, skipping unavailable entries."""
    def build(name: str, seed: int = 0) -> tuple[nn.Module, tuple, dict]:
        return _entry(name).build(seed)

    return build


@pytest.fixture
def restore_rng():
    """Leaves the global random streams as the test found them."""
    state = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    yield
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])


__all__ = ["tensor_leaves", "hooked_module_outputs", "count_torch_calls", "CallCounter", "state_fingerprint",
           "assert_same_state", "mha_fastpath_disabled", "zoo_name", "zoo_case", "build_zoo", "restore_rng"]
