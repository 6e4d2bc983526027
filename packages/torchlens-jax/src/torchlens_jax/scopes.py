"""Module ownership through JAX name stacks.

While `jax.make_jaxpr` traces the model, every module call runs inside a
`jax.named_scope("__tl<id>__")` whose id numbers the call in entry order. Each equation
carries its name stack in `eqn.source_info.name_stack`, so after tracing we read back, per
equation, exactly which module call (address and 1-based call number) it ran in. The
patch is class-level (the class in each module's MRO that defines `__call__`), dispatches
by object identity, and is removed when the trace ends.
"""

from __future__ import annotations

import functools
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import jax

_MARK = re.compile(r"^__tl(\d+)__$")
_ACTIVE = threading.local()


def marker(call_id: int) -> str:
    return f"__tl{call_id}__"


def call_ids(name_stack: Any) -> tuple[int, ...]:
    """The module-call ids named in an equation's name stack, outermost first."""
    out = []
    for scope in getattr(name_stack, "stack", ()):
        m = _MARK.match(getattr(scope, "name", "") or "")
        if m:
            out.append(int(m.group(1)))
    return tuple(out)


@dataclass
class CallTable:
    """Module calls in entry order: id -> (address, call number, parent id)."""

    calls: list[tuple[str, int, int]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def open(self, address: str, parent: int) -> int:
        n = self.counts.get(address, 0) + 1
        self.counts[address] = n
        self.calls.append((address, n, parent))
        return len(self.calls) - 1

    def chain(self, call_id: int) -> tuple[int, ...]:
        """Call ids from the root call to `call_id`, inclusive."""
        out = []
        c = call_id
        while c >= 0:
            out.append(c)
            c = self.calls[c][2]
        return tuple(reversed(out))


class Recorder:
    """Opens a named scope per module call while the model is traced."""

    def __init__(self, table: CallTable) -> None:
        self.table = table
        self.addr_of: dict[int, str] = {}
        self.keep: list[Any] = []  # objects named in addr_of during the trace (their ids stay theirs)
        self.stack: list[tuple[int, Any]] = []  # (call id, module object)

    @contextmanager
    def call(self, module: Any, address: str) -> Iterator[None]:
        parent = self.stack[-1][0] if self.stack else -1
        cid = self.table.open(address, parent)
        self.stack.append((cid, module))
        try:
            with jax.named_scope(marker(cid)):
                yield
        finally:
            self.stack.pop()


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec: Recorder | None = getattr(_ACTIVE, "recorder", None)
        if rec is None:
            return original(self, *args, **kwargs)
        address = rec.addr_of.get(id(self))
        if address is None or (rec.stack and rec.stack[-1][1] is self):  # unknown, or super().__call__
            return original(self, *args, **kwargs)
        with rec.call(self, address):
            return original(self, *args, **kwargs)

    __call__.__torchlens_wrapped__ = True  # type: ignore[attr-defined]
    return __call__


def _defining_class(cls: type) -> type | None:
    for c in cls.__mro__:
        if "__call__" in c.__dict__:
            return None if c is object else c
    return None


@contextmanager
def module_scopes(modules: list[Any], recorder: Recorder) -> Iterator[None]:
    """Patch `__call__` of every class defining it for `modules`, route calls through
    `recorder`, and restore the classes afterwards (also on error)."""
    patched: list[tuple[type, Any]] = []
    seen: set[type] = set()
    try:
        for m in modules:
            cls = _defining_class(type(m))
            if cls is None or cls in seen:
                continue
            seen.add(cls)
            original_attr = cls.__dict__["__call__"]
            if getattr(original_attr, "__torchlens_wrapped__", False):
                continue
            patched.append((cls, original_attr))
            setattr(cls, "__call__", _wrap(getattr(cls, "__call__")))
        _ACTIVE.recorder = recorder
        with _nnx_graph_paths(modules, recorder):
            yield
    finally:
        _ACTIVE.recorder = None
        for cls, original_attr in reversed(patched):
            setattr(cls, "__call__", original_attr)


@contextmanager
def _nnx_graph_paths(modules: list[Any], recorder: Recorder) -> Iterator[None]:
    """Keep nnx module identity through nnx transforms (`nnx.vmap`, `nnx.scan`, `nnx.remat`,
    ...): they split a module into (graphdef, state) and merge a new object inside. While the
    model traces, `graphlib.flatten` notes the address of each known module it splits (by the
    graphdef object it returns) and `graphlib.unflatten` gives the merged object, and every
    module under it, the address at the same graph path."""
    if not any(type(m).__module__.startswith("flax.") or "flax" in {c.__module__.split(".")[0] for c in type(m).__mro__}
               for m in modules):
        yield
        return
    from flax import nnx
    from flax.nnx import graphlib

    flatten, unflatten = graphlib.flatten, graphlib.unflatten
    split_of: dict[int, tuple[Any, str]] = {}  # id(graphdef) -> (graphdef kept alive, address)

    def flatten_noting(node: Any, *args: Any, **kwargs: Any) -> Any:
        out = flatten(node, *args, **kwargs)
        address = recorder.addr_of.get(id(node))
        if address is not None and isinstance(out, tuple) and out:
            split_of[id(out[0])] = (out[0], address)
        return out

    def unflatten_naming(graphdef: Any, *args: Any, **kwargs: Any) -> Any:
        node = unflatten(graphdef, *args, **kwargs)
        hit = split_of.get(id(graphdef))
        if hit is not None and hit[0] is graphdef:
            base = hit[1]
            for path, sub in nnx.iter_graph(node):
                if isinstance(sub, nnx.Module) and id(sub) not in recorder.addr_of:
                    rel = ".".join(str(p) for p in path)
                    recorder.addr_of[id(sub)] = (base if base != "self" else "") + ("." if rel and base != "self" else "") + rel \
                        if rel else base
                    recorder.keep.append(sub)  # the id stays this object's while the model traces
        return node

    graphlib.flatten, graphlib.unflatten = flatten_noting, unflatten_naming
    try:
        yield
    finally:
        graphlib.flatten, graphlib.unflatten = flatten, unflatten
