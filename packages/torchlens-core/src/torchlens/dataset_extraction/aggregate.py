"""`tl.stats.aggregate`: stream a dataloader through a model and fold chosen sites'
activations (a plain string key) or gradients (`tl.grad(site)`, needs `loss_fn=`) into
`tl.stats` accumulators, without keeping per-batch tensors.

Each batch is reduced to its own accumulator state, and the running state merges batch states
in global batch order. A data-parallel run (`distributed=`) has rank r compute the batches with
`index % world_size == r`; after every round of `world_size` batches the ranks exchange those
batch states (as `tl_stats_state_v1` bytes, no pickle) and every rank merges them in batch
order, so the result is the same float64 state, bit for bit, as the one-process run. Pass the
same, unsharded dataloader on every rank, in the same order.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from torchlens.dataset_extraction import batching
from torchlens.dataset_extraction._memory import per_batch_collection
from torchlens.dataset_extraction.parallel import resolve_group
from torchlens.errors import InvalidArgumentError
from torchlens.stats._base import KINDS, Accumulator
from torchlens.stats.decomp import CKA
from torchlens.stats.moments import CrossCovariance
from torchlens.stats.order import Quantile, TopK
from torchlens.stats.state import dumps_state, loads_state

_PAIRED = (CKA, CrossCovariance)


def _bad(why: str, remedy: str = "metrics={'relu_3': tl.stats.Mean(), tl.grad('relu_3'): tl.stats.Mean()}") -> InvalidArgumentError:
    return InvalidArgumentError("aggregate_metric_invalid", why, remedy=remedy)


def _key_sites(key: Any) -> list[tuple[str, str]]:
    """[(kind, site)] a metric key reads: ('act', s) or ('grad', s); a pair key reads two."""
    from torchlens.select.selectors import GradSelector

    if isinstance(key, str) and key:
        return [("act", key)]
    if isinstance(key, GradSelector) and isinstance(key.site, str):
        return [("grad", key.site)]
    if isinstance(key, tuple) and len(key) == 2:
        return _key_sites(key[0]) + _key_sites(key[1])
    raise _bad(f"metric key {key!r} is not a site name, tl.grad(site name) or a pair of them")


def canonical_key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, tuple):
        return "(" + ", ".join(canonical_key(k) for k in key) + ")"
    return repr(key)


def aggregate(model: Any, dataloader: Any, metrics: Any, loss_fn: Callable[[Any], Any] | None = None, *,
              distributed: Any = None, backend: str | None = None, cache: bool = False,
              cache_dir: Any = None) -> dict[str, Accumulator]:
    """Fold every batch of `dataloader` (each item one batch: an input, a tuple of inputs or a
    dict of keyword inputs) into `metrics` ({key: accumulator}); returns {canonical key:
    accumulator}, the same accumulators, folded. `loss_fn(output)` gives the loss whose
    backward fills gradient keys. A pair key `(site_a, site_b)` feeds CKA / CrossCovariance."""
    from torchlens.capture import trace
    from torchlens.options import CaptureOptions

    if not isinstance(metrics, dict) or not metrics:
        raise _bad("metrics is not a non-empty dict")
    if not isinstance(cache, bool):
        raise InvalidArgumentError("invalid_argument", f"cache= takes True or False, not {cache!r}", remedy="cache=True")
    if cache_dir is not None and not cache:
        raise InvalidArgumentError("invalid_argument", "cache_dir= is given without cache=True",
                                   remedy="aggregate(..., cache=True, cache_dir=path)")
    reads: dict[Any, list[tuple[str, str]]] = {}
    for key, acc in metrics.items():
        if not isinstance(acc, Accumulator) or KINDS.get(type(acc).__name__) is not type(acc):
            raise _bad(f"metrics[{key!r}] is a {type(acc).__name__}, not a tl.stats accumulator")
        reads[key] = _key_sites(key)
        if (len(reads[key]) == 2) != isinstance(acc, _PAIRED):
            raise _bad(f"metrics[{key!r}]: a pair key goes with CKA/CrossCovariance and only there",
                       remedy="{('layer1', 'layer2'): tl.stats.CKA()}")
    need_grad = any(kind == "grad" for r in reads.values() for kind, _ in r)
    if need_grad and loss_fn is None:
        raise InvalidArgumentError("aggregate_loss_fn_required", "a gradient metric key needs loss_fn=",
                                   remedy="aggregate(model, loader, metrics, loss_fn=lambda out: out.sum())")
    if loss_fn is not None and not callable(loss_fn):
        raise InvalidArgumentError("invalid_argument", "loss_fn= is not callable", remedy="loss_fn=lambda out: out.sum()")
    batching.check(dataloader, None, None)
    group = resolve_group(distributed)
    run_key = None
    if cache:  # keyed by value (stats_cache.py): a hit restores the states and skips the loop
        from torchlens.dataset_extraction import stats_cache

        if group.world_size > 1:
            raise stats_cache._unkeyable("a multi-process group (each rank would key and write on its own)",
                                         part="distributed", world_size=group.world_size)
        run_key = stats_cache.cache_key(model, dataloader, metrics, loss_fn, backend, canonical_key)
        hit = stats_cache.load_entry(cache_dir, run_key, metrics, canonical_key)
        if hit is not None:
            for k, acc in metrics.items():
                acc._load_state(hit[k].state_dict())
            return {canonical_key(k): acc for k, acc in metrics.items()}
    sites = sorted({site for r in reads.values() for _, site in r})
    capture = CaptureOptions(save_grads=need_grad, detach_saved_activations=not need_grad)
    work = {key: acc.copy() for key, acc in metrics.items()}
    for key, acc in metrics.items():
        if hasattr(acc, "encoder"):
            work[key].encoder = acc.encoder

    def batch_states(b: batching.Batch) -> dict[Any, Accumulator]:
        t = trace(model, *b.args, save=sites, capture=capture, input_kwargs=b.kwargs or None, backend=backend)
        proto = t._backend
        if need_grad:
            t.backward(loss_fn(t.output))
        values = {}
        for kind, site in {x for r in reads.values() for x in r}:
            v = t.ops[site].out if kind == "act" else t.ops[site].grad
            values[(kind, site)] = np.asarray(proto.host_copy(v))
        del t
        collect()  # free the batch's Trace now (see _memory.py)
        out = {}
        for key, acc in work.items():
            fresh = type(acc).from_config(acc.config())
            if hasattr(acc, "encoder"):
                fresh.encoder = acc.encoder
            args = [values[r] for r in reads[key]]
            if isinstance(fresh, TopK) or (isinstance(fresh, Quantile) and fresh.mode == "reservoir"):
                fresh.update(*args, example_ids=np.arange(b.start, b.stop))
            else:
                fresh.update(*args)
            out[key] = fresh
        return out

    round_: list[batching.Batch] = []

    def flush() -> None:
        mine = round_[group.rank] if group.rank < len(round_) else None
        states = batch_states(mine) if mine is not None else None
        if group.world_size == 1:
            for key, st in (states or {}).items():
                work[key].merge(st)
            return
        blob = b"" if states is None else _pack([dumps_state(states[k]) for k in work])
        for r, got in enumerate(group.all_gather_bytes(blob)):
            if r >= len(round_):
                continue
            for key, data in zip(work, _unpack(got)):
                work[key].merge(loads_state(data, encoder=getattr(work[key], "encoder", None), where=f"rank {r}"))

    with per_batch_collection() as collect:
        for b in batching.iter_batches(dataloader, None, None):
            round_.append(b)
            if len(round_) == group.world_size:
                flush()
                round_.clear()
        if round_:
            flush()
    for mkey, acc in metrics.items():
        acc._load_state(work[mkey].state_dict())
    if run_key is not None:
        stats_cache.save_entry(cache_dir, run_key, metrics, canonical_key)
    return {canonical_key(k): acc for k, acc in metrics.items()}


def _pack(parts: list[bytes]) -> bytes:
    return b"".join(len(p).to_bytes(8, "little") + p for p in parts)


def _unpack(blob: bytes) -> list[bytes]:
    out, off = [], 0
    while off < len(blob):
        if off + 8 > len(blob):
            raise InvalidArgumentError("distributed_group_invalid", "a rank sent a truncated state exchange",
                                       remedy="check every rank runs the same aggregate call")
        n = int.from_bytes(blob[off:off + 8], "little")
        out.append(blob[off + 8:off + 8 + n])
        off += 8 + n
    return out
