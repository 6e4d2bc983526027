"""`tl.trace(model, x, save="stats")` on torch (issue 23): each op's out is folded into its
16-slot float64 summary (`torchlens.backends.sdk.STATS_FOLD_SLOTS`) as the op runs, and no
payload or reference to the out is kept.

A `Folder` (one per capture, `new_fold()`) is the Recorder's `save_fn` for such a capture: it
returns a `FoldedStats` (copy-on-write references are off, so every save goes through it,
flushes included). It runs unrecorded, under `torch.no_grad()`, on the tensor's own device, and
never synchronises with it: the 16 values stay a device tensor until core reads them after the
forward. The out is read in slabs of at most `CHUNK` elements (views: a non-contiguous out is
never copied whole), each converted into the Folder's float64 scratch buffers (two float64 and
two bool buffers of at most `CHUNK` elements per device, reused for every op, so the fold
allocates nothing per op but 0-d results); the slabs' summaries are combined with the pairwise
(Chan / Pebay) formulas core's `RunningStats.merge` uses.

`WeakKeep` (`torchlens_torch.weak_keep`) replaces the Recorder's `keep` list for such a capture,
as for `save="none"`: the list holds every tagged tensor for the whole forward (so an id is never
reused while its tag is live), which would keep every intermediate alive, as a `save="all"`
capture does. `WeakKeep` holds none: when a tagged tensor is freed its tag is forgotten, so a new
tensor that gets the same id is not mistaken for it.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torchlens.backends.sdk import FoldedStats

#: elements per slab: the scratch buffers are at most 2 x CHUNK x 8 bytes (4 MiB) + 2 x CHUNK bool
CHUNK = 1 << 18

_INF = float("inf")
_F64 = torch.float64


def empty_vector(device: Any = None) -> torch.Tensor:
    """The summary of no elements: count 0, numel 0, min +inf, max -inf, the rest 0."""
    v = torch.zeros(16, dtype=_F64, device=device)
    v[5], v[6] = _INF, -_INF
    return v


def _foldable(t: torch.Tensor) -> bool:
    return not (t.dtype.is_complex or t.is_quantized) and t.device.type != "meta"


def _slabs(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views of `t` of at most CHUNK elements each that together cover it once."""
    n = t.numel()
    if n <= CHUNK:
        yield t
    elif t.is_contiguous():
        flat = t.view(-1)
        for start in range(0, n, CHUNK):
            yield flat[start:start + CHUNK]
    else:
        per = n // t.shape[0]
        if per > CHUNK:
            for i in range(t.shape[0]):
                yield from _slabs(t[i])
        else:
            rows = CHUNK // per
            for i in range(0, t.shape[0], rows):
                yield t[i:i + rows]


