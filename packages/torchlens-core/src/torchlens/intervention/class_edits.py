"""Module-output edits by patching module classes' `__call__` while a handle is held: the
framework-neutral half of `attach_module_edits` for backends whose modules are plain Python
objects called through their class (JAX's flax/equinox, MLX). The backend supplies the classes
to patch and how to edit the arrays inside one module output."""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterable

from torchlens.errors import LookupMissError
from torchlens.intervention.edits import HookContext, fire

_ACTIVE = threading.local()


class AttachedClassEdits:
    """The patched classes of one `attach_class_edits`; `remove()` restores them."""

    def __init__(self, patched: list[tuple[type, Any]], state: dict) -> None:
        self._patched = patched
        self._state = state

    def remove(self) -> None:
        states = getattr(_ACTIVE, "states", [])
        if self._state in states:
            states.remove(self._state)
        for cls, original in reversed(self._patched):
            setattr(cls, "__call__", original)
        self._patched = []


def _wrap(original: Any) -> Any:
    token = object()  # this wrapper, told apart from the wrapper of another patched class

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        # One module call is edited once. A subclass whose __call__ reaches a patched base
        # class's __call__ through super() (Keras: Layer.__call__ -> Operation.__call__) re-enters
        # on the same object through another wrapper: that inner pass only runs the original.
        # The same wrapper re-entered (a module calling itself) is a call of its own.
        inflight = _ACTIVE.__dict__.setdefault("inflight", {})
        chain = inflight.setdefault(id(self), [])
        if chain and chain[-1] is not token:
            return original(self, *args, **kwargs)
        chain.append(token)
        try:
            out = original(self, *args, **kwargs)
        finally:
            chain.pop()
            if not chain:
                del inflight[id(self)]
        for state in list(getattr(_ACTIVE, "states", ())):
            out = state["on_exit"](self, out)
        return out

    __call__.__torchlens_edit_wrapped__ = True  # type: ignore[attr-defined]
    return __call__


def attach_class_edits(modules: list[tuple[str, Any]], rules: list, ops: Any, fired: dict, classes: Iterable[type],
                       edit_output: Callable[[Any, Callable[[Any], Any]], tuple[Any, int]]) -> AttachedClassEdits:
    """Edit each targeted module call's output as it returns. `modules` is the model's
    (address, module object) list; `rules` are (address, call number or None, edit);
    `classes` the classes whose `__call__` is patched; `edit_output(out, fn)` applies `fn` to
    each array inside one output and returns (new output, arrays edited). `fired[i]` counts
    the calls rule `i` edited."""
    addr_of = {id(m): a for a, m in modules}
    known = set(addr_of.values())
    for address, _call, _edit in rules:
        if address not in known:
            raise LookupMissError("label_unknown", f"the model has no module {address!r}",
                                  remedy="use a module address of the model (trace.modules lists them)", key=address)
    targeted = {a for a, _c, _e in rules}
    calls: dict[str, int] = {}

    def on_exit(module: Any, out: Any) -> Any:
        addr = addr_of.get(id(module))
        if addr is None or addr not in targeted:
            return out
        n = calls[addr] = calls.get(addr, 0) + 1
        for i, (address, call, edit) in enumerate(rules):
            if address != addr or (call is not None and call != n):
                continue
            ctx = HookContext(f"{addr}:{n}", None, None, ops)
            out, count = edit_output(out, lambda v, edit=edit, ctx=ctx: fire(edit, v, ctx))
            if count:
                fired[i] = fired.get(i, 0) + 1
        return out

    patched: list[tuple[type, Any]] = []
    for cls in classes:
        original = cls.__dict__["__call__"]
        if getattr(original, "__torchlens_edit_wrapped__", False):
            continue
        patched.append((cls, original))
        setattr(cls, "__call__", _wrap(original))
    state = {"on_exit": on_exit}
    if not hasattr(_ACTIVE, "states"):
        _ACTIVE.states = []
    _ACTIVE.states.append(state)
    return AttachedClassEdits(patched, state)


__all__ = ["AttachedClassEdits", "attach_class_edits"]
