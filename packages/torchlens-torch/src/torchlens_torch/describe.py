"""Describe the model before the forward: module tree, parameters, buffers and the
identity maps the per-op handler uses (module, parameter and buffer objects by `id`).

Module-held plain tensors (a tensor attribute, a list/tuple item or a dict value, up to
four container levels, and public tensor attributes of plain objects a module holds) are
buffers too (spec: Parameter / Buffer, "Module-held tensors").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchlens.backends.sdk import BufferInfo, ModelInfo, ModuleInfo, ParamInfo

from torchlens_torch.values import dtype_name

#: Attributes every nn.Module carries for torch's own bookkeeping; never user state.
MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"_compiled_call_impl"}

_MAX_CONTAINER_DEPTH = 4
_SKIP_TYPES = (str, bytes, int, float, bool, type(None), nn.Module, torch.dtype, torch.device)


@dataclass
class ModelDescription:
    """What the capture knows about the model before the forward starts."""

    info: ModelInfo
    module_address: dict[int, str]  # id(module) -> canonical address
    modules: list[tuple[str, nn.Module]]  # canonical (address, module) pairs, root first
    param_address: dict[int, str]
    buffer_address: dict[int, str]
    held: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # module-held plain tensors


def _escape_key(key: Any) -> str:
    return repr(key).replace("%", "%25").replace(".", "%2E").replace(":", "%3A")


def describe_model(root: nn.Module) -> ModelDescription:
    """Walk `root` once and build the description and the identity maps."""
    all_addrs: dict[int, list[str]] = {}
    order: list[tuple[str, nn.Module]] = []
    walk = list(root.named_modules(remove_duplicate=False))
    for name, mod in walk:
        addr = name or "self"
        lst = all_addrs.get(id(mod))
        if lst is None:
            all_addrs[id(mod)] = [addr]
            order.append((addr, mod))
        else:
            lst.append(addr)
    module_address = {id(m): a for a, m in order}
    modules = [ModuleInfo(a, type(m).__name__, type(m).__qualname__, None, tuple(all_addrs[id(m)]), bool(m.training))
               for a, m in order]

    # one walk instead of two `named_parameters` walks: every module path of each parameter
    # (a tie has several), then the parameters in `named_parameters()` order (first module
    # occurrence, first path)
    params: list[ParamInfo] = []
    param_address: dict[int, str] = {}
    paths: dict[int, list[str]] = {}
    for name, mod in walk:
        prefix = name + "." if name else ""
        for pname, p in mod._parameters.items():
            if p is not None:
                paths.setdefault(id(p), []).append(prefix + pname)
    for addr, mod in order:
        prefix = "" if addr == "self" else addr + "."
        for pname, p in mod._parameters.items():
            if p is None or id(p) in param_address:
                continue
            name = prefix + pname
            param_address[id(p)] = name
            params.append(ParamInfo(name, addr, pname, tuple(p.shape), dtype_name(p.dtype), bool(p.requires_grad),
                                    p, str(p.device), tuple(a for a in paths[id(p)] if a != name)))

    buffers: list[BufferInfo] = []
    buffer_address: dict[int, str] = {}
    for addr, mod in order:
        prefix = "" if addr == "self" else addr + "."
        nonpersistent = mod._non_persistent_buffers_set
        for bname, b in mod._buffers.items():
            if b is None or id(b) in buffer_address:
                continue
            full = prefix + bname
            buffer_address[id(b)] = full
            buffers.append(BufferInfo(full, addr, bname, tuple(b.shape), dtype_name(b.dtype), b,
                                      bname not in nonpersistent, str(b.device)))

    held: list[tuple[str, torch.Tensor]] = []
    no_tensors: set[int] = set()  # plain objects already seen to hold no tensor
    for addr, mod in order:
        prefix = "" if addr == "self" else addr + "."
        # (most attributes are scalars: filtered here, without a call each)
        for attr, value in [(a, v) for a, v in mod.__dict__.items() if type(v) not in _LEAF_TYPES]:
            if attr in MODULE_INTERNALS:
                continue
            _collect_held(prefix + attr, value, 0, held, param_address, buffer_address, no_tensors)
    for full, t in held:
        owner, _, name = full.rpartition(".")
        buffer_address[id(t)] = full
        buffers.append(BufferInfo(full, owner or "self", name, tuple(t.shape), dtype_name(t.dtype), t, False, str(t.device)))

    info = ModelInfo(type(root).__name__, modules, params, buffers)
    return ModelDescription(info, module_address, order, param_address, buffer_address, held)


_LEAF_TYPES = frozenset({str, bytes, int, float, bool, type(None), torch.dtype, torch.device})
_SEQUENCES = frozenset({tuple, list})


def _collect_held(address: str, value: Any, depth: int, out: list, params: dict, buffers: dict, no_tensors: set) -> None:
    if type(value) in _LEAF_TYPES:
        return  # most module attributes
    if isinstance(value, torch.Tensor):
        if id(value) not in params and id(value) not in buffers and not any(value is t for _, t in out):
            out.append((address, value))
        return
    if depth >= _MAX_CONTAINER_DEPTH or isinstance(value, _SKIP_TYPES):
        return
    if type(value) in _SEQUENCES and _LEAF_TYPES.issuperset(map(type, value)):
        return  # a Conv2d's `kernel_size`, `_reversed_padding_repeated_twice`: nothing to walk
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            sub = f"{address}.{i}" if depth == 0 else f"{address}[{i}]"
            _collect_held(sub, item, depth + 1, out, params, buffers, no_tensors)
    elif isinstance(value, dict):
        seen: dict[str, int] = {}
        for key, item in value.items():
            text = _escape_key(key)
            n = seen.get(text, 0) + 1
            seen[text] = n
            sub = f"{address}[{text}]" if n == 1 else f"{address}[{text}#{n}]"
            _collect_held(sub, item, depth + 1, out, params, buffers, no_tensors)
    elif depth == 0 and hasattr(value, "__dict__") and not isinstance(value, type) and id(value) not in no_tensors:
        # a plain object held by the module: only its own public tensor attributes
        found = False
        try:
            attrs = vars(value)
        except TypeError:
            return
        for name, item in attrs.items():
            if not name.startswith("_") and isinstance(item, torch.Tensor):
                found = True
                if id(item) not in params and id(item) not in buffers:
                    out.append((f"{address}[{name}]", item))
        if not found:
            no_tensors.add(id(value))
