"""`WeakKeep`: the Recorder's `keep` for captures that hold no payloads (`save="none"`, and
`save="stats"`, whose payloads are folded summaries).

The Recorder tags each tensor it records by `id()`. Its plain `keep` list holds every tagged
tensor until the forward ends, so that no id is reused while its tag is live. A `save="all"`
capture keeps those tensors as payloads anyway. A capture that keeps no payloads would hold
every intermediate only for that reason. Its peak memory would then be a `save="all"`
capture's, and all of them would be freed at once, cold, inside the `tl.trace` call: about
1.6 µs per tensor on a loop of tiny ops, where a plain forward frees each one as it goes.

`WeakKeep` holds none of them. It keeps a weak reference per tagged tensor. When the tensor is
freed, its tag is dropped from `tags`, so a new tensor that gets the same id is not mistaken for
it. A tensor whose Python object torch keeps alive because C++ still owns it (a view's base, a
tensor autograd saved) is not freed, so its tag and id stay valid. `hold(t)` keeps a tensor
alive for the whole capture, for ids other tables key (buffers registered during the forward).

Iterating yields the tagged tensors still alive. A freed tensor that had a `grad_fn` (a capture
under grad mode) leaves `(grad_fn, tag)` in `dead_grad_owners`, so the autograd records can
still map that node to its op (the node is kept, not the tensor).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import torch

_Tensor = torch.Tensor


class WeakKeep:
    """Remembers tagged tensors without keeping them alive (see the module docstring)."""

    __slots__ = ("_refs", "_ids", "_tags", "_grad", "dead_grad_owners", "_gone", "_strong", "__weakref__")

    def __init__(self, tags: dict) -> None:
        refs: dict[int, Any] = {}  # id -> weak reference (or a strong holder)
        ids: dict[int, int] = {}  # id of the weak reference -> the tensor's id (the callback's way back;
        # keyed by the reference's own id: hashing a weak reference hashes its tensor, which a
        # capture's TorchFunctionMode would intercept)
        grads: dict[int, Any] = {}  # id -> the live tensor's current grad_fn (grad mode only)
        dead: list[tuple[Any, tuple[int, int]]] = []
        self._refs, self._ids, self._tags, self._grad, self.dead_grad_owners = refs, ids, tags, grads, dead
        self._strong: list[Any] = []

        def gone(r: Any) -> None:  # one callback for every reference: no closure per tensor
            k = ids.pop(id(r), None)
            if k is not None and refs.get(k) is r:  # not a newer object with the same id
                del refs[k]
                tag = tags.pop(k, None)
                g = grads.pop(k, None)
                if g is not None and tag is not None:
                    dead.append((g, tag))

        self._gone = gone

    def append(self, t: Any) -> None:
        k = id(t)
        if type(t) is _Tensor or isinstance(t, _Tensor):
            g = t.grad_fn
            if g is not None:
                self._grad[k] = g  # an in-place op re-appends its tensor: the newest node
        refs = self._refs
        old = refs.get(k)
        if old is not None and old() is t:
            return
        try:
            r = weakref.ref(t, self._gone)
        except TypeError:  # not weak-referenceable: keep it (as the plain list does)
            refs[k] = _Strong(t)
            return
        refs[k] = r
        self._ids[id(r)] = k

    def hold(self, t: Any) -> None:
        """Keep `t` alive until the capture ends (its id keys another table than the tags)."""
        self._strong.append(t)
        self.append(t)

    def __iter__(self) -> Iterator[Any]:
        for r in list(self._refs.values()):
            t = r()
            if t is not None:
                yield t

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Strong:
    __slots__ = ("t",)

    def __init__(self, t: Any) -> None:
        self.t = t

    def __call__(self) -> Any:
        return self.t


__all__ = ["WeakKeep"]
