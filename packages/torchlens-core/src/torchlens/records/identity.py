"""Provenance identity facts every backend's capture gets from core (spec glossary l. 16):
the structural `fingerprint`, the input tree (`input_structure`, `input_signature_hash`,
`input_object_id`) and the lazily computed `param_hash_full`. Framework-free: tensors are
read through duck-typed `shape`/`dtype` and the backend's `is_tensor`/`host_copy`.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Mapping
from typing import Any

#: Scalars whose value (not just type) enters `input_structure`.
_SCALARS = (bool, int, float, str, type(None))
_MAX_DEPTH = 32


def stamp_identity(trace: Any, backend: Any, args: tuple, kwargs: dict, changed_params: Any) -> None:
    """Write the identity facts of a finished capture into `trace.provenance.extra`;
    `changed_params(trace, addresses)` names the parameters changed since the capture (the
    intervention layer's stamps), which `param_hash_full` refuses to hash."""
    extra = trace.provenance.extra
    extra.pop("fingerprint", None)
    # computed on first read of provenance.fingerprint (or at save/pickle), not per capture:
    # it walks every op, which a capture that never reads it should not pay for
    ops, modules = trace._ops, trace._modules
    trace.provenance.__dict__["_fingerprinter"] = lambda: _fingerprint_rows(ops, modules)
    text = input_structure(backend, args, kwargs)
    extra["input_structure"] = text
    extra["input_signature_hash"] = hashlib.sha256(text.encode()).hexdigest()
    firsts = list(args[:1]) or list(kwargs.values())[:1]
    extra["input_object_id"] = id(firsts[0]) if firsts else None
    trace.provenance.__dict__["_param_hasher"] = _full_param_hasher(weakref.ref(trace), backend, changed_params)


def structural_fingerprint(trace: Any) -> str:
    """sha256 hex over every op (execution order) of: callable name, kind, parent positions,
    output shapes and dtypes, and the class of the module it ran in. Addresses, labels,
    weights and input values do not enter it."""
    return _fingerprint_rows(trace._ops, trace._modules)


def _fingerprint_rows(ops: Any, modules: Any) -> str:
    position = {label: i for i, label in enumerate(ops)}
    rows = []
    for op in ops.values():
        owner = modules.get(op.module) if op.module else None
        rows.append([op.func_name, op.kind, [position.get(p, -1) for p in op.parents],
                     [None if s is None else list(s) for s in op.shapes or ()],
                     [None if d is None else str(d) for d in op.dtypes or ()],
                     getattr(owner, "class_qualname", None)])
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def input_structure(backend: Any, args: tuple, kwargs: dict) -> str:
    """One `path: description` line per input leaf, in argument order."""
    lines: list[str] = []

    def visit(v: Any, path: str, depth: int) -> None:
        if backend.is_tensor(v):
            shape = list(getattr(v, "shape", ()) or ())
            lines.append(f"{path}: {type(v).__name__}{[int(d) for d in shape]} {_dtype_name(v)}")
        elif isinstance(v, _SCALARS):
            lines.append(f"{path}: {type(v).__name__} {v!r}")
        elif depth < _MAX_DEPTH and type(v) in (tuple, list):
            lines.append(f"{path}: {type(v).__name__} of {len(v)}")
            for i, item in enumerate(v):
                visit(item, f"{path}[{i}]", depth + 1)
        elif depth < _MAX_DEPTH and isinstance(v, Mapping):
            lines.append(f"{path}: {type(v).__name__} of {len(v)}")
            for k, item in v.items():
                visit(item, f"{path}[{k!r}]", depth + 1)
        else:
            lines.append(f"{path}: {type(v).__module__}.{type(v).__qualname__}")

    for i, a in enumerate(args):
        visit(a, f"args[{i}]", 0)
    for k, a in kwargs.items():
        visit(a, f"kwargs[{k!r}]", 0)
    return "\n".join(lines)


def _dtype_name(v: Any) -> str:
    name = str(getattr(v, "dtype", "?"))
    return name.rsplit(".", 1)[-1]


def _full_param_hasher(ref: Any, backend: Any, changed_params: Any) -> Any:
    def full() -> tuple[str | None, str | None]:
        import numpy as np

        trace = ref()
        if trace is None:
            return None, "the trace that held the parameter values is gone"
        params = trace._params
        missing = [a for a, p in params.items() if p.value is None]
        if missing:
            return None, f"the trace holds no value for parameter {missing[0]!r}"
        changed = changed_params(trace, list(params))
        if changed:
            return None, (f"parameter {changed[0]!r} changed since the capture, so its capture-time bytes are gone "
                          "(read param_hash_full before changing parameters, or capture again)")
        h = hashlib.sha256()
        for p in params.values():
            h.update(json.dumps([list(p.addresses), list(p.shape), str(p.dtype)]).encode())
            h.update(np.ascontiguousarray(backend.host_copy(p.value)))
        return h.hexdigest(), None

    return full
