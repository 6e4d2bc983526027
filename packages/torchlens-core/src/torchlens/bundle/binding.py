"""Token-stream bindings: what makes a fed_by row's token spans checkable (experimental).

A binding names the captured token stream a member's span coordinates index: the first
integer-dtype input (`stream="input"`) or output (`"output"`) of the trace, one `batch_row`
of it, its measured `length` and `ids_digest`, the member's own `completion` range (half-open
stream positions of what the member generated), the `excluded_ids` outside the eligible set
(padding, special tokens) and `tokenizer` / `template` identity strings. It is a
`token_boundary_v1` descriptor of the reserved `"torchlens.boundary_facts"` sidecar family,
attached with `attach_sidecar(trace, "torchlens.boundary_facts", facts)` before relating.
Without one, a batch-of-one capture whose ids were saved gets a derived input-stream binding
(no completion range).

`ids_digest` is the sha256 of the stream's ids as little-endian int64, hex. Bindings live in
memory beside the trace (like parameter snapshots); `Bundle.save` writes each member's
binding into the bundle manifest and `Bundle.load` attaches it again, re-checked.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from torchlens.errors import BundleError

FAMILY = "torchlens.boundary_facts"
SCHEMA = "token_boundary_v1"
STREAMS = ("input", "output")
_FIELDS = ("schema", "stream", "batch_row", "length", "ids_digest", "completion", "excluded_ids", "tokenizer",
           "template")

_BINDINGS: "weakref.WeakKeyDictionary[Any, TokenBinding]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class TokenBinding:
    """One member's token_boundary_v1 descriptor (experimental); `derived` marks the input-stream
    binding relate derives for a batch-of-one capture (never attached, never saved)."""

    stream: str = "input"
    batch_row: int = 0
    length: int | None = None
    ids_digest: str | None = None
    completion: tuple[int, int] | None = None
    excluded_ids: tuple[int, ...] = ()
    tokenizer: str | None = None
    template: str | None = None
    derived: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "stream": self.stream, "batch_row": self.batch_row, "length": self.length,
                "ids_digest": self.ids_digest, "completion": None if self.completion is None else list(self.completion),
                "excluded_ids": list(self.excluded_ids), "tokenizer": self.tokenizer, "template": self.template}


def ids_digest(ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").tobytes()).hexdigest()


def _bad(why: str, **fields: Any) -> BundleError:
    return BundleError("token_binding_invalid", f"token binding: {why}",
                       remedy=f"attach a {SCHEMA} mapping whose fields describe the trace's own token ids", **fields)


def stream_ids(trace: Any, stream: str = "input", batch_row: int = 0) -> np.ndarray | None:
    """The retained token ids of `trace`'s first integer-dtype input (or output) at `batch_row`,
    as a 1-D int array; None when no such stream was saved."""
    from torchlens.bundle.align import payload_arrays

    ops = trace.input_ops if stream == "input" else [op for op in trace if op.kind == "output"]
    for op in ops:
        arrays = payload_arrays(trace, op, "out")
        if arrays is None or len(arrays) != 1:
            continue
        ids = np.asarray(arrays[0])
        if ids.dtype.kind not in "iu" or ids.ndim not in (1, 2):
            continue
        if ids.ndim == 1:
            return ids if batch_row == 0 else None
        return ids[batch_row] if batch_row < ids.shape[0] else None
    return None


def _int(v: Any, what: str) -> int:
    if type(v) is not int or v < 0:
        raise _bad(f"{what} must be a non-negative int", field=what)
    return v


def make_binding(trace: Any, facts: Mapping[str, Any]) -> TokenBinding:
    """A checked binding from a token_boundary_v1 mapping; length and ids_digest are filled in
    from the retained ids when left out, and must agree with them when given."""
    if not isinstance(facts, Mapping):
        raise _bad(f"the descriptor is a mapping, not {type(facts).__name__}")
    extra = sorted(set(facts) - set(_FIELDS))
    if extra:
        raise _bad(f"unknown fields {extra} (fields: {list(_FIELDS)})", field=extra[0])
    if facts.get("schema", SCHEMA) != SCHEMA:
        raise _bad(f"schema must be {SCHEMA!r}", field="schema")
    stream = facts.get("stream", "input")
    if stream not in STREAMS:
        raise _bad(f"stream must be one of {STREAMS}", field="stream")
    row = _int(facts.get("batch_row", 0), "batch_row")
    ids = stream_ids(trace, stream, row)
    length, digest = facts.get("length"), facts.get("ids_digest")
    if length is not None:
        _int(length, "length")
    if digest is not None and not (type(digest) is str and len(digest) == 64):
        raise _bad("ids_digest must be a sha256 hex string", field="ids_digest")
    if ids is not None:
        if length is not None and length != ids.shape[0]:
            raise _bad(f"length={length} but the {stream} stream holds {ids.shape[0]} ids", field="length")
        if digest is not None and digest != ids_digest(ids):
            raise _bad(f"ids_digest does not match the {stream} stream's retained ids", field="ids_digest")
        length, digest = int(ids.shape[0]), ids_digest(ids)
    comp = facts.get("completion")
    if comp is not None:
        if not (isinstance(comp, (list, tuple)) and len(comp) == 2):
            raise _bad("completion is a [start, end) pair of stream positions", field="completion")
        c0, c1 = _int(comp[0], "completion"), _int(comp[1], "completion")
        if c0 > c1 or (length is not None and c1 > length):
            raise _bad(f"completion [{c0}, {c1}) is not inside the stream's {length} tokens", field="completion")
        comp = (c0, c1)
    excl = facts.get("excluded_ids") or ()
    if not isinstance(excl, (list, tuple)) or not all(type(x) is int for x in excl):
        raise _bad("excluded_ids is a list of token ids", field="excluded_ids")
    for name in ("tokenizer", "template"):
        v = facts.get(name)
        if v is not None and type(v) is not str:
            raise _bad(f"{name} is an identity string", field=name)
    return TokenBinding(stream, row, length, digest, comp, tuple(sorted(set(excl))), facts.get("tokenizer"),
                        facts.get("template"))


def attach_sidecar(trace: Any, family: str, facts: Mapping[str, Any]) -> TokenBinding:
    """Attach a `"torchlens.boundary_facts"` token_boundary_v1 descriptor to `trace` (replacing
    an earlier one) and return the checked binding."""
    from torchlens.records.trace import Trace

    if not isinstance(trace, Trace):
        raise _bad(f"a binding attaches to a tl.Trace, not {type(trace).__name__}")
    if family != FAMILY:
        raise _bad(f"sidecar family {family!r} is not {FAMILY!r} (the only family this build reads)", field="family")
    binding = make_binding(trace, facts)
    _BINDINGS[trace] = binding
    return binding


def attached(trace: Any) -> TokenBinding | None:
    return _BINDINGS.get(trace)


def binding_of(trace: Any) -> TokenBinding | None:
    """The member's binding: the attached one, else the derived input-stream binding of a
    batch-of-one capture whose ids were saved, else None."""
    held = _BINDINGS.get(trace)
    if held is not None:
        return held
    from torchlens.bundle.align import input_token_stream

    ids = input_token_stream(trace)
    if ids is None:
        return None
    return TokenBinding("input", 0, int(ids.shape[0]), ids_digest(ids), derived=True)


def bound_ids(trace: Any, binding: TokenBinding | None) -> np.ndarray | None:
    """The retained ids the binding names, or None (not bound, or ids not retained)."""
    if binding is None:
        return None
    return stream_ids(trace, binding.stream, binding.batch_row)


def restore(trace: Any, facts: Mapping[str, Any]) -> None:
    """Attach a binding read back from a bundle artifact (checked like a new one)."""
    _BINDINGS[trace] = make_binding(trace, facts)


__all__ = ["FAMILY", "SCHEMA", "TokenBinding", "attach_sidecar", "binding_of", "bound_ids", "ids_digest",
           "stream_ids", "attached"]
