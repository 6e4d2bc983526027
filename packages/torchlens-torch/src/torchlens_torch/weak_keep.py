"""`WeakKeep`: the Recorder's `keep` for captures that hold no payloads (`save="none"`, and
`save="stats"`, whose payloads are folded summaries).

The Recorder tags each tensor it records by `id()`. Its plain `keep` list holds every tagged
tensor until the forward ends, so that no id is reused while its tag is live. A `save="all"`
capture keeps those tensors as payloads anyway. A capture that keeps no payloads would hold
every intermediate only for that reason. Its peak memory would then be a `save="all"`
capture's, and all of them would be freed at once, cold, inside the `tl.trace` call: about
1.6 µs per tensor on a loop of tiny ops, where a plain forward frees each one as it goes.

`WeakKeep` holds none of them. It keeps a weak reference per tagged tensor. When the tensor is
freed, its tag in `tags` is set to None, which reads as no tag (at the Recorder's next hook or
handler entry, see `WeakKeep`), so a new tensor that gets the same id is not mistaken for it.
A tensor whose Python object torch keeps alive because C++ still owns it (a view's base, a
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


class _Ref(weakref.ref):
    """A weak reference that carries what its tensor leaves behind: the tensor's id (`key`), and
    its newest `grad_fn` that is not None and the tag it had then (`grad`, `tag`; `grad` is None
    when it never had one)."""

    __slots__ = ("key", "grad", "tag")


class WeakKeep:
    """Remembers tagged tensors without keeping them alive (see the module docstring).

    A freed tensor's weak reference lands in `dead` (the callback is the list's own `append`:
    no Python call per freed tensor); `purge()` then drops the tags of those tensors. The
    Recorder purges at the entry of every hook and handler that reads tags, and once after the
    forward: a tensor it looks up is alive there, so any earlier owner of its id died before
    the entry, and that owner's tag is gone by the time the lookup runs.

    Per tagged tensor it makes one `_Ref` (its key and grad facts in slots) and one entry in
    `_refs`; a freed tensor costs one pop from `dead` and one lookup at the next purge."""

    __slots__ = ("_refs", "_tags", "dead_grad_owners", "dead", "_on_dead", "_strong", "__weakref__")

    def __init__(self, tags: dict) -> None:
        self._refs: dict[int, Any] = {}  # id -> weak reference to the tensor tagged at that id
        self._tags = tags
        self.dead_grad_owners: list[tuple[Any, tuple[int, int]]] = []
        self.dead: list[Any] = []  # weak references whose tensors were freed, not purged yet
        self._on_dead = self.dead.append  # (one bound method for every reference)
        self._strong: list[Any] = []

    def append(self, t: Any) -> None:
        """Remember `t`, just tagged (an in-place op re-appends its tensor with its new tag)."""
        k = id(t)
        refs = self._refs
        r = refs.get(k)
        if r is None or r() is not t:
            try:
                r = _Ref(t, self._on_dead)
            except TypeError:  # not weak-referenceable: keep it (as the plain list does)
                refs[k] = _Strong(t)
                return
            r.key = k
            r.grad = None
            refs[k] = r
        g = t.grad_fn if (type(t) is _Tensor or isinstance(t, _Tensor)) else None
        if g is not None:  # the newest node and tag: what a freed tensor leaves behind
            r.grad = g
            r.tag = self._tags.get(k)

    def purge(self) -> None:
        """Drop the tags of the tensors freed since the last purge (set them to None)."""
        dead, refs, tags = self.dead, self._refs, self._tags
        while dead:
            r = dead.pop()
            k = r.key
            if refs.get(k) is r:  # (not yet replaced by a newer tensor's reference)
                del refs[k]
                if k in tags:
                    # None reads as "no tag" (the Recorder reads tags with `.get(...)` and tests
                    # for None). Not popped: CPython hands a freed tensor's address to the next
                    # one, so the same ids come back over and over; the slot is kept for them
                    tags[k] = None
            g = r.grad
            if g is not None and r.tag is not None:
                self.dead_grad_owners.append((g, r.tag))

    def hold(self, t: Any) -> None:
        """Keep `t` alive until the capture ends (its id keys another table than the tags)."""
        self._strong.append(t)
        self.append(t)

    def __iter__(self) -> Iterator[Any]:
        self.purge()
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
