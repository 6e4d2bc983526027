"""Torch implementations of core's intervention hooks: edit ops and module-output edits for
a bound executor. (Re-binding saved callable names lives in `callables.py`.)"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

import numpy as np
import torch

_Parameter = torch.nn.Parameter


class TorchEditOps:
    """The tensor math core's edit helpers run through (`backend.edit_ops()`)."""

    def arm_gradient_edits(self, trace: Any, labels: list[str], apply: Any) -> list[str]:
        """`engine="set_only"` gradient rules on the kept backward graph (core's
        `GradientArmingOps`): see `torchlens_torch.grad_arming`."""
        from torchlens_torch.grad_arming import arm_gradient_edits

        return arm_gradient_edits(trace, labels, apply)

    def zeros_like(self, x: Any) -> Any:
        return torch.zeros_like(x)

    def clone(self, x: Any) -> Any:
        return x.clone() if isinstance(x, torch.Tensor) else torch.as_tensor(x)

    def clip(self, x: Any, lo: Any, hi: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(x)
        return torch.clamp(x, lo, hi)

    def mean(self, x: Any, dim: Any, keepdim: bool) -> Any:
        if dim is None:
            dim = tuple(range(x.ndim))
        return x.mean(dim=dim, keepdim=keepdim)

    def norm(self, x: Any, dim: Any, keepdim: bool, p: float = 2.0) -> Any:
        return torch.linalg.vector_norm(x, ord=p, dim=dim, keepdim=keepdim)

    def randn_like(self, x: Any, seed: int) -> Any:
        g = torch.Generator(device=x.device).manual_seed(int(seed))
        return torch.randn(x.shape, generator=g, dtype=x.dtype, device=x.device)

    def permute_flat(self, x: Any, seed: int) -> Any:
        g = torch.Generator().manual_seed(int(seed))
        flat = x.reshape(-1)
        return flat[torch.randperm(flat.numel(), generator=g).to(x.device)].reshape(x.shape)

    def moveaxis(self, x: Any, src: int, dst: int) -> Any:
        return torch.movedim(x, src, dst)

    def where(self, mask: Any, a: Any, b: Any) -> Any:
        return torch.where(torch.as_tensor(mask, device=a.device), a, b)

    def asarray(self, v: Any, like: Any) -> Any:
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(np.ascontiguousarray(v))
        if like is None:
            return torch.as_tensor(v)
        return torch.as_tensor(v).to(dtype=like.dtype, device=like.device) if isinstance(v, torch.Tensor) else \
            torch.as_tensor(v, dtype=like.dtype, device=like.device)

    def param_stamp(self, p: Any) -> Any:
        """What replay compares to notice a parameter changed since capture: the version
        counter (bumped by optimizer steps, load_state_dict's copy_, in-place writes under
        no_grad), the storage pointer (moved by `param.data = t`), shape, dtype, device."""
        if type(p) is not _Parameter and not isinstance(p, torch.Tensor):  # (a Parameter, as a rule: no isinstance)
            return None
        try:
            version = p._version
        except RuntimeError:  # inference tensors keep no version counter
            version = None
        try:
            ptr = p.data_ptr()
        except (RuntimeError, NotImplementedError):  # no plain storage (some subclasses)
            ptr = None
        return (version, ptr, p.shape, p.dtype, p.device)  # (torch.Size: an immutable tuple)

    def grad_enabled(self) -> Any:
        """Replay with autograd on (differentiable replay)."""
        return torch.enable_grad()

    def replay_args(self, op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Arguments replay may run on without writing into saved payloads."""
        from torchlens_torch.validate import safe_replay_args

        return safe_replay_args(op, args, kwargs)

    @contextlib.contextmanager
    def rng_state(self, state: Any):
        """Run under a recorded CPU RNG state, then put the caller's back."""
        if state is None:
            yield
            return
        from torchlens_torch.concurrency import exclusive

        with exclusive("replay"):  # the global generator is process-wide: one user at a time
            saved = torch.get_rng_state()
            torch.set_rng_state(state)
            try:
                yield
            finally:
                torch.set_rng_state(saved)


def _edit_leaves(out: Any, fn: Any) -> tuple[Any, int]:
    """Apply `fn` to every tensor leaf of a module output; returns (output, leaves edited)."""
    if isinstance(out, torch.Tensor):
        return fn(out), 1
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        vals = [_edit_leaves(v, fn) for v in out]
        return type(out)(*[v for v, _ in vals]), sum(n for _, n in vals)
    if isinstance(out, (tuple, list)):
        vals = [_edit_leaves(v, fn) for v in out]
        return type(out)(v for v, _ in vals), sum(n for _, n in vals)
    if isinstance(out, dict):
        n = 0
        for k in list(out.keys()):
            out[k], m = _edit_leaves(out[k], fn)
            n += m
        return out, n
    if dataclasses.is_dataclass(out) and not isinstance(out, type):  # a @dataclass output: an edited copy
        new, n = copy.copy(out), 0
        for f in dataclasses.fields(out):
            if hasattr(out, f.name):
                v, m = _edit_leaves(getattr(out, f.name), fn)
                object.__setattr__(new, f.name, v)
                n += m
        return new, n
    return out, 0


class _Handles:
    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def attach_module_edits(root: torch.nn.Module, rules: list, ops: Any, fired: dict) -> _Handles:
    """Forward hooks that edit each targeted module's output leaves as it returns."""
    from torchlens.backends.sdk import LookupMissError, HookContext, fire

    handles = []
    calls: dict[int, int] = {}
    for i, (address, call, edit) in enumerate(rules):
        try:
            module = root if address == "self" else root.get_submodule(address)
        except AttributeError:
            raise LookupMissError("label_unknown", f"the model has no module {address!r}",
                                  remedy="use an address from dict(model.named_modules())", key=address) from None

        def hook(mod: Any, args: Any, out: Any, i: int = i, address: str = address, call: Any = call, edit: Any = edit) -> Any:
            n = calls[id(hook)] = calls.get(id(hook), 0) + 1
            if call is not None and n != call:
                return out
            ctx = HookContext(f"{address}:{n}", None, None, ops)
            new, count = _edit_leaves(out, lambda t: fire(edit, t, ctx))  # user code edits a copy, never the input
            if count:
                fired[i] = fired.get(i, 0) + 1
            return new

        handles.append(module.register_forward_hook(hook))
    return _Handles(handles)