def _slab_vector(a: torch.Tensor, b: torch.Tensor, nonfin: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """The 16-slot summary of the float64 values in `a` (overwritten), with `b` (float64) and
    `nonfin`, `flag` (bool) as scratch of the same length. On the CPU an all-finite slab (its
    sum is finite) takes a shorter path with Python scalars; elsewhere nothing synchronises."""
    numel = a.numel()
    s = a.sum()
    if a.device.type == "cpu":
        total = s.item()
        if math.isfinite(total):  # no nan or inf in the slab (an overflowing sum takes the general path)
            lo, hi = (v.item() for v in torch.aminmax(a))
            abs_sum = torch.linalg.vector_norm(a, 1).item()
            pos = torch.gt(a, 0, out=flag).sum().item()
            neg = torch.lt(a, 0, out=flag).sum().item()
            mean = total / numel
            a.sub_(mean)  # deviations
            m2 = torch.mul(a, a, out=b).sum().item()  # (no BLAS dot: its threads spin under load)
            m3 = b.mul_(a).sum().item()
            m4 = b.mul_(a).sum().item()
            vals = (numel, mean, m2, m3, m4, lo, hi, abs_sum / numel, max(-lo, hi, 0.0), numel, 0, 0, 0,
                    numel - pos - neg, pos, neg)
            return torch.tensor(vals, dtype=_F64)
    dev = a.device
    torch.sub(a, a, out=b)
    torch.ne(b, 0, out=nonfin)  # inf - inf and nan - nan are nan: the non-finite elements
    nan = torch.ne(a, a, out=flag).sum(dtype=_F64)
    pos = torch.gt(a, 0, out=flag).sum(dtype=_F64)
    neg = torch.lt(a, 0, out=flag).sum(dtype=_F64)
    counts = (nan, torch.isposinf(a, out=flag).sum(dtype=_F64), torch.isneginf(a, out=flag).sum(dtype=_F64),
              numel - nan - pos - neg, pos, neg)
    n = numel - nonfin.sum(dtype=_F64)
    denom = n.clamp(min=1)
    a.masked_fill_(nonfin, 0.0)  # the finite values, 0 elsewhere
    mean = a.sum() / denom
    lo = b.copy_(a).masked_fill_(nonfin, _INF).min()
    hi = b.copy_(a).masked_fill_(nonfin, -_INF).max()
    zero = torch.zeros((), dtype=_F64, device=dev)
    abs_mean = torch.where(n > 0, torch.linalg.vector_norm(a, 1) / denom, zero)
    abs_max = torch.linalg.vector_norm(a, float("inf"))
    a.sub_(mean).masked_fill_(nonfin, 0.0)  # deviations of the finite values
    m2 = torch.mul(a, a, out=b).sum()
    m3 = b.mul_(a).sum()
    m4 = b.mul_(a).sum()
    numel_t = torch.full((), float(numel), dtype=_F64, device=dev)
    return torch.stack((n, mean, m2, m3, m4, lo, hi, abs_mean, abs_max, numel_t) + counts)


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two summaries of disjoint element sets as one (Chan / Pebay pairwise formulas, as
    core's `RunningStats.merge`); an empty side returns the other's moments unchanged."""
    na, nb = a[0], b[0]
    n = na + nb
    nn = n.clamp(min=1)
    d = b[1] - a[1]
    m = a[1] + d * nb / nn
    m2 = a[2] + b[2] + d * d * na * nb / nn
    m3 = a[3] + b[3] + d ** 3 * na * nb * (na - nb) / nn ** 2 + 3 * d * (na * b[2] - nb * a[2]) / nn
    m4 = (a[4] + b[4] + d ** 4 * na * nb * (na * na - na * nb + nb * nb) / nn ** 3
          + 6 * d * d * (na * na * b[2] + nb * nb * a[2]) / nn ** 2 + 4 * d * (na * b[3] - nb * a[3]) / nn)
    abs_mean = a[7] + (b[7] - a[7]) * nb / nn
    both = torch.stack((n, m, m2, m3, m4, torch.minimum(a[5], b[5]), torch.maximum(a[6], b[6]), abs_mean,
                        torch.maximum(a[8], b[8])))
    moments = torch.where(na == 0, b[:9], torch.where(nb == 0, a[:9], both))
    return torch.cat((moments, a[9:] + b[9:]))


class Folder:
    """One capture's fold: the Recorder's save_fn under save="stats" (see the module doc)."""

    __slots__ = ("_scratch",)

    def __init__(self) -> None:
        self._scratch: dict[Any, tuple[torch.Tensor, ...]] = {}

    def __call__(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return None
        return FoldedStats(self.vector(t))

    def _buffers(self, device: Any, k: int) -> tuple[torch.Tensor, ...]:
        bufs = self._scratch.get(device)
        if bufs is None or bufs[0].numel() < k:
            size = min(CHUNK, 1 << max(k - 1, 1).bit_length())  # grow by powers of two, at most CHUNK
            bufs = (torch.empty(size, dtype=_F64, device=device), torch.empty(size, dtype=_F64, device=device),
                    torch.empty(size, dtype=torch.bool, device=device), torch.empty(size, dtype=torch.bool, device=device))
            self._scratch[device] = bufs
        return tuple(x[:k] for x in bufs)

    def vector(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s 16-slot float64 summary (`STATS_FOLD_SLOTS`), on `t`'s device (computed outside
        the capture: no torch-function mode or subclass sees these calls, and no graph is made)."""
        with torch._C.DisableTorchFunction(), torch.no_grad():
            try:
                if not _foldable(t):
                    return empty_vector(t.device if t.device.type != "meta" else None)
                if t.layout != torch.strided:
                    t = t.to_dense()
                t = t.detach()
                if t.numel() == 0:
                    return empty_vector(t.device)
                vec = None
                for slab in _slabs(t):
                    a, b, nonfin, flag = self._buffers(t.device, slab.numel())
                    a.view(slab.shape).copy_(slab)
                    part = _slab_vector(a, b, nonfin, flag)
                    vec = part if vec is None else combine(vec, part)
                return vec
            except (RuntimeError, NotImplementedError, TypeError):  # no plain readable storage: not numeric data
                return empty_vector()


def new_fold() -> Folder:
    """A fresh Recorder save_fn for one save="stats" capture."""
    return Folder()


def vector(t: torch.Tensor) -> torch.Tensor:
    """`t`'s 16-slot float64 summary, on `t`'s device (a one-off Folder)."""
    return Folder().vector(t)
